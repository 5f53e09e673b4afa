"""The engine registry in Redis, one owner for its writer and its readers: key names, the typed snapshot an
engine heartbeats, its history samples, and the one way to read them.

Writer: `services.engine.registry` (every engine, once a second). Readers: the gateway's router (where to
send a request), the admin API (the fleet page) and billing (busy/idle windows per engine). A reader never
parses the JSON itself; an entry it cannot read (another build's, or garbage) is skipped and logged, so one
bad entry cannot hide the rest of the fleet.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger("mplex.registry")

REGISTRY_SET = "mplex:engines"  # ids of engines that heartbeat (each entry expires on its own)
RETIRED_ADAPTERS = "mplex:adapters:retired"  # content ids of deleted adapters: engines unload them
ENTRY_TTL_S = 5
# The admin page's short history: one compact sample every HISTORY_EVERY heartbeats, newest first, capped.
HISTORY_EVERY = 5
HISTORY_LEN = 120  # 10 minutes at one sample per 5 s
HISTORY_TTL_S = 900  # a dead engine's history goes with it


def entry_key(engine_id: str) -> str:
    return f"mplex:engine:{engine_id}"


def history_key(engine_id: str) -> str:
    return f"mplex:engine:{engine_id}:history"


class EngineSnapshot(BaseModel):
    """One engine's heartbeat. What the router needs (base model, resident adapters, load) and, from engines
    that account their time, what billing needs: `started_at` (epoch s), `wall_s` since then and `busy_s`
    (cumulative step time, the time attributed to requests)."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer engine may publish more

    id: str
    url: str = ""
    base_model: str = ""
    host_adapters: tuple[str, ...] = ()
    slot_adapters: tuple[str, ...] = ()
    slots_total: int | None = None
    tokens_total: int = 0  # prompt + generated tokens processed since start
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    max_num_seqs: int = 256
    max_model_len: int = 0
    ts: float | None = None  # epoch seconds of the heartbeat
    engine_type: str | None = None
    started_at: float | None = None
    wall_s: float | None = None
    busy_s: float | None = None

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @property
    def adapters(self) -> list[str]:
        """Content ids it holds, slots first, each once."""
        return list(dict.fromkeys((*self.slot_adapters, *self.host_adapters)))

    @property
    def accounts_time(self) -> bool:
        return None not in (self.engine_type, self.started_at, self.wall_s, self.busy_s)

    def history_sample(self) -> HistorySample:
        return HistorySample(ts=self.ts or 0.0, tokens=self.tokens_total, running=self.running, waiting=self.waiting,
                             kv_usage=self.kv_usage, slots_used=len(self.slot_adapters), slots_total=self.slots_total)


class HistorySample(BaseModel):
    """What the history keeps of a snapshot: the time, cumulative tokens (throughput is their rate) and load."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    ts: float
    tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    slots_used: int = 0
    slots_total: int | None = None

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


def _decode(model: type[BaseModel], raw: Any):
    try:
        return model.model_validate_json(raw)
    except (ValidationError, ValueError) as exc:
        log.warning("unreadable registry entry skipped (%s)", exc.__class__.__name__)
        return None


def _ids(members: Iterable[bytes | str]) -> list[str]:
    return sorted(m.decode() if isinstance(m, bytes) else m for m in members)


def _snapshots(raw: Iterable[bytes | None]) -> list[EngineSnapshot]:
    return [s for s in (_decode(EngineSnapshot, r) for r in raw if r) if s is not None]


async def read_snapshots(redis) -> list[EngineSnapshot]:
    """Every live engine (redis.asyncio client), by id. Expired entries (dead engines) are not listed."""
    ids = _ids(await redis.smembers(REGISTRY_SET))
    return _snapshots(await redis.mget([entry_key(i) for i in ids])) if ids else []


def read_snapshots_sync(redis) -> list[EngineSnapshot]:
    """The same, with a blocking redis client (Celery tasks)."""
    ids = _ids(redis.smembers(REGISTRY_SET))
    return _snapshots(redis.mget([entry_key(i) for i in ids])) if ids else []


async def read_histories(redis) -> list[tuple[str, list[HistorySample]]]:
    """Each registered engine's history, oldest sample first."""
    ids = _ids(await redis.smembers(REGISTRY_SET))
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for i in ids:
            pipe.lrange(history_key(i), 0, HISTORY_LEN - 1)
        lists = await pipe.execute()
    out = []
    for engine_id, raw in zip(ids, lists):
        samples = [s for s in (_decode(HistorySample, r) for r in raw) if s is not None]
        out.append((engine_id, sorted(samples, key=lambda s: s.ts)))
    return out
