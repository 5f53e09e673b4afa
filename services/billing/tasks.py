"""Billing's Celery tasks: thin, idempotent wrappers over plain functions (run by beat; safe to run twice)."""
from __future__ import annotations

import logging
from datetime import date, datetime, timezone
from functools import lru_cache

import redis
from sqlalchemy.orm import Session, sessionmaker

from services.billing.config import BillingConfig
from services.common.celery_app import app

log = logging.getLogger("mplex.billing.tasks")

_DEFAULTS = BillingConfig()
# Run by beat (services.common.celery_app.beat_schedule): {task name: every so many seconds}.
PERIODIC = {
    "billing.sample_engines": _DEFAULTS.engine_sample_interval_s,  # registry -> engine usage windows
    "billing.rollup": _DEFAULTS.rollup_interval_s,  # ledger -> daily rows
    "billing.issue_statements": _DEFAULTS.statements_interval_s,  # closed months -> statements
}


@lru_cache(maxsize=1)
def _runtime() -> tuple[BillingConfig, sessionmaker[Session], redis.Redis]:
    """Built on first use in each worker process (never before the prefork pool forks)."""
    from services.common.db import get_db_engine, make_sessionmaker
    from services.common.embedded import resolve_urls
    from services.common.settings import get_settings

    settings = get_settings()
    redis_url = settings.redis_url or resolve_urls(settings).redis_url
    return BillingConfig.from_settings(settings), make_sessionmaker(get_db_engine()), redis.Redis.from_url(redis_url)


@app.task(name="billing.sample_engines")
def sample_engines() -> int:
    """Registry -> one busy/idle window per live engine. Returns the number of new windows."""
    from services.billing.engines import sample_engines as sample

    _, factory, client = _runtime()
    return sum(w.inserted for w in sample(factory, client))


@app.task(name="billing.rollup")
def rollup(days: list[str] | None = None) -> dict:
    """Ledger -> usage_daily: everything pending since the last run, or the given days (YYYY-MM-DD)."""
    from services.billing.rollup import rollup_days, rollup_pending

    config, factory, _ = _runtime()
    with factory() as session:
        if days:
            r = rollup_days(session, config, [date.fromisoformat(d) for d in days])
        else:
            r = rollup_pending(session, config)
    return {"days": [d.isoformat() for d in r.days], "rows": r.rows, "changed": r.changed}


@app.task(name="billing.issue_statements")
def issue_statements(month: str | None = None) -> dict:
    """Statements for a closed month (YYYY-MM), or for the last `statement_months_back` closed months.
    Unchanged months are no-ops; a month whose data changed gets a new revision."""
    from services.billing.rollup import rollup_pending
    from services.billing.statements import issue_statements as issue
    from services.billing.statements import parse_month

    config, factory, _ = _runtime()
    if month:
        periods = [parse_month(month)]
    else:
        today = datetime.now(timezone.utc).date()
        periods = []
        p = today.replace(day=1)
        for _ in range(config.statement_months_back):
            p = date(p.year - (p.month == 1), 12 if p.month == 1 else p.month - 1, 1)
            periods.append(p)
    out: dict[str, dict[str, int]] = {}
    with factory() as session:
        rollup_pending(session, config)  # statements read the same rows either way; this keeps usage_daily in step
        for period in periods:
            results = issue(session, config, period=period)
            counts: dict[str, int] = {}
            for r in results:
                counts[r.status] = counts.get(r.status, 0) + 1
            out[period.strftime("%Y-%m")] = counts
    return out
