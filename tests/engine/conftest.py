"""Engine test factories: tiny random checkpoints (seconds), the trained demo kit (cached), engines."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig, SpeculativeConfig
from services.engine.core_client import CoreClient
from services.engine.core_process import run_core
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.sequence import Priority


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from services.modelkit import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0, max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_draft(tiny_model, tmp_path_factory) -> Path:
    """A draft model for tiny_model (same vocabulary): a copy whose last layer writes half as much into the
    residual stream. Its greedy guesses agree with the target's often, not always -- drafts get accepted in
    part, and rejected."""
    return damped_copy(tiny_model, tmp_path_factory.mktemp("tiny-draft"), scale=0.5)


def damped_copy(model_dir: Path, out: Path, *, scale: float) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(model_dir / "config.json", out / "config.json")
    sd = load_file(str(model_dir / "model.safetensors"))
    last = max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
    for k in sd:
        if k.startswith(f"model.layers.{last}.") and k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = sd[k] * scale
    save_file(sd, str(out / "model.safetensors"))
    return out


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    torch.set_num_threads(2)
    return LLMEngine(make_config(model_dir, **kw))


def make_config(
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
    inline_loads: bool = False,
    cpu_attention: str = "auto",
    swap_space_bytes: int | None = None,
    preemption_mode: str = "auto",
    prompt_sharing: bool = True,
    kv_dtype: str = "auto",
    failpoints: tuple[tuple[str, int], ...] = (),
    async_scheduling: bool = False,
    speculative: str = "off",
    draft_model: Path | None = None,
    device: str = "cpu",
    cpu_packed_gemm: bool = True,
    interactive_ttft_slo_s: float | None = None,
) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        device=device,
        dtype=dtype,
        weight_dtype=weight_dtype,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_bytes=64 * 2**20, enable_prefix_caching=prefix_caching,
                          swap_space_bytes=swap_space_bytes, preemption_mode=preemption_mode,
                          enable_prompt_sharing=prompt_sharing, kv_dtype=kv_dtype),
        # No TTFT budget unless a test asks for one: whether a burst is refused for overload must not depend
        # on this machine's speed (the oracle tests submit every request at once).
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                  interactive_ttft_slo_s=interactive_ttft_slo_s),
        lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
                        cpu_kernel=lora_kernel, inline_loads=inline_loads),
        cpu_attention=cpu_attention,
        cpu_packed_gemm=cpu_packed_gemm,
        failpoints=failpoints,
        async_scheduling=async_scheduling,
        # Draft lengths from acceptance only: which steps speculate must not depend on this machine's speed.
        speculative=SpeculativeConfig(method=speculative, adaptive_to_load=False, draft_model=draft_model),
    )


@contextlib.asynccontextmanager
async def split_engine(config: EngineConfig, frontend: str = "test-frontend") -> AsyncIterator[tuple[CoreClient, Any]]:
    """The engine as `mplex engine serve` runs it: a core process (spawned, as the launcher does) and a
    `CoreClient` in this process as its front-end. Yields (client, core process)."""
    ctx = multiprocessing.get_context("spawn")
    address = f"ipc://{tempfile.mkdtemp(prefix='mplex-core-')}/core.sock"
    proc = ctx.Process(target=run_core, args=(config, address, 2, "warning"), name="engine-core")
    proc.start()
    client = CoreClient(address, frontend)
    try:
        await client.open(timeout=120)
        yield client, proc
    finally:
        await client.close()
        proc.terminate()
        proc.join(15)
        if proc.is_alive():
            proc.kill()


async def collect(client: CoreClient, rid: str, prompt: list[int], params, **kw) -> RequestOutput:
    """Run one request on the split path; returns its tokens and text joined into one output."""
    tokens, text, last = [], "", None
    async for out in client.generate(rid, prompt, params, **kw):
        tokens += out.new_token_ids
        text += out.new_text
        last = out
    assert last is not None
    return dataclasses.replace(last, new_token_ids=tokens, new_text=text)


def run_all_split(config: EngineConfig, requests: list[dict], counters: dict | None = None) -> dict[str, list[int]]:
    """`run_all` on the split path: every request at once through a core process; the core's state is
    checked (check_integrity, nothing in flight) at the end, and its `counters` op copied into `counters`."""
    async def main():
        async with split_engine(config) as (client, _):
            outs = await asyncio.gather(*(
                collect(client, r["id"], r["prompt"], r["params"], adapter=r.get("adapter"),
                        cache_salt=r.get("salt", ""), priority=r.get("priority", Priority.INTERACTIVE))
                for r in requests))
            assert await client.op("check_integrity") and await client.op("num_in_flight") == 0
            if counters is not None:
                counters.update(await client.op("counters"))
            return {r["id"]: o.new_token_ids for r, o in zip(requests, outs)}

    return asyncio.run(main())


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


def spec_tokens(engine: LLMEngine, kind: str = "accepted") -> float:
    """Speculative draft ("draft") or accepted ("accepted") tokens of finished requests, over all adapters."""
    return sum(s.value for m in engine.metrics.registry.collect() if m.name == "mplex_engine_spec_tokens"
               for s in m.samples if s.name.endswith("_total") and s.labels.get("kind") == kind)
