"""Shared helpers for the adapter tests: greedy outputs straight from the engine library, eval-set files,
and polling a version until the pipeline has decided."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from services.common.lora_format import content_id


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
