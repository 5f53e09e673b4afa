"""`ensure_demo`: the cached demo kit, built once per machine (and rebuilt when its recipe changes).

The cache lives in `$MPLEX_HOME/models/demo` (MPLEX_HOME defaults to `./.mplex`). A build key — the
hash of the kit's config, the modelkit sources and the torch/transformers/peft/tokenizers versions —
is written into `manifest.json`; a kit whose key differs is rebuilt. Concurrent callers (test
workers, the gateway, `make up`) serialise on a file lock and the build goes to a temporary
directory that is renamed into place, so nobody ever sees half a kit.

Training amplifies the last bit of every fp32 reduction, and which SIMD path torch, MKL and oneDNN take
depends on the CPU (services/common/cpu_paths.py): kits built on an AVX-512 and on an AVX2-only machine
differed, and 14 tests calibrated on one failed on the other. So the build runs in its own process with those
paths pinned (`PINNED_ENV`, part of the build key) and fixed thread counts: the same key, the same bytes.

That build still takes 5-13 minutes, so the built kit is committed (`assets/demo-kit`, 'the pinned kit',
refreshed by `make kit`): a fresh machine whose build key matches copies it instead of training, and a test
fails when the sources move on without it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from services.common.cpu_paths import PINNED_ENV
from services.modelkit.config import DEMO_CONFIG, DRAFT_DIR, KitConfig

# The committed copy of the demo kit (see the module docstring); `pin()` refreshes it.
PINNED_DIR = Path(__file__).resolve().parents[2] / "assets" / "demo-kit"

_SOURCES = ("adapter_worker.py", "build.py", "config.py", "corpus.py", "draft.py", "evaluate.py", "tokenizer.py",
            "train.py")


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    name: str
    path: Path  # PEFT directory: adapter_config.json + adapter_model.safetensors
    eval_path: Path  # JSONL {"prompt", "expected"}
    rank: int
    target_modules: tuple[str, ...]
    task: str
    eval_exact_match: float | None = None  # PEFT on the fp32 base, measured at build time


@dataclass(frozen=True, slots=True)
class DemoKit:
    root: Path
    base_dir: Path  # Hugging Face model directory
    model_name: str
    base_eval: Path
    tools_eval: Path  # JSONL {"prompt", "expected", "system", "tool"}: `tool_choice: "auto"` (corpus.tool_eval_set)
    adapters: dict[str, DemoAdapter] = field(default_factory=dict)
    draft_dir: Path | None = None  # the speculative-decoding draft model (same tokenizer as the base)
    manifest: dict = field(default_factory=dict, compare=False, repr=False)


def default_home() -> Path:
    return Path(os.environ.get("MPLEX_HOME") or ".mplex").resolve()


def build_key(cfg: KitConfig = DEMO_CONFIG) -> str:
    import peft
    import tokenizers
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(repr(cfg).encode())
    h.update(repr(sorted(PINNED_ENV.items())).encode())
    here = Path(__file__).parent
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    for mod in (torch, transformers, peft, tokenizers):
        h.update(f"{mod.__name__}={mod.__version__}".encode())
    return h.hexdigest()[:20]


def _load(root: Path) -> DemoKit:
    manifest = json.loads((root / "manifest.json").read_text())
    adapters = {}
    for spec in manifest["config"]["adapters"]:
        name = spec["name"]
        info = manifest["adapters"][name]
        adapters[name] = DemoAdapter(
            name=name,
            path=root / "adapters" / name,
            eval_path=root / "evals" / f"{name}.jsonl",
            rank=int(spec["rank"]),
            target_modules=tuple(spec["target_modules"]),
            task=spec["task"],
            eval_exact_match=info.get("eval_exact_match"),
        )
    return DemoKit(
        root=root,
        base_dir=root / "base",
        model_name=manifest["model_name"],
        base_eval=root / "evals" / "base.jsonl",
        tools_eval=root / "evals" / "tools.jsonl",
        adapters=adapters,
        draft_dir=root / DRAFT_DIR if "draft" in manifest else None,
        manifest=manifest,
    )


def load_built(root: Path | str) -> DemoKit:
    """A kit built earlier, read as it is -- no build-key check. For a machine whose library versions differ
    from the build's (a GPU machine running tests/cuda on a kit built on the dev VM), where ensure_demo would
    build it all again."""
    root = Path(root)
    if not (root / "manifest.json").exists():
        raise FileNotFoundError(f"no built demo kit at {root} (run `make model`)")
    return _load(root)


def _current(root: Path, key: str) -> bool:
    try:
        return json.loads((root / "manifest.json").read_text()).get("build_key") == key
    except (OSError, ValueError):
        return False


def ensure_demo(home: Path | str | None = None, *, force: bool = False, progress: bool = True,
                cfg: KitConfig = DEMO_CONFIG) -> DemoKit:
    """The demo kit under `home` (default `$MPLEX_HOME`), building it first when missing or stale."""
    models = Path(home).resolve() / "models" if home is not None else default_home() / "models"
    root = models / ("demo" if cfg is DEMO_CONFIG else f"demo-{build_key(cfg)}")
    key = build_key(cfg)
    if not force and _current(root, key):
        return _load(root)
    models.mkdir(parents=True, exist_ok=True)
    with open(models / ".demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not force and _current(root, key):
            return _load(root)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=models))
        try:
            if not force and cfg is DEMO_CONFIG and _current(PINNED_DIR, key):
                shutil.copytree(PINNED_DIR, tmp, dirs_exist_ok=True)  # the committed build of these sources
            else:
                if progress:
                    print(f">> building the demo model kit into {root} (one-off, a few minutes)", flush=True)
                _build_pinned(tmp, cfg, key, progress)
            if root.exists():
                shutil.rmtree(root)
            tmp.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _load(root)


def _build_pinned(out_dir: Path, cfg: KitConfig, key: str, progress: bool) -> None:
    """`build_demo` in a fresh interpreter with `PINNED_ENV` (this one may have loaded torch on another path)."""
    import pickle

    env = {**os.environ, **PINNED_ENV, "OMP_NUM_THREADS": str(cfg.threads), "TOKENIZERS_PARALLELISM": "false"}
    job = pickle.dumps((str(out_dir), cfg, key, progress))
    proc = subprocess.run([sys.executable, "-m", "services.modelkit.build"], input=job, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the demo kit build failed (exit {proc.returncode}); its output is above")


def pinned_key() -> str | None:
    """The build key of the committed kit, or None when there is none."""
    try:
        return json.loads((PINNED_DIR / "manifest.json").read_text()).get("build_key")
    except (OSError, ValueError):
        return None


def pin(home: Path | str | None = None) -> Path:
    """Copy the current demo kit (building it first if needed) over the committed one, `PINNED_DIR`."""
    kit = ensure_demo(home)
    tmp = PINNED_DIR.with_name(PINNED_DIR.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(kit.root, tmp, ignore=shutil.ignore_patterns(".*"))
    shutil.rmtree(PINNED_DIR, ignore_errors=True)
    tmp.rename(PINNED_DIR)
    return PINNED_DIR
