"""Unpacks an uploaded adapter archive (.tar.gz, .tar or .zip) into a private sandbox directory, refusing
anything unsafe before a byte of it is written.

Only the two PEFT files are ever written, under names this module chooses (`<sandbox>/adapter_config.json`,
`<sandbox>/adapter_model.safetensors`), so no member name can steer a write. Member names are still
judged (absolute paths, `..`, links, device files are refused: such an archive is hostile, whatever it
holds), and every cap is enforced while reading: member count, total unpacked bytes and compression
ratio (zip declares sizes up front, so a zip bomb is refused before anything is decompressed; gzip is
measured as it streams). Pickles and code are refused by name and by content.
"""
from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from services.adapters.config import ArchiveLimits
from services.common.adapter_files import ADAPTER_FILES, classify, sniff_content
from services.common.lora_format import AdapterFormatError

_KEPT = ADAPTER_FILES
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A sandbox directory holding exactly the two PEFT files, and what was skipped on the way."""

    dir: Path
    kind: str  # "tar.gz" | "tar" | "zip"
    ignored: tuple[str, ...] = field(default=())
    unpacked_bytes: int = 0


def sniff_kind(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(512)
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08"):
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    if not head:
        raise AdapterFormatError("archive_empty", "the upload is empty")
    raise AdapterFormatError("unsupported_upload", "the upload is not a .tar.gz or .zip archive (or the two PEFT files)")


def unpack(upload: Path, sandbox: Path, limits: ArchiveLimits) -> Unpacked:
    """Unpack `upload` into `sandbox` (an empty private directory). Raises AdapterFormatError on anything unsafe."""
    kind = sniff_kind(upload)
    writer = _Writer(Path(sandbox), limits)
    if kind == "zip":
        _unpack_zip(upload, writer, limits)
    else:
        _unpack_tar(upload, writer, limits, compressed=kind == "tar.gz")
    writer.finish()
    return Unpacked(Path(sandbox), kind, tuple(writer.ignored), writer.total)


def check_member_name(name: str) -> None:
    """Refuse names that would point outside the archive's own tree, whatever we do with the member."""
    if not name or "\x00" in name or len(name) > 4096:
        raise AdapterFormatError("archive_unreadable", "an archive member has an empty or invalid name")
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":" and name[0].isalpha()):
        raise AdapterFormatError("archive_path_absolute", f"archive member {name!r} has an absolute path")
    if ".." in parts:
        raise AdapterFormatError("archive_path_traversal", f"archive member {name!r} points outside the archive ('..')")


class _Writer:
    """Writes the kept files into the sandbox under fixed names, charging every byte against the caps."""

    def __init__(self, sandbox: Path, limits: ArchiveLimits):
        self.sandbox = sandbox
        self.limits = limits
        self.members = 0
        self.total = 0
        self.ignored: list[str] = []
        self.written: set[str] = set()

    def member(self, name: str) -> None:
        self.members += 1
        if self.members > self.limits.max_files:
            raise AdapterFormatError("archive_too_many_files", f"the archive has more than {self.limits.max_files} members")
        check_member_name(name)

    def charge(self, n: int) -> None:
        self.total += n
        if self.total > self.limits.max_unpacked_bytes:
            raise AdapterFormatError("archive_too_large", f"the archive unpacks to more than {self.limits.max_unpacked_bytes} bytes")

    def write(self, name: str, src: BinaryIO, declared: int) -> None:
        base = PurePosixPath(name.replace("\\", "/")).name
        if base in self.written:
            raise AdapterFormatError("duplicate_file", f"the archive holds more than one {base}")
        if declared > self.limits.max_unpacked_bytes - self.total:
            raise AdapterFormatError("archive_too_large", f"{name!r} is {declared} bytes; the archive may unpack to at most {self.limits.max_unpacked_bytes}")
        target = self.sandbox / base  # never a name from the archive: one of two fixed names
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            first = True
            while chunk := src.read(_CHUNK):
                if first:
                    sniff_content(name, chunk[:16])
                    first = False
                self.charge(len(chunk))
                out.write(chunk)
        self.written.add(base)

    def finish(self) -> None:
        if self.members == 0:
            raise AdapterFormatError("archive_empty", "the archive is empty")
        for needed in _KEPT:
            if needed not in self.written:
                raise AdapterFormatError("missing_file", f"{needed} is missing from the upload", needed)


