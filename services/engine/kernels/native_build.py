"""Builds the engine's native CPU kernels (C sources beside this file) once per machine and source.

Each shared library is compiled with the machine's C compiler (`$CC`, else `cc`) into
`$MPLEX_HOME/build/native/` under a key of the source, the compiler's version, the flags and the CPU's
feature flags (-march=native), written to a temporary name and renamed, so concurrent first uses are
safe. When no compiler works, `library()` raises NativeKernelUnavailable with the compiler's output, and
the engine falls back to its torch paths (cpu_kernel / cpu_attention = "auto").
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")


class NativeKernelUnavailable(RuntimeError):
    """A C kernel could not be built or loaded here (no compiler, a compile error, a bad library)."""


def build_dir() -> Path:
    return Path(os.environ.get("MPLEX_HOME") or ".mplex").resolve() / "build" / "native"


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(source: Path, cc: str, flags: tuple[str, ...]) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelUnavailable(f"C compiler {cc!r} does not run: {exc}") from exc
    h = hashlib.sha256()
    for part in (source.read_bytes(), version.encode(), " ".join(flags).encode(), _cpu_flags().encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile(source: Path, cc: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
    try:
        proc = subprocess.run([cc, *flags, str(source), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelUnavailable(f"compiling {source.name} with {cc!r} failed: {exc}") from exc
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeKernelUnavailable(f"compiling {source.name} with {cc!r} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)


def library(source: Path, name: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The path of `source` built for this machine (compiled on first use); raises NativeKernelUnavailable."""
    cc = compiler()
    path = build_dir() / f"{name}-{_build_key(source, cc, flags)}.so"
    if not path.exists():
        _compile(source, cc, flags, path)
    return path


def open_library(path: Path, abi_symbol: str, abi_version: int) -> ctypes.CDLL:
    """Load a built kernel and check its ABI version; raises NativeKernelUnavailable."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeKernelUnavailable(f"loading {path} failed: {exc}") from exc
    found = getattr(lib, abi_symbol)()
    if found != abi_version:
        raise NativeKernelUnavailable(f"{path} has ABI {found}, expected {abi_version}")
    return lib
