"""Daily roll-ups: the ledger aggregated per UTC day x tenant x model x adapter version x service tier
(live `default` or Batch API `batch`, priced at the batch rate) into `usage_daily`.

Postgres sums token counts per (natural key, price segment) in one set-based query; Python turns the sums
into money with services.billing.money (exact integers, rounded once per daily row). Writes are upserts on
the natural key that leave unchanged rows untouched, so re-running a day yields identical rows.

Late events (a spool replay, a slow writer) are found by ledger *ingest* time: `billing_cursors` keeps the
`recorded_at` up to which usage_daily is complete; each run recomputes every (day, tenant) that received
rows since, then moves the cursor. Readers use `current_daily_rows`, which serves stored rows where they are
complete and computes the rest live, so tenants and finance see exactly what the next roll-up will store.
"""
from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.billing.config import BillingConfig
from services.billing.money import ExactAmounts
from services.billing.pricebook import ALL_MODELS, FAR_PAST, PriceBook, unit_prices
from services.common.batch_contract import LIVE_TIER, SERVICE_TIER
log = logging.getLogger("mplex.billing.rollup")

CURSOR = "usage_daily"
_ROLLUP_LOCK = 0x6D706C78726F6C6C  # pg_advisory_xact_lock key: one roll-up writer at a time ("mplxroll")
_UPSERT_CHUNK = 10_000
HELD_BACK_WARNING_S = 600


@dataclass(frozen=True, slots=True)
class DailyRow:
    """One usage_daily row: natural key, base model, sums and money (micro-USD, rounded once)."""

    day: date
    tenant_id: uuid.UUID
    model: str
    adapter_version_id: uuid.UUID | None
    service_tier: str  # 'default' (live) | 'batch' (Batch API lines): part of the natural key
    base_model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    compute_us: int
    amount_micros: int
    discount_micros: int
    compute_cost_micros: int
    unpriced_requests: int
    uncosted_compute_us: int

    @property
    def key(self) -> tuple[date, uuid.UUID, str, uuid.UUID | None, str]:
        return (self.day, self.tenant_id, self.model, self.adapter_version_id, self.service_tier)

    @property
    def batch(self) -> bool:
        return self.service_tier == SERVICE_TIER

    @property
    def billed_micros(self) -> int:
        return self.amount_micros - self.discount_micros


DAILY_COLUMNS = tuple(DailyRow.__dataclass_fields__)
_VALUE_COLUMNS = DAILY_COLUMNS[5:]  # everything but the natural key


@dataclass(frozen=True, slots=True)
class RollupResult:
    days: tuple[date, ...]  # days (re)computed
    rows: int  # natural-key rows computed
    changed: int  # rows inserted or updated (unchanged rows are left alone)
    recorded_through: datetime | None = None  # the cursor after this run (rollup_pending only)


def day_bounds(day_from: date, day_to: date) -> tuple[datetime, datetime]:
    """[start of day_from, start of the day after day_to) in UTC."""
    return (datetime.combine(day_from, time.min, timezone.utc), datetime.combine(day_to + timedelta(days=1), time.min, timezone.utc))


# -- computing ------------------------------------------------------------------------------------
_QUERY = """
WITH lp AS (SELECT * FROM unnest(CAST(:lp_id AS int[]), CAST(:lp_plan AS text[]), CAST(:lp_model AS text[]),
                                 CAST(:lp_t0 AS timestamptz[]), CAST(:lp_t1 AS timestamptz[])) AS x(id, plan, base_model, t0, t1)),
     ov AS MATERIALIZED (SELECT * FROM unnest(CAST(:ov_id AS int[]), CAST(:ov_tenant AS uuid[]), CAST(:ov_model AS text[]),
                                 CAST(:ov_t0 AS timestamptz[]), CAST(:ov_t1 AS timestamptz[])) AS x(id, tenant_id, base_model, t0, t1)),
     es AS (SELECT * FROM unnest(CAST(:es_id AS int[]), CAST(:es_type AS text[]),
                                 CAST(:es_t0 AS timestamptz[]), CAST(:es_t1 AS timestamptz[])) AS x(id, engine_type, t0, t1)),
     em AS (SELECT ids.engine_id,
                   (SELECT r.engine_type FROM engine_usage_reports r WHERE r.engine_id = ids.engine_id AND r.window_start < :hi
                    ORDER BY r.window_start DESC LIMIT 1) AS engine_type
            FROM (SELECT DISTINCT engine_id FROM usage_events
                  WHERE created_at >= :lo AND created_at < :hi AND engine_id IS NOT NULL) AS ids)
SELECT (e.created_at AT TIME ZONE 'UTC')::date AS day, e.tenant_id, e.model, e.adapter_version_id, e.base_model,
       lp.id AS lp_id, os.id AS os_id, oa.id AS oa_id, es.id AS es_id, e.service_tier = :batch_tier AS batch,
       count(*) AS requests, sum(e.prompt_tokens)::bigint AS prompt_tokens, sum(e.cached_tokens)::bigint AS cached_tokens,
       sum(e.completion_tokens)::bigint AS completion_tokens, sum(e.compute_us)::bigint AS compute_us
FROM usage_events e
JOIN tenants t ON t.id = e.tenant_id
LEFT JOIN lp ON lp.plan = t.plan AND lp.base_model = e.base_model AND e.created_at >= lp.t0 AND e.created_at < lp.t1
LEFT JOIN ov os ON os.tenant_id = e.tenant_id AND os.base_model = e.base_model AND e.created_at >= os.t0 AND e.created_at < os.t1
LEFT JOIN ov oa ON oa.tenant_id = e.tenant_id AND oa.base_model = '' AND e.created_at >= oa.t0 AND e.created_at < oa.t1
LEFT JOIN em ON em.engine_id = e.engine_id
LEFT JOIN es ON es.engine_type = coalesce(em.engine_type, :default_engine_type) AND e.created_at >= es.t0 AND e.created_at < es.t1
WHERE e.created_at >= :lo AND e.created_at < :hi {tenant_filter}
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
"""


