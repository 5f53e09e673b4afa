"""The committed demo kit (assets/demo-kit): current for these sources, and what a fresh home gets."""
from __future__ import annotations

import hashlib

from services.modelkit import build_key, ensure_demo
from services.modelkit.kit import PINNED_DIR, pinned_key


def _digest(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def test_the_committed_kit_is_the_build_of_these_sources():
    assert pinned_key() == build_key(), (
        "services/modelkit (or a pinned library) changed and assets/demo-kit was not rebuilt: every fresh "
        "machine would train the kit again. Run `make kit` and commit assets/demo-kit.")


def test_a_fresh_home_gets_the_committed_kit_without_training(tmp_path):
    kit = ensure_demo(tmp_path, progress=False)
    assert kit.root == (tmp_path / "models" / "demo").resolve()
    assert _digest(kit.root) == _digest(PINNED_DIR)
    assert set(kit.adapters) and kit.draft_dir is not None and (kit.base_dir / "model.safetensors").exists()
