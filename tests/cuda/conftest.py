"""The CUDA paths on a real GPU: the Triton kernels compiled (not interpreted), FP8 `_scaled_mm`, and the engine
end to end on `cuda` against the same oracles as on the CPU (HF fp32 greedy, PEFT).

Every test here is skipped where CUDA is not available (the dev VM, CI). On a GPU machine run them in a pytest
process of their own -- `python -m pytest tests/cuda` -- because tests/engine/kernels sets TRITON_INTERPRET=1 for
its process, which would run these kernels in the interpreter. The demo kit is read as built on the dev VM
(`load_built`): the GPU machine's library versions differ, and ensure_demo would rebuild it.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    mine = [i for i in items if here in Path(str(i.fspath)).parents]
    if not torch.cuda.is_available():
        reason = "no CUDA device here: tests/cuda runs on a GPU machine (docs/engine.md, 'On a GPU')"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "TRITON_INTERPRET=1 in this process: run tests/cuda in a pytest process of its own"
    else:
        return
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def demo_kit(mplex_home: Path):
    from services.modelkit import load_built

    return load_built(mplex_home / "models" / "demo")