@dataclass(slots=True)
class _Acc:
    base_model: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    compute_us: int = 0
    unpriced_requests: int = 0
    uncosted_compute_us: int = 0
    exact: ExactAmounts = field(default_factory=ExactAmounts)


def compute_daily(
    session: Session, book: PriceBook, config: BillingConfig, *, day_from: date, day_to: date,
    tenant_ids: Iterable[uuid.UUID] | None = None,
) -> list[DailyRow]:
    """The daily rows for [day_from, day_to] computed from the ledger now (optionally for some tenants)."""
    lo, hi = day_bounds(day_from, day_to)
    lps, contracts, engines = book.list_segments(), book.contract_segments(), book.engine_segments()
    params = {
        "lp_id": [s.id for s in lps], "lp_plan": [s.key[0] for s in lps], "lp_model": [s.key[1] for s in lps],
        "lp_t0": [s.start for s in lps], "lp_t1": [s.end for s in lps],
        "ov_id": [s.id for s in contracts], "ov_tenant": [s.key[0] for s in contracts], "ov_model": [s.key[1] for s in contracts],
        "ov_t0": [s.start for s in contracts], "ov_t1": [s.end for s in contracts],
        "es_id": [s.id for s in engines], "es_type": [s.key[0] for s in engines],
        "es_t0": [s.start for s in engines], "es_t1": [s.end for s in engines],
        # An engine's type is the one in its latest usage report before the period ends; engines that
        # never reported (no sampler running) are costed as the configured default type.
        "default_engine_type": config.default_engine_type, "lo": lo, "hi": hi, "batch_tier": SERVICE_TIER,
    }
    tenant_filter = ""
    if tenant_ids is not None:
        params["tenant_ids"] = list(tenant_ids)
        tenant_filter = "AND e.tenant_id = ANY(CAST(:tenant_ids AS uuid[]))"
    lp_by_id = {s.id: s.value for s in lps}
    ov_by_id = {s.id: s.value for s in contracts}
    es_by_id = {s.id: s.value for s in engines}
    assert all(s.key[1] != ALL_MODELS or s.value.base_model is None for s in contracts)

    acc: dict[tuple, _Acc] = {}
    for r in session.execute(text(_QUERY.format(tenant_filter=tenant_filter)), params):
        key = (r.day, r.tenant_id, r.model, r.adapter_version_id, SERVICE_TIER if r.batch else LIVE_TIER)
        a = acc.get(key)
        if a is None:
            a = acc[key] = _Acc(r.base_model)
        assert a.base_model == r.base_model, f"{key} maps to two base models"
        a.requests += r.requests
        a.prompt_tokens += r.prompt_tokens
        a.cached_tokens += r.cached_tokens
        a.completion_tokens += r.completion_tokens
        a.compute_us += r.compute_us
        contract = ov_by_id.get(r.os_id) or ov_by_id.get(r.oa_id)  # a model-specific contract beats an all-models one
        prices = unit_prices(lp_by_id.get(r.lp_id), contract, batch=r.batch)  # batch lines: the batch rate
        if prices is None:
            a.unpriced_requests += r.requests
        else:
            a.exact.add_usage(prices, r.prompt_tokens, r.cached_tokens, r.completion_tokens, adapter=r.adapter_version_id is not None)
        if r.compute_us:
            per_hour = es_by_id.get(r.es_id)
            if per_hour is None:
                a.uncosted_compute_us += r.compute_us
            else:
                a.exact.add_compute(r.compute_us, per_hour)

    rows = []
    for (day, tenant_id, model, avid, tier), a in acc.items():
        money = a.exact.rounded()  # the one rounding per daily row
        rows.append(DailyRow(day, tenant_id, model, avid, tier, a.base_model, a.requests, a.prompt_tokens, a.cached_tokens,
                             a.completion_tokens, a.compute_us, money.amount_micros, money.discount_micros,
                             money.compute_cost_micros, a.unpriced_requests, a.uncosted_compute_us))
    rows.sort(key=sort_key)
    return rows