class _CountingReader(io.RawIOBase):
    """Decompressed bytes out of a gzip stream, refused once their total or ratio passes the caps."""

    def __init__(self, raw: BinaryIO, limits: ArchiveLimits):
        self.raw = raw
        self.gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self.limits = limits
        self.out = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        try:
            n = self.gz.readinto(b)
        except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
            raise AdapterFormatError("archive_unreadable", f"the gzip stream is corrupt: {exc}") from None
        self.out += n
        # The gzip layer may inflate at most as much as the archive may unpack to (plus tar headers).
        if self.out > self.limits.max_unpacked_bytes + 64 * (self.limits.max_files + 2) * 512:
            raise AdapterFormatError("archive_too_large", f"the archive unpacks to more than {self.limits.max_unpacked_bytes} bytes")
        consumed = max(self.raw.tell(), 1)
        if self.out > self.limits.ratio_floor_bytes and self.out / consumed > self.limits.max_ratio:
            raise AdapterFormatError("archive_compression_ratio", f"the archive expands more than {self.limits.max_ratio:g}x (a compression bomb?)")
        return n


def _unpack_tar(upload: Path, writer: _Writer, limits: ArchiveLimits, *, compressed: bool) -> None:
    with open(upload, "rb") as raw:
        stream: BinaryIO = io.BufferedReader(_CountingReader(raw, limits), _CHUNK) if compressed else raw
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for m in tar:
                    writer.member(m.name)
                    if m.issym():
                        raise AdapterFormatError("archive_symlink", f"archive member {m.name!r} is a symbolic link")
                    if m.islnk():
                        raise AdapterFormatError("archive_hardlink", f"archive member {m.name!r} is a hard link")
                    if m.isdir():
                        continue
                    if not m.isreg() or m.issparse():
                        raise AdapterFormatError("archive_special_file", f"archive member {m.name!r} is a device, FIFO or sparse file")
                    if m.size > limits.max_unpacked_bytes:
                        raise AdapterFormatError("archive_too_large", f"archive member {m.name!r} is {m.size} bytes")
                    if classify(m.name) == "ignore":
                        writer.ignored.append(m.name)
                        writer.charge(m.size)  # skipped, but the stream still inflates it
                        continue
                    src = tar.extractfile(m)
                    assert src is not None  # a regular file
                    writer.write(m.name, src, m.size)
        except tarfile.TarError as exc:
            raise AdapterFormatError("archive_unreadable", f"the tar archive is corrupt: {exc}") from None
        except EOFError:
            raise AdapterFormatError("archive_unreadable", "the tar archive is truncated") from None


def _unpack_zip(upload: Path, writer: _Writer, limits: ArchiveLimits) -> None:
    try:
        zf = zipfile.ZipFile(upload)
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError) as exc:  # NotImplementedError: a zip version
        raise AdapterFormatError("archive_unreadable", f"the zip archive is corrupt or unsupported: {exc}") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_files:
            raise AdapterFormatError("archive_too_many_files", f"the archive has {len(infos)} members; at most {limits.max_files} are accepted")
        # Everything the central directory declares is judged before a single byte is inflated.
        declared = 0
        seen: set[str] = set()
        for info in infos:
            check_member_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise AdapterFormatError("archive_symlink", f"archive member {info.filename!r} is a symbolic link")
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                raise AdapterFormatError("archive_special_file", f"archive member {info.filename!r} is a device, FIFO or socket")
            if info.flag_bits & 0x1:
                raise AdapterFormatError("archive_unreadable", f"archive member {info.filename!r} is encrypted")
            if info.filename in seen:
                raise AdapterFormatError("duplicate_file", f"the archive lists {info.filename!r} twice")
            seen.add(info.filename)
            if not info.is_dir():
                classify(info.filename)
            declared += info.file_size
            if info.file_size > limits.ratio_floor_bytes and info.file_size > limits.max_ratio * max(info.compress_size, 1):
                raise AdapterFormatError("archive_compression_ratio", f"{info.filename!r} expands {info.file_size / max(info.compress_size, 1):.0f}x (a zip bomb?)")
        if declared > limits.max_unpacked_bytes:
            raise AdapterFormatError("archive_too_large", f"the archive declares {declared} unpacked bytes; at most {limits.max_unpacked_bytes} are accepted")
        for info in infos:
            writer.member(info.filename)
            if info.is_dir():
                continue
            if classify(info.filename) == "ignore":
                writer.ignored.append(info.filename)
                continue
            try:
                with zf.open(info) as src:  # reads at most file_size bytes and checks the CRC
                    writer.write(info.filename, src, info.file_size)
            except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, NotImplementedError, zlib.error) as exc:
                raise AdapterFormatError("archive_unreadable", f"cannot read {info.filename!r}: {exc}") from None
