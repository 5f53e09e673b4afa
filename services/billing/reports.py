"""Finance cost report for a period: per tenant (and per model/adapter version/service tier) requests, tokens, billed
amount, attributed compute cost and margin, plus engines' unallocated idle cost; as JSON and as CSV.

Built from the daily rows (services.billing.rollup.current_daily_rows) by summing, never re-rounding, so
a month's report equals the month's statements to the micro-dollar. Output is a pure function of the data:
fixed row order, fixed column order (docs/billing.md), no timestamps — re-running gives identical bytes.
"""
from __future__ import annotations

import csv
import io
import json
import uuid
from dataclasses import dataclass, field
from datetime import date, timedelta

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.billing.config import BillingConfig
from services.billing.money import US_PER_HOUR, round_half_up
from services.billing.pricebook import PriceBook
from services.billing.rollup import DailyRow, current_daily_rows, day_bounds
from services.billing.statements import adapter_labels
from services.common.batch_contract import SERVICE_TIER


class ReportError(ValueError):
    """A report cannot be built for these arguments (bad period); the message says why."""


# Summed per tenant / per breakdown line / overall, in this order in JSON and CSV.
SUM_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "compute_us", "amount_micros",
              "discount_micros", "compute_cost_micros", "unpriced_requests", "uncosted_compute_us")


@dataclass(slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    compute_us: int = 0
    amount_micros: int = 0
    discount_micros: int = 0
    compute_cost_micros: int = 0
    unpriced_requests: int = 0
    uncosted_compute_us: int = 0

    def add(self, other: DailyRow | Totals) -> None:
        for f in SUM_FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    @property
    def billed_micros(self) -> int:
        return self.amount_micros - self.discount_micros

    @property
    def margin_micros(self) -> int:
        return self.billed_micros - self.compute_cost_micros

    def as_json(self) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "compute_us": self.compute_us,
            "amount_microusd": self.amount_micros,
            "discount_microusd": self.discount_micros,
            "billed_microusd": self.billed_micros,
            "compute_cost_microusd": self.compute_cost_micros,
            "margin_microusd": self.margin_micros,
            "unpriced_requests": self.unpriced_requests,
            "uncosted_compute_us": self.uncosted_compute_us,
        }


@dataclass(slots=True)
class BreakdownLine:
    model: str  # the base model
    adapter: str | None  # adapter@version, None for the base model itself
    adapter_version_id: uuid.UUID | None
    service_tier: str  # 'default' (live) | 'batch' (Batch API lines, at the batch rate)
    totals: Totals = field(default_factory=Totals)


@dataclass(slots=True)
class TenantLine:
    tenant_id: uuid.UUID
    tenant_slug: str
    tenant_name: str
    totals: Totals = field(default_factory=Totals)
    breakdown: list[BreakdownLine] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineTime:
    busy_us: int
    idle_us: int
    busy_cost_micros: int
    idle_cost_micros: int  # unallocated: engine time no request used
    uncosted_us: int  # engine time of types with no engine-hour price

    @property
    def wall_us(self) -> int:
        return self.busy_us + self.idle_us


@dataclass(slots=True)
class CostReport:
    day_from: date
    day_to: date
    tenants: list[TenantLine]
    totals: Totals
    engines: EngineTime

    @property
    def net_margin_micros(self) -> int:
        """Billed minus everything serving cost: attributed compute and unallocated idle time."""
        return self.totals.margin_micros - self.engines.idle_cost_micros


def check_period(day_from: date, day_to: date, config: BillingConfig) -> None:
    if day_from < date(1970, 1, 1) or day_to > date(9000, 12, 31):
        raise ReportError("days must be between 1970-01-01 and 9000-12-31")
    if day_to < day_from:
        raise ReportError(f"the period ends ({day_to}) before it starts ({day_from})")
    if (day_to - day_from).days + 1 > config.max_report_days:
        raise ReportError(f"a report covers at most {config.max_report_days} days")