def sort_key(row: DailyRow) -> tuple:
    return (row.day, str(row.tenant_id), row.model, str(row.adapter_version_id or ""), row.service_tier)


# -- storing --------------------------------------------------------------------------------------
_UPSERT = """
INSERT INTO usage_daily (day, tenant_id, model, adapter_version_id, service_tier, base_model, requests, prompt_tokens, cached_tokens,
                         completion_tokens, compute_us, amount_micros, discount_micros, compute_cost_micros,
                         unpriced_requests, uncosted_compute_us)
SELECT * FROM unnest(CAST(:day AS date[]), CAST(:tenant_id AS uuid[]), CAST(:model AS text[]), CAST(:adapter_version_id AS uuid[]),
                     CAST(:service_tier AS text[]), CAST(:base_model AS text[]), CAST(:requests AS bigint[]), CAST(:prompt_tokens AS bigint[]),
                     CAST(:cached_tokens AS bigint[]), CAST(:completion_tokens AS bigint[]), CAST(:compute_us AS bigint[]),
                     CAST(:amount_micros AS bigint[]), CAST(:discount_micros AS bigint[]), CAST(:compute_cost_micros AS bigint[]),
                     CAST(:unpriced_requests AS bigint[]), CAST(:uncosted_compute_us AS bigint[]))
ON CONFLICT ON CONSTRAINT uq_usage_daily_natural_key DO UPDATE SET
  {sets}, updated_at = now()
WHERE ({old}) IS DISTINCT FROM ({new})
"""
_UPSERT_SQL = _UPSERT.format(
    sets=", ".join(f"{c} = EXCLUDED.{c}" for c in _VALUE_COLUMNS),
    old=", ".join(f"usage_daily.{c}" for c in _VALUE_COLUMNS),
    new=", ".join(f"EXCLUDED.{c}" for c in _VALUE_COLUMNS),
)


def store_daily(session: Session, rows: list[DailyRow]) -> int:
    """Upsert rows on their natural key; returns how many were inserted or changed."""
    changed = 0
    for i in range(0, len(rows), _UPSERT_CHUNK):
        chunk = rows[i : i + _UPSERT_CHUNK]
        params = {c: [getattr(r, c) for r in chunk] for c in DAILY_COLUMNS}
        changed += session.execute(text(_UPSERT_SQL), params).rowcount or 0
    return changed


def rollup_days(session: Session, config: BillingConfig, days: Iterable[date], *, tenant_ids: Iterable[uuid.UUID] | None = None,
                book: PriceBook | None = None) -> RollupResult:
    """Recompute and upsert whole days (all tenants, or some). Idempotent. Does not move the cursor; commits."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ROLLUP_LOCK})
    result = _rollup(session, config, sorted(set(days)), None if tenant_ids is None else set(tenant_ids), book)
    session.commit()
    return result


def _rollup(session: Session, config: BillingConfig, days: list[date], tenants: set[uuid.UUID] | None,
            book: PriceBook | None) -> RollupResult:
    book = book or PriceBook.load(session)
    rows_n = changed = 0
    for first, last in contiguous_ranges(days):
        rows = compute_daily(session, book, config, day_from=first, day_to=last, tenant_ids=tenants)
        rows_n += len(rows)
        changed += store_daily(session, rows)
    return RollupResult(tuple(days), rows_n, changed)


def contiguous_ranges(days: list[date]) -> list[tuple[date, date]]:
    out: list[tuple[date, date]] = []
    for d in days:
        if out and d == out[-1][1] + timedelta(days=1):
            out[-1] = (out[-1][0], d)
        else:
            out.append((d, d))
    return out


# -- the cursor -----------------------------------------------------------------------------------
def read_cursor(session: Session) -> datetime:
    """usage_daily reflects every ledger row with recorded_at < this (and possibly some later ones)."""
    at = session.execute(text("SELECT recorded_through FROM billing_cursors WHERE name = :n"), {"n": CURSOR}).scalar_one_or_none()
    return at if at is not None else FAR_PAST


def settled_bound(session: Session, lag_s: float) -> datetime:
    """A `recorded_at` below which no more ledger rows can appear (exclusive): `recorded_at` defaults to
    the inserting transaction's start, so it is bounded by the oldest transaction still open (and, where
    pg_stat_activity hides other roles' sessions, by a safety lag)."""
    return session.execute(
        text(
            "SELECT least(now() - make_interval(secs => :lag), (SELECT min(xact_start) FROM pg_stat_activity "
            " WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
            " AND xact_start IS NOT NULL))"
        ),
        {"lag": lag_s},
    ).scalar_one()


