"""A tenant's own usage and spend, for the tenant API and dashboard: series by day / model / adapter and the
current period's billed amount, projection and token budget. Same daily rows as statements and reports."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.billing.config import BillingConfig
from services.billing.money import prorate
from services.billing.rollup import DailyRow, current_daily_rows
from services.billing.statements import adapter_labels, month_end
from services.common.batch_contract import SERVICE_TIER
from services.common.models import TenantLimits, UsageEvent

GROUPS = ("day", "model", "adapter")
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "billed_microusd")
MIN_PROJECTION_BASIS = timedelta(days=1)  # never extrapolate a month from its first minutes
EARLIEST_DAY, LATEST_DAY = date(1970, 1, 1), date(9000, 12, 31)  # far from date's limits: periods add days


class UsageQueryError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_group_by(value: str | None) -> tuple[str, ...]:
    """'day', 'adapter', or a comma list such as 'day,adapter' (a per-adapter breakdown of each day)."""
    parts = tuple(p.strip() for p in (value or "day").split(",") if p.strip())
    bad = [p for p in parts if p not in GROUPS]
    if not parts or bad or len(set(parts)) != len(parts):
        raise UsageQueryError(f"group_by must be one or more of {', '.join(GROUPS)} (comma-separated), got {value!r}", "group_by")
    return parts


def parse_period(day_from: str | None, day_to: str | None, config: BillingConfig, today: date) -> tuple[date, date]:
    """Inclusive UTC days; defaults: the current month."""
    def one(v: str | None, default: date, param: str) -> date:
        if not v:
            return default
        try:
            return date.fromisoformat(v)
        except ValueError:
            raise UsageQueryError(f"{param} must be a day, YYYY-MM-DD; got {v!r}", param) from None

    first = one(day_from, today.replace(day=1), "from")
    last = one(day_to, month_end(today), "to")
    for value, param in ((first, "from"), (last, "to")):
        if not EARLIEST_DAY <= value <= LATEST_DAY:
            raise UsageQueryError(f"{param} must be between {EARLIEST_DAY} and {LATEST_DAY}", param)
    if last < first:
        raise UsageQueryError(f"the period ends ({last}) before it starts ({first})", "to")
    if (last - first).days + 1 > config.max_report_days:
        raise UsageQueryError(f"a period covers at most {config.max_report_days} days", "from")
    return first, last


def tenant_usage(session: Session, config: BillingConfig, *, tenant_id: uuid.UUID, day_from: date, day_to: date,
                 group_by: tuple[str, ...]) -> dict:
    """`GET /api/tenant/usage`: rows per group (day -> 'YYYY-MM-DD', model -> base model, adapter -> adapter
    name or null for the base model), in key order, and totals. Always for `tenant_id` alone."""
    rows = current_daily_rows(session, config, day_from=day_from, day_to=day_to, tenant_id=tenant_id)
    labels = adapter_labels(session, {r.adapter_version_id for r in rows if r.adapter_version_id})
    buckets: dict[tuple, list[int]] = {}
    totals = [0] * len(USAGE_FIELDS)
    for r in rows:
        key = tuple(_group_value(r, g, labels) for g in group_by)
        b = buckets.setdefault(key, [0] * len(USAGE_FIELDS))
        for i, v in enumerate(_values(r)):
            b[i] += v
            totals[i] += v
    out_rows = [
        {**dict(zip(group_by, key)), **dict(zip(USAGE_FIELDS, values))}
        for key, values in sorted(buckets.items(), key=lambda kv: tuple((v is not None, v or "") for v in kv[0]))
    ]
    start, end = (datetime.combine(d, time.min, timezone.utc) for d in (day_from, day_to + timedelta(days=1)))
    return {"from": day_from.isoformat(), "to": day_to.isoformat(), "group_by": list(group_by), "rows": out_rows,
            "totals": dict(zip(USAGE_FIELDS, totals)),
            "batch": batch_usage(session, tenant_id=tenant_id, start=start, end=end)}


def _group_value(r: DailyRow, group: str, labels: dict[uuid.UUID, tuple[str, int]]) -> str | None:
    if group == "day":
        return r.day.isoformat()
    if group == "model":
        return r.base_model
    if r.adapter_version_id is None:
        return None
    return labels.get(r.adapter_version_id, (str(r.adapter_version_id), 0))[0]


def _values(r: DailyRow) -> tuple[int, ...]:
    return (r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.billed_micros)


@dataclass(frozen=True, slots=True)
class PeriodSpend:
    day_from: date
    day_to: date
    billed_micros: int
    projected_micros: int
    used_tokens: int  # prompt + completion this month: what the monthly budget counts
    monthly_token_budget: int | None
    limits: dict[str, int | None]


def tenant_spend(session: Session, config: BillingConfig, *, tenant_id: uuid.UUID, now: datetime | None = None) -> PeriodSpend:
    """This UTC month so far and a straight-line projection to its end (from at least one day of data)."""
    now = now or datetime.now(timezone.utc)
    first, last = now.date().replace(day=1), month_end(now.date())
    rows = current_daily_rows(session, config, day_from=first, day_to=last, tenant_id=tenant_id)
    billed = sum(r.billed_micros for r in rows)
    start = datetime.combine(first, time.min, timezone.utc)
    month = datetime.combine(last + timedelta(days=1), time.min, timezone.utc) - start
    elapsed = max(now - start, MIN_PROJECTION_BASIS)
    projected = max(billed, prorate(billed, month // timedelta(microseconds=1), elapsed // timedelta(microseconds=1)))
    limits_row = session.scalar(select(TenantLimits).where(TenantLimits.tenant_id == tenant_id))
    limits = {
        "tokens_per_min": getattr(limits_row, "tokens_per_min", None),
        "requests_per_min": getattr(limits_row, "requests_per_min", None),
        "concurrent": getattr(limits_row, "concurrent_requests", None),
        "monthly_tokens": getattr(limits_row, "monthly_token_budget", None),
    }
    return PeriodSpend(first, last, billed, projected, sum(r.prompt_tokens + r.completion_tokens for r in rows),
                       limits["monthly_tokens"], limits)


def batch_usage(session: Session, *, tenant_id: uuid.UUID, start: datetime, end: datetime) -> dict[str, int]:
    """The tenant's Batch API lines in [start, end) from the ledger: what the batch quota counts and the usage
    page shows apart (their money is in the daily rows, at the batch rate)."""
    requests, prompt, completion = session.execute(
        select(func.count(), func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
               func.coalesce(func.sum(UsageEvent.completion_tokens), 0))
        .where(UsageEvent.tenant_id == tenant_id, UsageEvent.service_tier == SERVICE_TIER,
               UsageEvent.created_at >= start, UsageEvent.created_at < end)).one()
    return {"requests": int(requests), "prompt_tokens": int(prompt), "completion_tokens": int(completion)}


def month_bounds(now: datetime) -> tuple[datetime, datetime]:
    first = now.date().replace(day=1)
    return (datetime.combine(first, time.min, timezone.utc),
            datetime.combine(month_end(first) + timedelta(days=1), time.min, timezone.utc))