def build_report(session: Session, config: BillingConfig, *, day_from: date, day_to: date,
                 tenant_id: uuid.UUID | None = None) -> CostReport:
    """The cost report for [day_from, day_to] (UTC days, inclusive). Read-only."""
    check_period(day_from, day_to, config)
    book = PriceBook.load(session)
    rows = current_daily_rows(session, config, day_from=day_from, day_to=day_to, tenant_id=tenant_id, book=book)
    labels = adapter_labels(session, {r.adapter_version_id for r in rows if r.adapter_version_id})
    names = _tenant_names(session, {r.tenant_id for r in rows})
    tenants: dict[uuid.UUID, TenantLine] = {}
    lines: dict[tuple[uuid.UUID, str, uuid.UUID | None, str], BreakdownLine] = {}
    totals = Totals()
    for r in rows:
        t = tenants.get(r.tenant_id)
        if t is None:
            slug, name = names[r.tenant_id]
            t = tenants[r.tenant_id] = TenantLine(r.tenant_id, slug, name)
        key = (r.tenant_id, r.base_model, r.adapter_version_id, r.service_tier)
        line = lines.get(key)
        if line is None:
            label = None
            if r.adapter_version_id is not None:
                name, version = labels.get(r.adapter_version_id, (str(r.adapter_version_id), 0))
                label = f"{name}@{version}"
            line = lines[key] = BreakdownLine(r.base_model, label, r.adapter_version_id, r.service_tier)
            t.breakdown.append(line)
        line.totals.add(r)
        t.totals.add(r)
        totals.add(r)
    ordered = sorted(tenants.values(), key=lambda t: (t.tenant_name, t.tenant_slug, str(t.tenant_id)))
    for t in ordered:
        t.breakdown.sort(key=lambda b: (b.model, b.adapter or "", str(b.adapter_version_id or ""), b.service_tier == SERVICE_TIER))
    engines = engine_time(session, book, day_from=day_from, day_to=day_to) if tenant_id is None else EngineTime(0, 0, 0, 0, 0)
    return CostReport(day_from, day_to, ordered, totals, engines)


