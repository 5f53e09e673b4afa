"""Monthly statements: an immutable snapshot of a tenant's month, one line per model/adapter version and
service tier (Batch API lines are their own line, at the batch rate).

A statement's lines are sums of the month's daily rows (never re-rounded), so a statement always equals
the sum of its roll-ups. Rows are immutable (database trigger): issuing again for the same month adds
revision n+1 if the underlying data changed (a late event, a re-priced day) and does nothing otherwise —
the digest of the lines tells the two apart.
"""
from __future__ import annotations

import calendar
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from datetime import date, datetime, timezone

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from services.billing.config import BillingConfig
from services.billing.pricebook import PriceBook
from services.billing.rollup import DailyRow, current_daily_rows
from services.common.batch_contract import LIVE_TIER, SERVICE_TIER
from services.common.models import Statement, StatementLine

log = logging.getLogger("mplex.billing.statements")

_STATEMENTS_LOCK = 0x6D706C7873746D74  # "mplxstmt"
TOTAL_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "compute_us", "amount_micros",
                "discount_micros", "compute_cost_micros")


class StatementError(ValueError):
    """A statement cannot be issued (open month, unpriced usage); the message says why."""


@dataclass(frozen=True, slots=True)
class LineData:
    line_no: int
    model: str  # base model name, or adapter@version
    base_model: str
    adapter_version_id: uuid.UUID | None
    description: str
    service_tier: str  # 'default' (live) | 'batch' (Batch API)
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    compute_us: int
    amount_micros: int
    discount_micros: int
    compute_cost_micros: int

    @property
    def billed_micros(self) -> int:
        return self.amount_micros - self.discount_micros


@dataclass(frozen=True, slots=True)
class IssueResult:
    tenant_id: uuid.UUID
    period: date
    status: str  # issued | unchanged | refused
    statement_id: uuid.UUID | None = None
    revision: int | None = None
    total_micros: int | None = None
    reason: str | None = None


def month_start(day: date) -> date:
    return day.replace(day=1)


def month_end(period: date) -> date:
    return period.replace(day=calendar.monthrange(period.year, period.month)[1])


def parse_month(value: str) -> date:
    """'YYYY-MM' -> the first day of that month."""
    try:
        return datetime.strptime(value, "%Y-%m").date()
    except ValueError:
        raise StatementError(f"month must look like YYYY-MM, got {value!r}") from None


def adapter_labels(session: Session, version_ids: set[uuid.UUID]) -> dict[uuid.UUID, tuple[str, int]]:
    """adapter version id -> (adapter name, version number)."""
    if not version_ids:
        return {}
    rows = session.execute(
        text("SELECT v.id, a.name, v.version FROM adapter_versions v JOIN adapters a ON a.id = v.adapter_id "
             "WHERE v.id = ANY(CAST(:ids AS uuid[]))"),
        {"ids": list(version_ids)},
    )
    return {vid: (name, version) for vid, name, version in rows}


def statement_lines(rows: list[DailyRow], labels: dict[uuid.UUID, tuple[str, int]]) -> list[LineData]:
    """Daily rows of one tenant-month -> lines per (base model, adapter version, tier), in a stable order
    (a model's Batch API line right after its live one)."""
    sums: dict[tuple[str, uuid.UUID | None, str], list[int]] = {}
    for r in rows:
        s = sums.setdefault((r.base_model, r.adapter_version_id, r.service_tier), [0] * len(TOTAL_FIELDS))
        for i, f in enumerate(TOTAL_FIELDS):
            s[i] += getattr(r, f)
    lines = []
    order = sorted(sums.items(), key=lambda kv: (kv[0][0], str(kv[0][1] or ""), kv[0][2] == SERVICE_TIER))
    for n, ((base_model, avid, tier), s) in enumerate(order, start=1):
        if avid is None:
            model, description = base_model, f"{base_model} (base model)"
        else:
            name, version = labels.get(avid, (str(avid), 0))
            model, description = f"{name}@{version}", f"adapter {name} v{version} on {base_model}"
        if tier == SERVICE_TIER:
            description += ", Batch API"
        lines.append(LineData(n, model, base_model, avid, description, tier, *s))
    return lines


