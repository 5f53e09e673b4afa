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
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from services.billing.config import BillingConfig
from services.billing.usage import UsageQueryError, parse_group_by, parse_period, tenant_spend, tenant_usage
from services.common.errors import InvalidRequestError
from services.gateway.deps import GatewayDep, SessionDep, TenantUser
from services.gateway.quotas import Limits, Scope

router = APIRouter(prefix="/api/tenant", tags=["tenant"])


def _tenant(user) -> uuid.UUID:
    assert user.tenant_id is not None  # tenant roles always carry a tenant (users CHECK constraint)
    return user.tenant_id


@router.get("/usage")
def usage(
    user: TenantUser,
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


@router.get("/spend")
async def spend(user: TenantUser, db: SessionDep, gw: GatewayDep) -> dict:
    tenant_id = _tenant(user)
    config = BillingConfig.from_settings(gw.settings)
    s = await run_in_threadpool(tenant_spend, db, config, tenant_id=tenant_id)
    used = await _meters(gw, tenant_id, s.used_tokens)
    return {
        "period": {"from": s.day_from.isoformat(), "to": s.day_to.isoformat()},
        "billed_microusd": s.billed_micros,
        "projected_microusd": s.projected_micros,
        "budget": {"monthly_token_budget": s.monthly_token_budget, "used_tokens": s.used_tokens},
        "meters": {name: {"limit": s.limits[name], "used": used[name]} for name in ("tokens_per_min", "requests_per_min", "concurrent", "monthly_tokens")},
    }


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
