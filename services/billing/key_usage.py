"""A tenant's usage per API key for a period: the dashboard's "by key" breakdown.

Money is billed per daily row (day x model x adapter version, rounded once: services.billing.rollup), not per
key, so a key's dollars are an apportionment: each daily row's billed amount is split across the keys that
used it in proportion to what their tokens cost at that row's prices, by largest remainder. The keys' amounts
therefore add up exactly to the period's billed total; no money is rounded twice or invented.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from services.billing.config import BillingConfig
from services.billing.pricebook import PriceBook
from services.billing.rollup import current_daily_rows, day_bounds
from services.common.models import ApiKey, Tenant


@dataclass(slots=True)
class KeyUsage:
    key_id: uuid.UUID | None  # None: requests made without a key (internal tools)
    name: str | None
    prefix: str | None
    revoked: bool
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    billed_micros: int = 0


def apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (integers >= 0), largest remainder first; the parts sum to
    `total` exactly. All-zero weights split evenly."""
    assert total >= 0 and all(w >= 0 for w in weights)
    if not weights:
        return []
    if not any(weights):
        weights = [1] * len(weights)
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    # ties go to the earlier part, so the result is deterministic for a given order
    order = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


_LEDGER = """
SELECT (created_at AT TIME ZONE 'UTC')::date AS day, model, adapter_version_id, service_tier, base_model, api_key_id,
       count(*) AS requests, sum(prompt_tokens)::bigint AS prompt_tokens, sum(cached_tokens)::bigint AS cached_tokens,
       sum(completion_tokens)::bigint AS completion_tokens, min(created_at) AS first_at
FROM usage_events
WHERE tenant_id = :t AND created_at >= :lo AND created_at < :hi
GROUP BY 1, 2, 3, 4, 5, 6
ORDER BY 1, 2, 3, 4, 6
"""


def usage_by_key(session: Session, config: BillingConfig, *, tenant_id: uuid.UUID, day_from: date,
                 day_to: date) -> list[KeyUsage]:
    """One entry per key that made requests in [day_from, day_to] (UTC days), always for `tenant_id` alone."""
    lo, hi = day_bounds(day_from, day_to)
    book = PriceBook.load(session)
    plan = session.scalar(select(Tenant.plan).where(Tenant.id == tenant_id))
    billed = {r.key[0:1] + r.key[2:]: r.billed_micros
              for r in current_daily_rows(session, config, day_from=day_from, day_to=day_to, tenant_id=tenant_id, book=book)}
    groups: dict[tuple, list] = {}
    for r in session.execute(text(_LEDGER), {"t": tenant_id, "lo": lo, "hi": hi}):
        groups.setdefault((r.day, r.model, r.adapter_version_id, r.service_tier), []).append(r)

    keys = {k.id: k for k in session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id))}
    out: dict[uuid.UUID | None, KeyUsage] = {}
    for natural_key, parts in groups.items():
        weights = []
        for p in parts:
            prices = book.unit_prices_at(tenant_id, plan, p.base_model, p.first_at) if plan is not None else None
            weights.append(prices.usage_pico(p.prompt_tokens, p.cached_tokens, p.completion_tokens,
                                             adapter=p.adapter_version_id is not None) * prices.keep_bps
                           if prices is not None else p.prompt_tokens + p.completion_tokens)
        for p, share in zip(parts, apportion(billed.get(natural_key, 0), weights)):
            k = keys.get(p.api_key_id)
            u = out.get(p.api_key_id)
            if u is None:
                u = out[p.api_key_id] = KeyUsage(p.api_key_id, k.name if k else None, k.prefix if k else None,
                                                 bool(k and k.revoked_at is not None))
            u.requests += p.requests
            u.prompt_tokens += p.prompt_tokens
            u.cached_tokens += p.cached_tokens
            u.completion_tokens += p.completion_tokens
            u.billed_micros += share
    return sorted(out.values(), key=lambda u: (-u.billed_micros, u.name or "", str(u.key_id)))