def lines_digest(lines: list[LineData]) -> str:
    # A live line hashes as before the tier existed, so a month without batch lines is not re-issued for it.
    doc = [[ln.model, ln.base_model, str(ln.adapter_version_id or ""), *(getattr(ln, f) for f in TOTAL_FIELDS),
            *([ln.service_tier] if ln.service_tier != LIVE_TIER else [])] for ln in lines]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def issue_statement(
    session: Session, config: BillingConfig, *, tenant_id: uuid.UUID, period: date, issued_by: uuid.UUID | None = None,
    today: date | None = None, book: PriceBook | None = None,
) -> IssueResult:
    """Issue (or confirm) the statement of one tenant for the month starting at `period`. Commits."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _STATEMENTS_LOCK})
    result = _issue(session, config, tenant_id, period, issued_by, today, book)
    session.commit()
    return result


def issue_statements(
    session: Session, config: BillingConfig, *, period: date, tenant_ids: list[uuid.UUID] | None = None,
    issued_by: uuid.UUID | None = None, today: date | None = None,
) -> list[IssueResult]:
    """Statements for every tenant with usage in the month (or the given tenants). Commits; one tenant's
    refusal (unpriced usage) does not hold back the others."""
    _check_closed(period, today)
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _STATEMENTS_LOCK})
    book = PriceBook.load(session)
    if tenant_ids is None:
        tenant_ids = list(session.execute(
            text("SELECT DISTINCT tenant_id FROM usage_events WHERE created_at >= :lo AND created_at < :hi ORDER BY tenant_id"),
            {"lo": datetime.combine(period, datetime.min.time(), timezone.utc),
             "hi": datetime.combine(_next_month(period), datetime.min.time(), timezone.utc)},
        ).scalars())
    results = [_issue(session, config, t, period, issued_by, today, book) for t in tenant_ids]
    session.commit()
    issued = sum(r.status == "issued" for r in results)
    refused = [r for r in results if r.status == "refused"]
    log.info("statements %s: %d issued, %d unchanged, %d refused", period.strftime("%Y-%m"), issued,
             len(results) - issued - len(refused), len(refused))
    for r in refused:
        log.error("statement %s for tenant %s refused: %s", period.strftime("%Y-%m"), r.tenant_id, r.reason)
    return results


def _issue(session: Session, config: BillingConfig, tenant_id: uuid.UUID, period: date, issued_by: uuid.UUID | None,
           today: date | None, book: PriceBook | None) -> IssueResult:
    if period.day != 1:
        raise StatementError(f"a statement period starts on the first of a month, got {period}")
    _check_closed(period, today)
    rows = current_daily_rows(session, config, day_from=period, day_to=month_end(period), tenant_id=tenant_id, book=book)
    unpriced = sum(r.unpriced_requests for r in rows)
    if unpriced:
        return IssueResult(tenant_id, period, "refused", reason=f"{unpriced} request(s) have no list price at their time; "
                           "add the missing price rows, re-run the roll-up for those days, then issue again")
    lines = statement_lines(rows, adapter_labels(session, {r.adapter_version_id for r in rows if r.adapter_version_id}))
    digest = lines_digest(lines)
    latest = session.execute(
        select(Statement).where(Statement.tenant_id == tenant_id, Statement.period == period)
        .order_by(Statement.revision.desc()).limit(1)
    ).scalar_one_or_none()
    if latest is not None and latest.ledger_digest == digest:
        return IssueResult(tenant_id, period, "unchanged", latest.id, latest.revision, latest.total_micros)
    totals = {f: sum(getattr(ln, f) for ln in lines) for f in TOTAL_FIELDS}
    stmt = Statement(
        tenant_id=tenant_id, period=period, revision=(latest.revision + 1) if latest is not None else 1,
        total_micros=totals["amount_micros"] - totals["discount_micros"], ledger_digest=digest, issued_by=issued_by, **totals,
    )
    session.add(stmt)
    session.flush()
    session.add_all(
        StatementLine(statement_id=stmt.id, line_no=ln.line_no, model=ln.model, base_model=ln.base_model,
                      adapter_version_id=ln.adapter_version_id, description=ln.description, service_tier=ln.service_tier,
                      **{f: getattr(ln, f) for f in TOTAL_FIELDS})
        for ln in lines
    )
    session.flush()
    return IssueResult(tenant_id, period, "issued", stmt.id, stmt.revision, stmt.total_micros)


def _check_closed(period: date, today: date | None) -> None:
    today = today or datetime.now(timezone.utc).date()
    if month_end(period) >= today:
        raise StatementError(f"{period.strftime('%Y-%m')} is not closed yet: statements are issued for past months")


def _next_month(period: date) -> date:
    return date(period.year + period.month // 12, period.month % 12 + 1, 1)


