"""Adapter-pipeline fixtures: a tiny random base model (seconds), its dimensions, and the trained demo kit."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.adapters.base_model import BaseModel
from tests.adapters.tinymodel import build_tiny_model, dims_of


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-base") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_dims(tiny_base):
    return dims_of(tiny_base)


@pytest.fixture(scope="session")
def tiny_model_info(tiny_base, tiny_dims) -> BaseModel:
    """The tiny base as validation sees it (no database row needed for the plain validation functions)."""
    return BaseModel(id=None, name="tiny-llama", model_dir=tiny_base, dims=tiny_dims, max_lora_rank=64,
                     accepted_names=frozenset({"tiny-llama", str(tiny_base).lower()}))

