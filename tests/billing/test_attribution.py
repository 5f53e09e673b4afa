"""Cost attribution against a REAL engine on the CPU: the compute-seconds requests report (ledger compute_us)
plus the unallocated idle time the registry sampler records equal the engine's measured wall time (1%).

The engine (LLMEngine + AsyncEngine on a tiny random Llama) heartbeats into the test Redis with its
busy/wall accounting; the billing sampler turns registry samples into engine_usage_reports windows; each
request's compute share lands in the ledger as the gateway writes it (int(compute_seconds * 1e6)).
Some requests are cancelled mid-stream, as clients do.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

import orjson
import pytest
from sqlalchemy import insert

from services.billing.engines import engine_totals, sample_engines
from services.common.ids import new_request_id
from services.common.models import UsageEvent
from services.common.engine_registry import entry_key
from tests.factories import make_tenant, unique

pytestmark = pytest.mark.slow


def build_tiny_checkpoint(out: Path) -> Path:
    """A small random Llama checkpoint with a byte-level BPE tokenizer (HF layout: config.json,
    model.safetensors, tokenizer.json). Enough compute per step that step time is measurable."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"request {i} bills {i * 7} tokens to tenant {i % 5}." for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    torch.manual_seed(0)
    # The model's vocabulary is exactly the tokenizer's: every sampled id must be decodable.
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=512, eos_token_id=0, bos_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-billing") / "llama")


async def _drive(async_engine, redis_url: str, engine_type: str, sample, rng: random.Random) -> list[tuple[str, int, bool]]:
    """Run a bursty workload with idle gaps; returns (request id, compute_us as the gateway reports it, cancelled)."""
    from services.engine.registry import heartbeat
    from services.engine.sequence import SamplingParams

    import redis.asyncio as aioredis

    engine_id = async_engine.engine.config.engine_id
    stop = asyncio.Event()
    beat = asyncio.create_task(heartbeat(async_engine, redis_url, "http://127.0.0.1:1", stop, engine_type=engine_type))
    client = aioredis.from_url(redis_url)

    async def fresh_snapshot(after: float) -> None:
        """Wait until the registry holds a snapshot taken after `after` (heartbeats are 1 s apart)."""
        while True:
            raw = await client.get(entry_key(engine_id))
            if raw and orjson.loads(raw)["ts"] > after:
                return
            await asyncio.sleep(0.05)

    async def one(i: int) -> tuple[str, int, bool]:
        rid = new_request_id()
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(4, 120))]
        params = SamplingParams(max_tokens=rng.randrange(4, 48), temperature=0.0, ignore_eos=True)
        cancel_after = rng.randrange(1, 6) if i % 4 == 3 else None  # every 4th client hangs up early
        compute = 0.0
        n = 0
        gen = async_engine.generate(rid, prompt, params)
        async for out in gen:
            compute = out.compute_seconds
            n += 1
            if cancel_after is not None and n >= cancel_after:
                break
        await gen.aclose()
        return rid, int(compute * 1e6), cancel_after is not None

    try:
        await fresh_snapshot(time.time())
        await asyncio.to_thread(sample)  # opens the accounting: the first window ends here
        results = []
        for burst in range(3):
            results += await asyncio.gather(*(one(burst * 100 + i) for i in range(12)))
            await asyncio.sleep(0.4)  # idle between bursts: unallocated time
            await fresh_snapshot(time.time())
            await asyncio.to_thread(sample)
        await asyncio.sleep(0.3)  # let aborts drain before the last snapshot
        await fresh_snapshot(time.time())
        await asyncio.to_thread(sample)
        return results
    finally:
        stop.set()
        await beat
        await client.aclose()


def test_attributed_compute_plus_idle_equals_engine_wall_time(tiny_model, service_urls, db, session_factory, redis_client):
    import redis
    import torch

    from services.engine.async_engine import AsyncEngine
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    torch.set_num_threads(2)
    engine_id, engine_type = unique("attr-engine"), unique("cpu")
    core = LLMEngine(EngineConfig(
        model_dir=tiny_model, engine_id=engine_id,
        cache=CacheConfig(block_size=16, memory_bytes=32 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        lora=LoraConfig(enabled=False),
    ))
    async_engine = AsyncEngine(core)
    sync_redis = redis.Redis.from_url(service_urls.redis_url)

    def sample():
        return sample_engines(session_factory, sync_redis)

    async def main():
        async_engine.start(asyncio.get_running_loop())
        try:
            return await _drive(async_engine, service_urls.redis_url, engine_type, sample, random.Random(7))
        finally:
            async_engine.shutdown()

    results = asyncio.run(main())
    assert async_engine.error is None

    # The ledger, as the gateway writes it.
    tenant = make_tenant(db)
    now = datetime.now(timezone.utc)
    db.execute(insert(UsageEvent), [
        {"request_id": rid, "tenant_id": tenant.id, "model": "tiny", "base_model": "tiny", "prompt_tokens": 1,
         "completion_tokens": 1, "status": "cancelled" if cancelled else "ok", "http_status": 499 if cancelled else 200,
         "created_at": now, "engine_id": engine_id, "compute_us": compute_us}
        for rid, compute_us, cancelled in results
    ])
    db.commit()

    totals = engine_totals(db, [engine_id])[engine_id]
    db.commit()
    wall_us = totals.busy_us + totals.idle_us
    attributed_us = sum(c for _, c, _ in results)
    # Windows tile the engine's life from its start to the last sample: their sum is its wall time.
    assert (totals.last_end - totals.first_start).total_seconds() * 1e6 == pytest.approx(wall_us, abs=2)
    assert totals.busy_us == pytest.approx(core.stats.busy_seconds * 1e6, rel=1e-3, abs=50)
    assert totals.busy_us > 0.05 * wall_us, "the workload should keep the engine measurably busy"
    # The acceptance figure: attributed compute-seconds + unallocated idle time = measured wall time (1%).
    gap = abs(attributed_us + totals.idle_us - wall_us) / wall_us
    assert gap <= 0.01, (attributed_us, totals.busy_us, totals.idle_us, wall_us)
    print(f"\nengine wall {wall_us / 1e6:.3f}s: busy {totals.busy_us / 1e6:.3f}s, idle {totals.idle_us / 1e6:.3f}s; "
          f"attributed to {len(results)} requests {attributed_us / 1e6:.3f}s; attributed + idle vs wall: {gap:.5%}")
