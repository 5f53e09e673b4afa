"""`ensure_demo`: the cached demo kit, built once per machine (and rebuilt when its recipe changes).

The cache lives in `$MPLEX_HOME/models/demo` (MPLEX_HOME defaults to `./.mplex`). A build key — the
hash of the kit's config, the modelkit sources and the torch/transformers/peft/tokenizers versions —
is written into `manifest.json`; a kit whose key differs is rebuilt. Concurrent callers (test
workers, the gateway, `make up`) serialise on a file lock and the build goes to a temporary
directory that is renamed into place, so nobody ever sees half a kit.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from services.modelkit.config import DEMO_CONFIG, DRAFT_DIR, KitConfig

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
        from services.modelkit.build import build_demo

        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=models))
        try:
            if progress:
                print(f">> building the demo model kit into {root} (one-off, a few minutes)", flush=True)
            build_demo(tmp, cfg, build_key=key, progress=progress)
            if root.exists():
                shutil.rmtree(root)
            tmp.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _load(root)
