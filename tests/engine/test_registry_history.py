"""The engine's short history beside its registry entry (the admin engines page): a compact sample every
HISTORY_EVERY heartbeats, newest first, capped, gone with the entry when the engine drains. The engine here is a
stand-in with the attributes a snapshot reads; the heartbeat and Redis are real."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson

from services.engine import registry
from services.engine.core_ops import OPS


class StubEngine:
    def __init__(self):
        self.config = SimpleNamespace(engine_id="hist-test-engine", model_name="tiny", scheduler=SimpleNamespace(max_num_seqs=8))
        self.max_model_len = 128
        self.scheduler = SimpleNamespace(num_running=2, num_waiting=1)
        self.kv = SimpleNamespace(usage=0.25)
        self.stats = SimpleNamespace(tokens=0, busy_seconds=0.0)
        self.draining = False  # drained through another front-end: the snapshot op answers None
        slots = ["a" * 64, None, None, None]
        self.adapters = SimpleNamespace(resident=lambda: [SimpleNamespace(content_id="a" * 64)], slot_owners=lambda: slots)


class StubAsyncEngine:
    """The front-end's surface (AsyncEngine or CoreClient): the heartbeat runs named core operations."""

    def __init__(self):
        self.engine = StubEngine()
        self.info = SimpleNamespace(engine_id=self.engine.config.engine_id)

    async def op(self, name, *args):
        self.engine.stats.tokens += 10  # ten tokens per beat
        return OPS[name](self.engine, *args)


def test_heartbeat_keeps_a_capped_history_and_drops_it_on_drain(service_urls, redis_client, monkeypatch):
    monkeypatch.setattr(registry, "INTERVAL_S", 0.01)
    monkeypatch.setattr(registry, "HISTORY_LEN", 3)
    engine = StubAsyncEngine()
    key = registry.history_key("hist-test-engine")

    async def run() -> list[dict]:
        stop = asyncio.Event()
        beat = asyncio.create_task(registry.heartbeat(engine, service_urls.redis_url, "http://127.0.0.1:1", stop))
        for _ in range(500):
            if redis_client.llen(key) >= 3 and redis_client.get(registry.entry_key("hist-test-engine")):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(registry.HISTORY_EVERY * 0.02 * 3)  # more beats than the cap holds
        samples = [orjson.loads(r) for r in redis_client.lrange(key, 0, -1)]
        stop.set()
        await beat
        return samples

    samples = asyncio.run(run())
    assert len(samples) == 3  # capped
    assert samples[0]["ts"] > samples[-1]["ts"]  # newest first
    assert samples[0]["tokens"] - samples[1]["tokens"] == 10 * registry.HISTORY_EVERY
    assert {k: samples[0][k] for k in ("running", "waiting", "kv_usage", "slots_used", "slots_total")} == {
        "running": 2, "waiting": 1, "kv_usage": 0.25, "slots_used": 1, "slots_total": 4}
    assert redis_client.exists(key) == 0 and redis_client.exists(registry.entry_key("hist-test-engine")) == 0
