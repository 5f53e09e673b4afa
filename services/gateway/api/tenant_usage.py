"""Tenant usage and spend (`/api/tenant/usage`, `/api/tenant/spend`): always the signed-in user's own tenant.

The tenant comes from the session only; no query parameter can name another one (extra parameters such as
`tenant_id` are ignored). Figures come from services.billing (the same daily rows as statements).
"""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from services.billing.config import BillingConfig
from services.billing.key_usage import usage_by_key
from services.billing.pricebook import PriceBook
from services.billing.pricing import price_usage
from services.billing.statements import adapter_labels
from services.billing.usage import (
    UsageQueryError,
    batch_usage,
    month_bounds,
    parse_group_by,
    parse_period,
    tenant_spend,
    tenant_usage,
)
from services.common.errors import InvalidRequestError, NotFoundError
from services.common.models import Tenant, TenantLimits, UsageEvent
from services.gateway.deps import GatewayDep, SessionDep, UsageReader
from services.gateway.quotas import Limits, Scope

router = APIRouter(prefix="/api/tenant", tags=["tenant"])

_ERRORS = {400: {}, 401: {}, 403: {}}
FromQuery = Annotated[str | None, Query(alias="from", description="First day (UTC), YYYY-MM-DD; default: month start")]
ToQuery = Annotated[str | None, Query(description="Last day (UTC, inclusive); default: month end")]


class KeyUsageRow(BaseModel):
    key_id: uuid.UUID | None  # null: requests made without an API key
    key_name: str | None
    key_prefix: str | None
    revoked: bool
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    billed_microusd: int  # the daily rows' billed amounts apportioned by key (services.billing.key_usage)


