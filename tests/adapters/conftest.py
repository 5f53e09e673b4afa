"""Adapter-pipeline fixtures: a tiny random base model (seconds), its dimensions, and a pipeline runtime on
the real Postgres and Redis that runs each next step inline."""
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



@pytest.fixture
def runtime(settings, db_engine, tiny_base, tmp_path, service_urls):
    import redis

    from services.adapters.config import GateDefaults, PipelineConfig
    from services.adapters.pipeline import InlineEnqueue, Runtime
    from services.adapters.storage import ObjectStore
    from services.common.db import make_sessionmaker

    enqueue = InlineEnqueue()
    rt = Runtime(
        session_factory=make_sessionmaker(db_engine),
        store=ObjectStore(str(tmp_path / "objects")),
        config=PipelineConfig(gate=GateDefaults(max_examples=8, max_new_tokens=8, latency_samples=1)),
        sandbox_root=tmp_path / "sandbox",
        base_model_dir=tiny_base,
        base_model_name="tiny-llama",
        enqueue=enqueue,
        redis=redis.Redis.from_url(service_urls.redis_url),
    )
    enqueue.runtime = rt
    return rt
