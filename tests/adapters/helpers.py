"""Shared helpers for the adapter tests: greedy outputs straight from the engine library, eval-set files,
uploads through the pipeline's plain function, and polling a version until the pipeline has decided."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from services.common.lora_format import content_id
from services.common.audit import Actor

ACTOR = Actor(user_id=None, via="test")


def greedy_texts(model_dir: Path, prompts: list[str], *, adapter_dir: Path | None = None, max_tokens: int = 8,
                 weight_dtype: str = "auto") -> list[str]:
    """What the engine answers (chat template, greedy) with or without an adapter."""
    import torch

    from services.common.prompting import PromptBuilder
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig
    from services.engine.engine import LLMEngine
    from services.engine.sequence import AdapterRef, SamplingParams

    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, weight_dtype=weight_dtype, cache=CacheConfig(memory_bytes=32 << 20),
                                    lora=LoraConfig(max_loras=2, max_cpu_loras=2)))
    builder = PromptBuilder(model_dir)
    ref = AdapterRef(content_id(adapter_dir), "a", str(adapter_dir)) if adapter_dir is not None else None
    texts: dict[str, str] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", builder.chat_ids([{"role": "user", "content": p}]),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0), adapter=ref)
        texts[f"r{i}"] = ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            texts[out.request_id] += out.new_text
        if engine.last_plan_empty:
            engine.wake.wait(0.05)
            engine.wake.clear()
    engine.adapters.shutdown()
    return [texts[f"r{i}"] for i in range(len(prompts))]


def eval_jsonl(prompts: list[str], expected: list[str]) -> bytes:
    return "".join(json.dumps({"prompt": p, "expected": e}) + "\n" for p, e in zip(prompts, expected)).encode()


def wait_final(session_factory, version_id: uuid.UUID | str, timeout: float = 300) -> str:
    from services.common.models import AdapterVersion

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with session_factory() as s:
            status = s.get(AdapterVersion, uuid.UUID(str(version_id))).status
        if status.is_final:
            return str(status)
        time.sleep(0.25)
    raise AssertionError(f"version {version_id} still {status} after {timeout}s")


def upload(rt, tenant, name: str, adapter_dir: Path | None = None, *, data: bytes | None = None,
           eval_set: bytes | None = None, **thresholds):
    """An upload through services.adapters.upload (what the API and CLI call), committed; not yet ingested."""
    from services.adapters.base_model import ensure_base_model
    from services.adapters.upload import pack_dir, upload_adapter

    staging = rt.sandbox_root.parent / f"staging-{uuid.uuid4().hex[:6]}"
    staging.mkdir(parents=True)
    archive = pack_dir(adapter_dir, staging / "a.tar") if adapter_dir is not None else staging / "a.tar.gz"
    if data is not None:
        archive.write_bytes(data)
    with rt.session_factory() as s:
        base = ensure_base_model(s, name=rt.base_model_name, model_dir=rt.base_model_dir)
        result = upload_adapter(s, store=rt.store, config=rt.config, sandbox_root=rt.sandbox_root, base=base,
                                tenant_id=tenant.id, name=name, upload=archive, actor=ACTOR, eval_set=eval_set, **thresholds)
        s.commit()
    return result


def version(rt, version_id):
    from services.common.models import AdapterVersion

    with rt.session_factory() as s:
        return s.get(AdapterVersion, version_id)


def runs(rt, version_id) -> list:
    from sqlalchemy import select

    from services.common.models import EvalRun

    with rt.session_factory() as s:
        return list(s.scalars(select(EvalRun).where(EvalRun.adapter_version_id == version_id).order_by(EvalRun.attempt)))
