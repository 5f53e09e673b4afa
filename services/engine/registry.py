"""Engine heartbeats into the Redis registry the gateway routes by (entries expire if an engine dies)."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.engine_registry import (
    ENTRY_TTL_S,
    HISTORY_EVERY,
    HISTORY_LEN,
    HISTORY_TTL_S,
    REGISTRY_SET,
    RETIRED_ADAPTERS,
    EngineSnapshot,
    entry_key,
    history_key,
)

log = logging.getLogger("mplex.engine.registry")

INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Uptime:
    """The origin of an engine's time accounting (taken when it starts serving): billing turns the deltas of
    `wall_s` and `busy_s` between registry samples into busy (attributed) and idle (unallocated) windows."""

    started_at: float  # epoch seconds
    monotonic: float
    busy_seconds: float  # engine.stats.busy_seconds at the origin

    @classmethod
    def start(cls, engine) -> Uptime:
        return cls(time.time(), time.monotonic(), engine.stats.busy_seconds)


def default_engine_type() -> str:
    """The hardware type this engine is priced as (engine_types.name); MPLEX_ENGINE_TYPE, like the settings."""
    return os.environ.get("MPLEX_ENGINE_TYPE") or "cpu"


def snapshot(engine, url: str, uptime: Uptime | None = None, engine_type: str | None = None) -> EngineSnapshot:
    """What the router needs: base model, resident adapters, load; with `uptime`, what billing needs:
    cumulative step time (`busy_s`, the time attributed to requests) and wall time since the origin.
    Read on the step-loop thread, so the two are consistent (never mid-step)."""
    a = engine.adapters
    billing = {}
    if uptime is not None:
        billing = {
            "engine_type": engine_type or default_engine_type(),
            "started_at": uptime.started_at,
            "wall_s": time.monotonic() - uptime.monotonic,
            "busy_s": engine.stats.busy_seconds - uptime.busy_seconds,
        }
    return EngineSnapshot(
        id=engine.config.engine_id,
        url=url,
        base_model=engine.config.model_name,
        host_adapters=tuple(w.content_id for w in a.resident()) if a else (),
        slot_adapters=tuple(c for c in a.slot_owners() if c) if a else (),
        slots_total=len(a.slot_owners()) if a else 0,
        tokens_total=engine.stats.tokens,
        running=engine.scheduler.num_running,
        waiting=engine.scheduler.num_waiting,
        kv_usage=round(engine.kv.usage, 4),
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        max_model_len=engine.max_model_len,
        ts=time.time(),
        **billing,
    )


def unload_retired(engine, content_id: str) -> None:
    from services.common.lora_format import AdapterFormatError

    try:
        if engine.adapters.unload(content_id):
            log.info("unloaded retired adapter", extra={"content_id": content_id})
    except AdapterFormatError:
        pass  # still pinned by running requests: the next heartbeat tries again


async def heartbeat(async_engine, redis_url: str, url: str, stop: asyncio.Event, engine_type: str | None = None) -> None:
    """Publish a snapshot every second until `stop`; deregister on the way out (drain)."""
    client = aioredis.from_url(redis_url)
    engine_id = async_engine.info.engine_id
    uptime = await async_engine.op("uptime")
    beats = 0
    try:
        while not stop.is_set():
            try:
                encoded = await async_engine.op("registry_snapshot", url, uptime, engine_type)
                if encoded is None:  # drained through another front-end: leave now
                    break
                snap = EngineSnapshot.model_validate_json(encoded)
                async with client.pipeline(transaction=False) as pipe:
                    pipe.set(entry_key(engine_id), snap.encode(), ex=ENTRY_TTL_S)
                    pipe.sadd(REGISTRY_SET, engine_id)
                    pipe.expire(REGISTRY_SET, 60)
                    if beats % HISTORY_EVERY == 0:
                        pipe.lpush(history_key(engine_id), snap.history_sample().encode())
                        pipe.ltrim(history_key(engine_id), 0, HISTORY_LEN - 1)
                        pipe.expire(history_key(engine_id), HISTORY_TTL_S)
                    pipe.smembers(RETIRED_ADAPTERS)
                    *_, retired = await pipe.execute()
                resident = set(snap.adapters)
                for cid in {r.decode() for r in retired} & resident:
                    await async_engine.op("retire_adapter", cid)
            except (RedisError, OSError) as exc:
                log.warning("registry heartbeat failed: %s", exc)
            except Exception:  # never let the heartbeat kill the server; the entry just goes stale
                log.exception("registry heartbeat error")
            beats += 1
            try:
                await asyncio.wait_for(stop.wait(), INTERVAL_S)
            except asyncio.TimeoutError:
                pass
    finally:
        try:
            await client.delete(entry_key(engine_id), history_key(engine_id))
            await client.srem(REGISTRY_SET, engine_id)
        except (RedisError, OSError):
            pass
        await client.aclose()
