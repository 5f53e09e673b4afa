"""Engine test factories: tiny random checkpoints (seconds), the trained demo kit (cached), engines."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.sequence import Priority


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from services.modelkit import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0, max_position_embeddings=256)


def make_engine(
    model_dir: Path,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    budget: int = 2048,
    max_seqs: int = 256,
    prefix_caching: bool = True,
    max_loras: int = 8,
    max_cpu_loras: int = 64,
    max_lora_rank: int = 64,
    weight_dtype: str = "auto",
    dtype: str = "float32",
    max_model_len: int | None = None,
    lora_kernel: str = "auto",
    cpu_attention: str = "auto",
    swap_space_bytes: int | None = None,
    preemption_mode: str = "auto",
    prompt_sharing: bool = True,
    kv_dtype: str = "auto",
) -> LLMEngine:
    torch.set_num_threads(2)
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype=dtype,
            weight_dtype=weight_dtype,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_bytes=64 * 2**20, enable_prefix_caching=prefix_caching,
                              swap_space_bytes=swap_space_bytes, preemption_mode=preemption_mode,
                              enable_prompt_sharing=prompt_sharing, kv_dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len),
            lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
                            cpu_kernel=lora_kernel),
            cpu_attention=cpu_attention,
        )
    )


def record_swaps(engine: LLMEngine) -> list[tuple[str, int, int]]:
    """Record every swap-out as (request id, computed tokens, prompt tokens): mid-prefill when
    computed < prompt."""
    swaps: list[tuple[str, int, int]] = []
    swap_out = engine.kv.swap_out

    def recording(seq):
        swaps.append((seq.request_id, seq.num_computed_tokens, seq.num_prompt_tokens))
        swap_out(seq)

    engine.kv.swap_out = recording
    return swaps


def run_all(engine: LLMEngine, requests: list[dict]) -> dict[str, list[int]]:
    """Add every request, step to completion checking integrity each step; returns tokens per id."""
    for r in requests:
        engine.add_request(r["id"], r["prompt"], r["params"], adapter=r.get("adapter"), cache_salt=r.get("salt", ""),
                           priority=r.get("priority", Priority.INTERACTIVE))
    out: dict[str, list[int]] = defaultdict(list)
    for r in requests:
        out[r["id"]] = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
        if engine.last_plan_empty:
            engine.wake.wait(0.05)
            engine.wake.clear()
    engine.check_integrity()
    return out
