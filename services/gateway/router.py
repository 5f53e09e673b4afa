"""Picks an engine for a request: adapter residency and prefix affinity first, bounded load always.

Consistent hashing with bounded loads (CHWBL): a request's affinity key (its adapter's content id,
or its tenant-salted prompt prefix) maps to a point on a ring of engines; walking the ring, the
first engine whose load stays under `bound x average` wins. Engines already holding the adapter are
preferred. The rest of the walk is the retry order. A per-engine circuit breaker keeps an engine
that keeps failing (unreachable, dead, broken streams) out of the order until a probe succeeds.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import math
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.common.engine_registry import EngineSnapshot, read_snapshots

VNODES = 64


@dataclass(frozen=True, slots=True)
class EngineInfo:
    id: str
    url: str
    base_model: str
    host_adapters: frozenset[str]
    slot_adapters: frozenset[str]
    running: int
    waiting: int
    kv_usage: float
    max_num_seqs: int
    max_model_len: int

    @classmethod
    def from_snapshot(cls, s: EngineSnapshot) -> "EngineInfo":
        return cls(
            id=s.id, url=s.url, base_model=s.base_model, host_adapters=frozenset(s.host_adapters),
            slot_adapters=frozenset(s.slot_adapters), running=s.running, waiting=s.waiting, kv_usage=s.kv_usage,
            max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len,
        )

    def holds(self, adapter: str | None) -> bool:
        return adapter is not None and (adapter in self.slot_adapters or adapter in self.host_adapters)


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(slots=True)
class Breaker:
    """One engine's circuit breaker, as this gateway sees it. `threshold` failures in a row open it for
    a cooldown that doubles (up to a cap) while it keeps failing; once the cooldown is over one request
    probes the engine (half-open): a success closes the breaker, a failure opens it again. Only the
    engine's own faults count: a request refused or failed on its own account says nothing about it."""

    failures: int = 0
    opened_at: float | None = None
    cooldown_s: float = 0.0
    probing: bool = False

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if now < self.opened_at + self.cooldown_s else "half_open"


@dataclass
class Router:
    bound: float = 1.25
    inflight: dict[str, int] = field(default_factory=dict)  # this gateway's own open streams per engine
    _ring: tuple[tuple[str, ...], list[tuple[int, str]]] | None = None  # (engine ids, sorted ring), rebuilt on change
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 1.0
    breaker_max_cooldown_s: float = 30.0
    breakers: dict[str, Breaker] = field(default_factory=dict)
    clock: object = time.monotonic
    # (engine id, tenant, priority class) -> (until, Retry-After): an engine that just refused a tenant's class
    # as overloaded is not asked again for that class for a moment; when every engine is held, the gateway
    # refuses at once. Per tenant: the engine's estimate depends on the tenant's share (another tenant may
    # be under its share and admitted).
    # When a hold ends, the first request asks the engine again (a probe) and the others stay held for up to
    # `refusal_probe_s` while it is out: an engine still overloaded answers within milliseconds and is held
    # again, so a flood does not send every request of the moment to it (each then waiting on a quota
    # reservation and an engine exchange under full load); one that took the probe answers only with its first
    # token, so after that moment the others go too.
    refusal_hold_s: float = 0.25
    refusal_probe_s: float = 0.05
    # key -> (held until, Retry-After, probe out until or None)
    refusals: dict[tuple[str, str, str], tuple[float, int, float | None]] = field(default_factory=dict)

    def load(self, e: EngineInfo) -> int:
        return e.running + e.waiting + self.inflight.get(e.id, 0)

    def order(self, engines: list[EngineInfo], affinity: bytes, adapter: str | None = None) -> list[EngineInfo]:
        """All engines, best first; callers try them in order (retry on failure before the first token)."""
        if not engines:
            return []
        ids = tuple(sorted(e.id for e in engines))
        if self._ring is None or self._ring[0] != ids:
            self._ring = (ids, sorted((_h(f"{eid}#{i}".encode()), eid) for eid in ids for i in range(VNODES)))
        ring = self._ring[1]
        by_id = {e.id: e for e in engines}
        start = bisect.bisect(ring, (_h(affinity), ""))
        walk: list[EngineInfo] = []
        for k in range(len(ring)):
            eid = ring[(start + k) % len(ring)][1]
            if by_id[eid] not in walk:
                walk.append(by_id[eid])
                if len(walk) == len(by_id):
                    break
        total = sum(self.load(e) for e in engines) + 1
        cap = math.ceil(self.bound * total / len(engines))
        under = [e for e in walk if self.load(e) + 1 <= cap]
        resident = [e for e in under if e.holds(adapter)]
        first = resident or under
        rest = sorted((e for e in walk if e not in first), key=self.load)
        return first + rest

    # -- circuit breaker -------------------------------------------------------------------------
    def admit(self, engine_id: str) -> bool:
        """May a request be sent to this engine now? Closed: yes. Open: no. Half-open: one probe at a time."""
        b = self.breakers.get(engine_id)
        if b is None:
            return True
        state = b.state(self.clock())
        if state == "closed":
            return True
        if state == "open" or b.probing:
            return False
        b.probing = True
        return True

    def succeeded(self, engine_id: str) -> None:
        self.breakers.pop(engine_id, None)

    def end_probe(self, engine_id: str) -> None:
        """A probe ended with no verdict (its client hung up): let the next request probe."""
        b = self.breakers.get(engine_id)
        if b is not None:
            b.probing = False

    def failed(self, engine_id: str) -> bool:
        """Count one engine fault; True if this opened (or re-opened) its breaker."""
        b = self.breakers.setdefault(engine_id, Breaker())
        b.failures += 1
        if b.probing or (b.opened_at is None and b.failures >= self.breaker_threshold):
            b.cooldown_s = min(self.breaker_max_cooldown_s, max(self.breaker_cooldown_s, 2 * b.cooldown_s))
            b.opened_at = self.clock()
            b.probing = False
            return True
        return False

    # -- overload refusals ------------------------------------------------------------------------
    def refused(self, engine_id: str, tenant: str, priority: str, retry_after: int) -> None:
        """The engine refused this tenant's class as overloaded: hold it for the shorter of its Retry-After
        and `refusal_hold_s` (its estimate changes as its steps run; a hold of seconds would over-refuse)."""
        now = self.clock()
        if len(self.refusals) > 4096:  # bounded: drop expired holds
            self.refusals = {k: v for k, v in self.refusals.items() if self._held(k, now) is not None}
        self.refusals[(engine_id, tenant, priority)] = (now + min(self.refusal_hold_s, retry_after), retry_after, None)

    def _held(self, key: tuple[str, str, str], now: float) -> int | None:
        hold = self.refusals.get(key)
        if hold is None:
            return None
        until, retry_after, probe_until = hold
        return retry_after if now < until or (probe_until is not None and now < probe_until) else None

    def holding(self, engine_id: str, tenant: str, priority: str) -> int | None:
        """The Retry-After of a refusal still held for this engine, tenant and class; else None -- the first
        caller after a hold ends is the probe (the others are held while it is out, refusal_probe_s)."""
        key, now = (engine_id, tenant, priority), self.clock()
        held = self._held(key, now)
        if held is not None:
            return held
        hold = self.refusals.pop(key, None)
        if hold is not None and hold[2] is None:  # the hold just ended: this request probes
            self.refusals[key] = (hold[0], hold[1], now + self.refusal_probe_s)
        return None

    def held_everywhere(self, engine_ids: list[str], tenant: str, priority: str) -> int | None:
        """The soonest Retry-After when every one of these engines holds a refusal of this tenant's class, else
        None: such a request is refused before it costs a quota reservation or an engine exchange."""
        soonest, now = None, self.clock()
        for engine_id in engine_ids:
            held = self._held((engine_id, tenant, priority), now)  # looks only: the request's own walk probes
            if held is None:
                return None
            soonest = held if soonest is None else min(soonest, held)
        return soonest

    def breaker_states(self) -> dict[str, str]:
        now = self.clock()
        return {eid: b.state(now) for eid, b in self.breakers.items()}

    def opened(self, engine_id: str) -> None:
        self.inflight[engine_id] = self.inflight.get(engine_id, 0) + 1

    def closed(self, engine_id: str) -> None:
        left = self.inflight.get(engine_id, 0) - 1
        if left > 0:
            self.inflight[engine_id] = left
        else:
            self.inflight.pop(engine_id, None)


