"""Finance's trend: revenue, attributed cost, idle (unallocated) cost and margins per UTC day of a period.

Billed and attributed cost per day are sums of that day's daily rows (as in the cost report). Idle cost per day
is the engines' idle time in windows starting that day at the engine-hour price effective at each window's
start, rounded once per day — so a period's days can differ from the report's single-rounded unallocated total
by at most one micro-dollar per day.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.billing.config import BillingConfig
from services.billing.money import US_PER_HOUR, round_half_up
from services.billing.pricebook import PriceBook
from services.billing.reports import check_period
from services.billing.rollup import current_daily_rows, day_bounds


@dataclass(slots=True)
class TrendDay:
    day: date
    requests: int = 0
    billed_micros: int = 0
    compute_cost_micros: int = 0
    idle_cost_micros: int = 0

    @property
    def margin_micros(self) -> int:
        """Billed minus the cost attributed to requests (the report's margin)."""
        return self.billed_micros - self.compute_cost_micros

    @property
    def net_margin_micros(self) -> int:
        """After the idle engine time no request used, too (the report's net margin)."""
        return self.margin_micros - self.idle_cost_micros


_IDLE = """
WITH es AS (SELECT * FROM unnest(CAST(:id AS int[]), CAST(:type AS text[]), CAST(:t0 AS timestamptz[]),
                                 CAST(:t1 AS timestamptz[])) AS x(id, engine_type, t0, t1))
SELECT (r.window_start AT TIME ZONE 'UTC')::date AS day, es.id AS es_id, sum(r.idle_us)::bigint AS idle
FROM engine_usage_reports r
LEFT JOIN es ON es.engine_type = r.engine_type AND r.window_start >= es.t0 AND r.window_start < es.t1
WHERE r.window_start >= :lo AND r.window_start < :hi
GROUP BY 1, 2
"""


def daily_trend(session: Session, config: BillingConfig, *, day_from: date, day_to: date) -> list[TrendDay]:
    """Every day of [day_from, day_to], zeros included, oldest first. Read-only; all tenants."""
    check_period(day_from, day_to, config)
    book = PriceBook.load(session)
    days = {day_from + timedelta(days=i): TrendDay(day_from + timedelta(days=i)) for i in range((day_to - day_from).days + 1)}
    for r in current_daily_rows(session, config, day_from=day_from, day_to=day_to, book=book):
        d = days[r.day]
        d.requests += r.requests
        d.billed_micros += r.billed_micros
        d.compute_cost_micros += r.compute_cost_micros
    lo, hi = day_bounds(day_from, day_to)
    segs = book.engine_segments()
    price = {s.id: s.value for s in segs}
    exact: dict[date, int] = {}
    for day, es_id, idle in session.execute(text(_IDLE), {
        "id": [s.id for s in segs], "type": [s.key[0] for s in segs], "t0": [s.start for s in segs],
        "t1": [s.end for s in segs], "lo": lo, "hi": hi,
    }):
        per_hour = price.get(es_id)
        if per_hour is not None and day in days:
            exact[day] = exact.get(day, 0) + idle * per_hour
    for day, scaled in exact.items():
        days[day].idle_cost_micros = round_half_up(scaled, US_PER_HOUR)
    return list(days.values())