def rollup_pending(session: Session, config: BillingConfig, *, book: PriceBook | None = None) -> RollupResult:
    """Bring usage_daily up to date with everything the ledger received since the last run. Commits.

    Run it from a session with no other open transaction of its own elsewhere (an idle-in-transaction
    session of the same database holds the cursor back until it ends; correctness never depends on it).
    """
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ROLLUP_LOCK})
    cursor = read_cursor(session)
    bound = settled_bound(session, config.settle_lag_s)
    held_back = datetime.now(timezone.utc) - bound
    if held_back > timedelta(seconds=config.settle_lag_s + HELD_BACK_WARNING_S):
        log.warning("roll-up cursor held back %ds by a transaction open since %s (idle in transaction?)",
                    held_back.total_seconds(), bound.isoformat())
    if bound <= cursor:
        session.commit()
        return RollupResult((), 0, 0, cursor)
    pending = session.execute(
        text("SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date AS day, tenant_id FROM usage_events "
             "WHERE recorded_at >= :cursor AND recorded_at < :bound"),
        {"cursor": cursor, "bound": bound},
    ).all()
    by_range = _group_pending(pending)
    book = book or PriceBook.load(session)
    days: list[date] = []
    rows_n = changed = 0
    for (first, last), tenants in by_range:
        r = _rollup(session, config, [first + timedelta(days=i) for i in range((last - first).days + 1)], tenants, book)
        days += r.days
        rows_n += r.rows
        changed += r.changed
    session.execute(
        text("INSERT INTO billing_cursors (name, recorded_through) VALUES (:n, :at) "
             "ON CONFLICT (name) DO UPDATE SET recorded_through = EXCLUDED.recorded_through, updated_at = now()"),
        {"n": CURSOR, "at": bound},
    )
    session.commit()
    if days:
        log.info("rolled up %d day(s) %s..%s: %d rows, %d changed", len(days), days[0], days[-1], rows_n, changed)
    return RollupResult(tuple(days), rows_n, changed, bound)


def _group_pending(pending: list) -> list[tuple[tuple[date, date], set[uuid.UUID]]]:
    """(day, tenant) pairs -> contiguous day ranges with the tenants pending in them."""
    tenants_by_day: dict[date, set[uuid.UUID]] = defaultdict(set)
    for day, tenant_id in pending:
        tenants_by_day[day].add(tenant_id)
    out = []
    for first, last in contiguous_ranges(sorted(tenants_by_day)):
        tenants: set[uuid.UUID] = set()
        d = first
        while d <= last:
            tenants |= tenants_by_day[d]
            d += timedelta(days=1)
        out.append(((first, last), tenants))
    return out


# -- reading --------------------------------------------------------------------------------------
def stored_daily(session: Session, *, day_from: date, day_to: date, tenant_id: uuid.UUID | None = None) -> list[DailyRow]:
    where = "day BETWEEN :a AND :b" + (" AND tenant_id = :t" if tenant_id is not None else "")
    result = session.execute(text(f"SELECT {', '.join(DAILY_COLUMNS)} FROM usage_daily WHERE {where}"),
                             {"a": day_from, "b": day_to, "t": tenant_id})
    return [DailyRow(*r) for r in result]


def current_daily_rows(session: Session, config: BillingConfig, *, day_from: date, day_to: date,
                       tenant_id: uuid.UUID | None = None, book: PriceBook | None = None) -> list[DailyRow]:
    """Daily rows for a period as the next roll-up will store them: stored rows for (day, tenant) pairs
    that are complete, computed live for those that received ledger rows after the cursor. Read-only."""
    lo, hi = day_bounds(day_from, day_to)
    cursor = read_cursor(session)
    params = {"cursor": cursor, "lo": lo, "hi": hi, "t": tenant_id}
    pending = session.execute(
        text("SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date AS day, tenant_id FROM usage_events "
             "WHERE recorded_at >= :cursor AND created_at >= :lo AND created_at < :hi"
             + (" AND tenant_id = :t" if tenant_id is not None else "")),
        params,
    ).all()
    stale = {(d, t) for d, t in pending}
    rows = [r for r in stored_daily(session, day_from=day_from, day_to=day_to, tenant_id=tenant_id) if (r.day, r.tenant_id) not in stale]
    if stale:
        book = book or PriceBook.load(session)
        for (first, last), tenants in _group_pending(pending):
            live = compute_daily(session, book, config, day_from=first, day_to=last, tenant_ids=tenants)
            rows += [r for r in live if (r.day, r.tenant_id) in stale]
    rows.sort(key=sort_key)
    return rows