class Registry:
    """Reads live engines from Redis, cached briefly so routing costs no round trip per request.

    A list older than `ttl_s` is still used while one refresh runs in the background (stale while
    revalidate): a Redis that answers late -- a busy shared host, a failover -- must not hold every request
    that arrives meanwhile (under overload those are refusals that must be quick). Callers wait for the
    refresh only when the list is older than `stale_s`, when asked `fresh`, or when it names no engine for
    their model (a newly started engine is routable at once)."""

    def __init__(self, redis: aioredis.Redis, ttl_s: float = 0.5, stale_s: float = 5.0):
        self.redis = redis
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self._at = -math.inf
        self._engines: list[EngineInfo] = []
        self._loading: asyncio.Task | None = None

    async def engines(self, base_model: str | None = None, *, fresh: bool = False) -> list[EngineInfo]:
        age = time.monotonic() - self._at
        if fresh or age > self.stale_s:
            await self._refresh()
        elif age > self.ttl_s:
            self._refresh_started()
        found = self._of(base_model)
        if not found and not fresh and age > self.ttl_s:
            await self._refresh()
            found = self._of(base_model)
        return found

    def _of(self, base_model: str | None) -> list[EngineInfo]:
        if base_model is None:
            return list(self._engines)
        return [e for e in self._engines if e.base_model == base_model]

    def _refresh_started(self) -> asyncio.Task:
        """The one read of Redis in flight (started if none is): a task of its own, so a caller that hangs up
        never cancels it for the others, and a stall costs one pending read, not one per request."""
        if self._loading is None or self._loading.done():
            self._loading = asyncio.create_task(self._load())
            self._loading.add_done_callback(_consume_failure)
        return self._loading

    async def _refresh(self) -> None:
        await asyncio.shield(self._refresh_started())

    async def _load(self) -> None:
        snaps = await read_snapshots(self.redis)
        self._engines = [EngineInfo.from_snapshot(s) for s in snaps if s.url]
        self._at = time.monotonic()


def _consume_failure(task: asyncio.Task) -> None:
    """A background refresh that failed is retried by the next caller; the waiting ones saw its error."""
    if not task.cancelled():
        task.exception()
