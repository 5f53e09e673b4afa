"""The engine fleet for platform admins (`/api/admin/engines`, `/api/admin/engines/history`).

Engines know adapters by content hash (the file's sha256); this module names them — every live adapter version
with that content, and its tenant — so the page shows "support-bot@3 · Acme" instead of a hash. Health is what
this gateway can tell: how fresh the heartbeat is, its circuit breaker for the engine, the queue and KV cache.
History is the engine's own short series (services.engine.registry: one sample every few seconds, capped).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime, timezone

from fastapi import APIRouter
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from services.common.models import Adapter, AdapterVersion, Tenant
from services.common.engine_registry import EngineSnapshot, HistorySample, read_histories, read_snapshots
from services.gateway.api.views import (
    EngineAdapterOut,
    EngineHealthOut,
    EngineHistoryOut,
    EngineOut,
    EngineSampleOut,
    ListOf,
    engine_out,
)
from services.gateway.deps import GatewayDep, PlatformAdmin, SessionDep

router = APIRouter(prefix="/api/admin", tags=["admin"])

_ERRORS = {401: {}, 403: {}}
STALE_AFTER_S = 3.0  # engines heartbeat every second; three missed beats and the entry is about to expire
KV_HIGH = 0.95


def engine_health(snapshot: EngineSnapshot, breaker: str | None, now: float) -> EngineHealthOut:
    """unhealthy: this gateway will not route to it (breaker open) or it stopped reporting; degraded: it
    serves, but new work waits (breaker probing, KV cache nearly full, a queue longer than a full batch)."""
    bad, warn = [], []
    age = now - (snapshot.ts if snapshot.ts is not None else now)
    if age > STALE_AFTER_S:
        bad.append(f"no heartbeat for {age:.0f} s")
    if breaker == "open":
        bad.append("circuit breaker open: recent requests failed on this engine")
    elif breaker == "half_open":
        warn.append("circuit breaker half-open: probing after failures")
    if snapshot.kv_usage >= KV_HIGH:
        warn.append(f"KV cache {snapshot.kv_usage:.0%} full")
    batch = snapshot.max_num_seqs
    if batch and snapshot.waiting > batch:
        warn.append(f"{snapshot.waiting} requests queued (more than a full batch of {batch})")
    state = "unhealthy" if bad else "degraded" if warn else "healthy"
    return EngineHealthOut(state=state, reasons=bad + warn)


def name_content(db, content_ids: Iterable[str]) -> dict[str, EngineAdapterOut]:
    """Content id -> the live adapter versions with that content and their tenants (platform scope)."""
    ids = sorted(set(content_ids))
    out = {cid: EngineAdapterOut(content_id=cid, names=[], tenants=[]) for cid in ids}
    if not ids:
        return out
    rows = db.execute(
        select(AdapterVersion.content_sha256, Adapter.name, AdapterVersion.version, Tenant.name)
        .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
        .join(Tenant, Tenant.id == Adapter.tenant_id)
        .where(AdapterVersion.content_sha256.in_(ids), Adapter.deleted_at.is_(None))
        .order_by(Tenant.name, Adapter.name, AdapterVersion.version)
    )
    for cid, name, version, tenant in rows:
        item = out[cid]
        item.names.append(f"{name}@{version}")
        if tenant not in item.tenants:
            item.tenants.append(tenant)
    return out


@router.get("/engines", response_model=ListOf[EngineOut], responses=_ERRORS)
async def list_engines(_: PlatformAdmin, gw: GatewayDep, db: SessionDep):
    """Live engines from the Redis registry (entries expire a few seconds after an engine's last heartbeat),
    with the adapters they hold named, and their health as this gateway sees it."""
    snaps = await read_snapshots(gw.redis)
    held = {c for s in snaps for c in s.adapters}
    names = await run_in_threadpool(name_content, db, held)
    breakers = gw.router.breaker_states()
    now = time.time()
    data = []
    for s in snaps:
        data.append(engine_out(s, adapters=[names[c] for c in s.adapters if c in names],
                               health=engine_health(s, breakers.get(s.id), now)))
    return ListOf[EngineOut](data=data)


def history_out(engine_id: str, samples: list[HistorySample]) -> EngineHistoryOut:
    """Samples oldest first; throughput is the tokens counter's rate between neighbouring samples (a counter
    that went down means the engine restarted: no rate for that step)."""
    out, prev = [], None
    for d in samples:
        rate = None
        if prev is not None and d.ts > prev.ts and d.tokens >= prev.tokens:
            rate = round((d.tokens - prev.tokens) / (d.ts - prev.ts), 2)
        out.append(EngineSampleOut(ts=datetime.fromtimestamp(d.ts, tz=timezone.utc), tokens_per_s=rate,
                                   running=d.running, waiting=d.waiting, kv_usage=d.kv_usage,
                                   slots_used=d.slots_used, slots_total=d.slots_total))
        prev = d
    return EngineHistoryOut(id=engine_id, samples=out)


@router.get("/engines/history", response_model=ListOf[EngineHistoryOut], responses=_ERRORS)
async def engines_history(_: PlatformAdmin, gw: GatewayDep):
    """Each live engine's last minutes: throughput, queue, KV cache use and adapter slots in use."""
    return ListOf[EngineHistoryOut](data=[history_out(i, samples) for i, samples in await read_histories(gw.redis)])