def _tenant_names(session: Session, ids: set[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    if not ids:
        return {}
    rows = session.execute(text("SELECT id, slug, name FROM tenants WHERE id = ANY(CAST(:ids AS uuid[]))"), {"ids": list(ids)})
    return {tid: (slug, name) for tid, slug, name in rows}


def engine_time(session: Session, book: PriceBook, *, day_from: date, day_to: date) -> EngineTime:
    """Engines' reported busy/idle time in windows starting in the period, and its cost at the engine-hour
    price effective at each window's start; idle cost is the unallocated cost. Rounded once per total."""
    lo, hi = day_bounds(day_from, day_to)
    segs = book.engine_segments()
    result = session.execute(
        text("""
        WITH es AS (SELECT * FROM unnest(CAST(:id AS int[]), CAST(:type AS text[]), CAST(:t0 AS timestamptz[]),
                                         CAST(:t1 AS timestamptz[])) AS x(id, engine_type, t0, t1))
        SELECT es.id AS es_id, sum(r.busy_us)::bigint AS busy, sum(r.idle_us)::bigint AS idle
        FROM engine_usage_reports r
        LEFT JOIN es ON es.engine_type = r.engine_type AND r.window_start >= es.t0 AND r.window_start < es.t1
        WHERE r.window_start >= :lo AND r.window_start < :hi
        GROUP BY 1
        """),
        {"id": [s.id for s in segs], "type": [s.key[0] for s in segs], "t0": [s.start for s in segs],
         "t1": [s.end for s in segs], "lo": lo, "hi": hi},
    )
    price = {s.id: s.value for s in segs}
    busy = idle = busy_exact = idle_exact = uncosted = 0
    for es_id, b, i in result:
        busy += b
        idle += i
        per_hour = price.get(es_id)
        if per_hour is None:
            uncosted += b + i
        else:
            busy_exact += b * per_hour
            idle_exact += i * per_hour
    return EngineTime(busy, idle, round_half_up(busy_exact, US_PER_HOUR), round_half_up(idle_exact, US_PER_HOUR), uncosted)


# -- JSON ---------------------------------------------------------------------------------------------
def report_json(report: CostReport) -> dict:
    """The shape of GET /api/finance/report (docs/api.md), with a few more fields."""
    e = report.engines
    return {
        "period": {"from": report.day_from.isoformat(), "to": report.day_to.isoformat()},
        "rows": [
            {
                "tenant_id": str(t.tenant_id),
                "tenant_slug": t.tenant_slug,
                "tenant_name": t.tenant_name,
                **t.totals.as_json(),
                "breakdown": [
                    {"model": b.model, "adapter": b.adapter,
                     "adapter_version_id": str(b.adapter_version_id) if b.adapter_version_id else None,
                     "service_tier": b.service_tier, **b.totals.as_json()}
                    for b in t.breakdown
                ],
            }
            for t in report.tenants
        ],
        "totals": report.totals.as_json(),
        "unallocated_cost_microusd": e.idle_cost_micros,
        "net_margin_microusd": report.net_margin_micros,
        "engines": {"busy_us": e.busy_us, "idle_us": e.idle_us, "wall_us": e.wall_us, "busy_cost_microusd": e.busy_cost_micros,
                    "idle_cost_microusd": e.idle_cost_micros, "uncosted_us": e.uncosted_us},
    }


def report_json_bytes(report: CostReport) -> bytes:
    return (json.dumps(report_json(report), indent=2, ensure_ascii=False) + "\n").encode()


# -- CSV ----------------------------------------------------------------------------------------------
CSV_COLUMNS = (
    "level", "period_from", "period_to", "tenant_id", "tenant_slug", "tenant_name", "model", "adapter",
    "adapter_version_id", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "compute_us",
    "amount_microusd", "discount_microusd", "billed_microusd", "compute_cost_microusd", "margin_microusd",
    "unpriced_requests", "uncosted_compute_us", "service_tier",
)
_TOTAL_COLUMNS = CSV_COLUMNS[9:-1]  # the money and count columns, from Totals.as_json
# service_tier is last so that readers of the columns before it (by position) are unaffected by it.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _text(value: str | None) -> str:
    """A free-text cell: spreadsheet formula characters at the start are neutralised (CSV injection)."""
    if value is None:
        return ""
    return "'" + value if value.startswith(_FORMULA_START) else value


def _csv_row(level: str, report: CostReport, totals: Totals, *, tenant: TenantLine | None = None,
             line: BreakdownLine | None = None) -> list:
    tj = totals.as_json()
    return [
        level, report.day_from.isoformat(), report.day_to.isoformat(),
        str(tenant.tenant_id) if tenant else "", _text(tenant.tenant_slug) if tenant else "", _text(tenant.tenant_name) if tenant else "",
        _text(line.model) if line else "", _text(line.adapter) if line else "",
        str(line.adapter_version_id) if line and line.adapter_version_id else "",
        *(tj[c] for c in _TOTAL_COLUMNS),
        line.service_tier if line else "",
    ]


def report_csv(report: CostReport) -> bytes:
    """Rows: per tenant a `tenant` row then its `breakdown` rows (one per model/adapter version and service
    tier: `default` live, `batch` Batch API); then one `total` row and one
    `unallocated` row (idle engine time: compute_us = idle µs, cost in compute_cost_microusd)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for t in report.tenants:
        w.writerow(_csv_row("tenant", report, t.totals, tenant=t))
        for b in t.breakdown:
            w.writerow(_csv_row("breakdown", report, b.totals, tenant=t, line=b))
    w.writerow(_csv_row("total", report, report.totals))
    idle = Totals(compute_us=report.engines.idle_us, compute_cost_micros=report.engines.idle_cost_micros)
    w.writerow(_csv_row("unallocated", report, idle))
    return buf.getvalue().encode()


def csv_filename(day_from: date, day_to: date) -> str:
    return f"mplex-cost-report_{day_from.isoformat()}_{day_to.isoformat()}.csv"


def month_period(period: date) -> tuple[date, date]:
    first = period.replace(day=1)
    nxt = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first, nxt - timedelta(days=1)