class KeyUsageTotals(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    billed_microusd: int


class KeyUsageOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: str = Field(alias="from")
    to: str
    rows: list[KeyUsageRow]
    totals: KeyUsageTotals


class RequestRecordOut(BaseModel):
    """One request as the ledger recorded it (the playground shows its tokens and cost)."""

    request_id: str
    model: str  # as requested
    adapter: str | None  # name@version, null for the base model
    status: str
    http_status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    billed_microusd: int | None  # this request priced on its own; null when no price applies
    created_at: datetime
    first_token_ms: int | None
    finished_ms: int | None


def _tenant(user) -> uuid.UUID:
    assert user.tenant_id is not None  # tenant roles and keys always carry a tenant (users CHECK constraint)
    return user.tenant_id


@router.get("/usage")
def usage(
    user: UsageReader,
    db: SessionDep,
    gw: GatewayDep,
    from_: Annotated[str | None, Query(alias="from", description="First day (UTC), YYYY-MM-DD; default: month start")] = None,
    to: Annotated[str | None, Query(description="Last day (UTC, inclusive); default: month end")] = None,
    group_by: Annotated[str, Query(description="day | model | adapter, or a comma list such as day,adapter")] = "day",
) -> dict:
    config = BillingConfig.from_settings(gw.settings)
    try:
        groups = parse_group_by(group_by)
        day_from, day_to = parse_period(from_, to, config, datetime.now(timezone.utc).date())
    except UsageQueryError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None
    return tenant_usage(db, config, tenant_id=_tenant(user), day_from=day_from, day_to=day_to, group_by=groups)


@router.get("/usage/keys", response_model=KeyUsageOut, responses=_ERRORS)
def usage_per_key(user: UsageReader, db: SessionDep, gw: GatewayDep, from_: FromQuery = None, to: ToQuery = None):
    """Requests, tokens and billed amount per API key of the caller's tenant (revoked keys included)."""
    config = BillingConfig.from_settings(gw.settings)
    try:
        day_from, day_to = parse_period(from_, to, config, datetime.now(timezone.utc).date())
    except UsageQueryError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None
    rows = usage_by_key(db, config, tenant_id=_tenant(user), day_from=day_from, day_to=day_to)
    out = [KeyUsageRow(key_id=u.key_id, key_name=u.name, key_prefix=u.prefix, revoked=u.revoked, requests=u.requests,
                       prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens,
                       billed_microusd=u.billed_micros) for u in rows]
    totals = KeyUsageTotals(**{f: sum(getattr(r, f) for r in out) for f in KeyUsageTotals.model_fields})
    return KeyUsageOut(from_=day_from.isoformat(), to=day_to.isoformat(), rows=out, totals=totals)


RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")


@router.get("/requests/{request_id}", response_model=RequestRecordOut, responses={**_ERRORS, 404: {}})
def get_request(request_id: str, user: UsageReader, db: SessionDep):
    """One of the tenant's requests by its id (`x-request-id`, or the response's `id`), once it is in the ledger
    (a moment after the response ends). Another tenant's request is a 404 like a missing one."""
    rid = request_id[:200]
    for prefix in RESPONSE_ID_PREFIXES:
        rid = rid.removeprefix(prefix)
    tenant_id = _tenant(user)
    event = db.scalar(select(UsageEvent).where(UsageEvent.request_id == rid, UsageEvent.tenant_id == tenant_id))
    if event is None:
        raise NotFoundError("No such request in the ledger (yet).")
    adapter = None
    if event.adapter_version_id is not None:
        name, version = adapter_labels(db, {event.adapter_version_id}).get(event.adapter_version_id, (event.model, 0))
        adapter = f"{name}@{version}"
    plan = db.scalar(select(Tenant.plan).where(Tenant.id == tenant_id))
    amounts = price_usage(PriceBook.load(db), plan, event) if plan is not None else None
    return RequestRecordOut(
        request_id=event.request_id, model=event.model, adapter=adapter, status=str(event.status),
        http_status=event.http_status, prompt_tokens=event.prompt_tokens, cached_tokens=event.cached_tokens,
        completion_tokens=event.completion_tokens, billed_microusd=amounts.billed_micros if amounts else None,
        created_at=event.created_at, first_token_ms=event.first_token_ms, finished_ms=event.finished_ms,
    )


@router.get("/spend")
async def spend(user: UsageReader, db: SessionDep, gw: GatewayDep) -> dict:
    tenant_id = _tenant(user)
    config = BillingConfig.from_settings(gw.settings)
    s = await run_in_threadpool(tenant_spend, db, config, tenant_id=tenant_id)
    used = await _meters(gw, tenant_id, s.used_tokens)
    batch = await run_in_threadpool(_batch_meter, db, tenant_id)
    return {
        "period": {"from": s.day_from.isoformat(), "to": s.day_to.isoformat()},
        "billed_microusd": s.billed_micros,
        "projected_microusd": s.projected_micros,
        "budget": {"monthly_token_budget": s.monthly_token_budget, "used_tokens": s.used_tokens},
        "budget_in_dollars": _budget_in_dollars(s),
        "meters": {**{name: {"limit": s.limits[name], "used": used[name]}
                      for name in ("tokens_per_min", "requests_per_min", "concurrent", "monthly_tokens")},
                   "monthly_batch_tokens": batch},
    }


def _batch_meter(db, tenant_id: uuid.UUID) -> dict:
    """The Batch API's own monthly token budget (apart from the live windows) and its use this month."""
    limit = db.scalar(select(TenantLimits.monthly_batch_token_budget).where(TenantLimits.tenant_id == tenant_id))
    start, end = month_bounds(datetime.now(timezone.utc))
    used = batch_usage(db, tenant_id=tenant_id, start=start, end=end)
    return {"limit": limit, "used": used["prompt_tokens"] + used["completion_tokens"]}


def _budget_in_dollars(s) -> dict:
    """The token budget in dollars at this month's average billed price per token (an estimate: the budget
    counts tokens, and what a token costs depends on input/output mix, cache hits and adapters)."""
    rate = s.billed_micros * 1_000_000 // s.used_tokens if s.used_tokens else None  # micro-USD per 1M tokens
    budget = None
    if rate is not None and s.monthly_token_budget is not None:
        budget = s.monthly_token_budget * s.billed_micros // s.used_tokens
    return {"used_microusd": s.billed_micros, "budget_microusd": budget, "microusd_per_million_tokens": rate}


async def _meters(gw, tenant_id: uuid.UUID, month_tokens: int) -> dict[str, int | None]:
    """The tenant's quota windows as the gateway's quotas see them now (per-minute counters include the
    worst-case reservations of requests in flight; None when Redis cannot be read). Monthly tokens come
    from the ledger, which the quota's monthly counter is seeded from."""
    now = time.time()
    # Quotas owns the key layout; read its windows through it rather than copying the names.
    keys = gw.quotas._keys(Scope("tenant", str(tenant_id), Limits()), now)
    try:
        async with gw.redis.pipeline(transaction=False) as pipe:
            pipe.get(keys["tokens_per_min"])
            pipe.get(keys["requests_per_min"])
            pipe.zcount(keys["concurrent"], int(now * 1000), "+inf")  # live reservations (expired holders excluded)
            tpm, rpm, conc = await pipe.execute()
    except (RedisError, OSError):  # the dashboard still shows money and the monthly budget
        return {"tokens_per_min": None, "requests_per_min": None, "concurrent": None, "monthly_tokens": month_tokens}
    return {"tokens_per_min": int(tpm or 0), "requests_per_min": int(rpm or 0), "concurrent": int(conc or 0),
            "monthly_tokens": month_tokens}
