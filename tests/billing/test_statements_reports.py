"""Statements (immutable revisions, refusals) and the cost report (layout, CSV safety), and the CLI."""
from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
from datetime import date, datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from services.billing.reports import CSV_COLUMNS, build_report, report_csv, report_json_bytes
from services.billing.rollup import rollup_days
from services.billing.statements import StatementError, issue_statement, issue_statements
from services.common.models import Statement, StatementLine
from tests.billing.conftest import make_engine_price, make_price
from tests.factories import make_adapter, make_adapter_version, make_tenant, make_usage_event, unique

ROOT = Path(__file__).resolve().parents[2]
MARCH = date(2024, 3, 1)
TODAY = date(2024, 5, 1)


def at(day: int, month: int = 3) -> datetime:
    return datetime(2024, month, day, 12, tzinfo=timezone.utc)


def test_statement_lines_revisions_and_immutability(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    ad = make_adapter(db, tenant=tenant, name=unique("sql"))
    v2 = make_adapter_version(db, adapter=ad, version=2)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=1000, created_at=at(3))
    make_usage_event(db, tenant=tenant, adapter_version=v2, model=f"{ad.name}@2", prompt_tokens=1000, completion_tokens=0, created_at=at(4))
    make_usage_event(db, tenant=tenant, adapter_version=v2, model=ad.name, prompt_tokens=1000, completion_tokens=0, created_at=at(5))
    db.commit()

    first = issue_statement(db, config, tenant_id=tenant.id, period=MARCH, today=TODAY)
    assert (first.status, first.revision, first.total_micros) == ("issued", 1, 800 + 250 + 250)
    stmt = db.get(Statement, first.statement_id)
    lines = db.scalars(select(StatementLine).where(StatementLine.statement_id == stmt.id).order_by(StatementLine.line_no)).all()
    # Two spellings of the same adapter version are one line; the base model is its own line.
    assert [(ln.line_no, ln.model, ln.requests, ln.amount_micros) for ln in lines] == [
        (1, "mplex-demo", 1, 800), (2, f"{ad.name}@2", 2, 500)]
    assert lines[1].description == f"adapter {ad.name} v2 on mplex-demo"
    db.commit()

    assert issue_statement(db, config, tenant_id=tenant.id, period=MARCH, today=TODAY).status == "unchanged"

    make_usage_event(db, tenant=tenant, prompt_tokens=5000, completion_tokens=0, created_at=at(31))  # late, for a closed month
    db.commit()
    second = issue_statement(db, config, tenant_id=tenant.id, period=MARCH, today=TODAY)
    assert (second.status, second.revision, second.total_micros) == ("issued", 2, 1300 + 1000)
    db.expire_all()
    assert db.get(Statement, first.statement_id).total_micros == 1300  # revision 1 is untouched

    with pytest.raises(DBAPIError, match="append-only|not allowed|immutable|forbid"):
        db.execute(text("UPDATE statements SET total_micros = 0 WHERE id = :id"), {"id": first.statement_id})
    db.rollback()


def test_open_months_and_unpriced_usage_are_refused(db, config):
    with pytest.raises(StatementError, match="not closed"):
        issue_statement(db, config, tenant_id=make_tenant(db).id, period=date(2024, 5, 1), today=date(2024, 5, 31))
    db.rollback()
    plan = unique("plan")
    make_price(db, plan=plan)
    priced, unpriced = make_tenant(db, plan=plan), make_tenant(db, plan=unique("no-price"))
    for t in (priced, unpriced):
        make_usage_event(db, tenant=t, prompt_tokens=1000, completion_tokens=0, created_at=at(2))
    db.commit()
    results = {r.tenant_id: r for r in issue_statements(db, config, period=MARCH, tenant_ids=[priced.id, unpriced.id], today=TODAY)}
    assert results[priced.id].status == "issued"
    assert results[unpriced.id].status == "refused" and "no list price" in results[unpriced.id].reason
    assert db.scalar(select(Statement).where(Statement.tenant_id == unpriced.id)) is None


def test_report_layout_margin_and_csv_safety(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    make_engine_price(db, name=config.default_engine_type, price_per_hour=3_600_000_000)  # 1 micro-USD per µs
    evil = make_tenant(db, plan=plan, name='=HYPERLINK("http://x","y"), "quoted"')
    make_usage_event(db, tenant=evil, prompt_tokens=1000, completion_tokens=0, created_at=at(9), compute_us=150)
    db.commit()
    rollup_days(db, config, [date(2024, 3, 9)])
    rep = build_report(db, config, day_from=date(2024, 3, 9), day_to=date(2024, 3, 9))
    db.commit()
    mine = next(t for t in rep.tenants if t.tenant_id == evil.id)
    assert (mine.totals.billed_micros, mine.totals.compute_cost_micros, mine.totals.margin_micros) == (200, 150, 50)
    data = report_csv(rep)
    table = list(csv.reader(io.StringIO(data.decode())))
    assert tuple(table[0]) == CSV_COLUMNS
    row = next(r for r in table if r[3] == str(evil.id) and r[0] == "tenant")
    assert row[5] == "'" + evil.name  # a spreadsheet must not evaluate it
    assert [r[0] for r in table[1:]][-2:] == ["total", "unallocated"]
    assert report_csv(rep) == data and report_json_bytes(rep) == report_json_bytes(rep)


def test_csv_columns_are_documented_in_order():
    doc = (ROOT / "docs" / "billing.md").read_text()
    m = re.search(r"<!-- csv-columns -->\s*```\s*\n(.*?)\n```", doc, re.S)
    assert m, "docs/billing.md lists the CSV columns in a marked block"
    assert tuple(m.group(1).strip().split(",")) == CSV_COLUMNS


def test_cli_report_rollup_and_statements(db, config, stack_env, settings):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    make_usage_event(db, tenant=tenant, prompt_tokens=10_000, completion_tokens=0, created_at=at(20, month=2))
    db.commit()
    env = {**os.environ, **stack_env}

    def mplex(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "billing", *args], cwd=ROOT, env=env, capture_output=True, timeout=120)

    r = mplex("rollup", "--day", "2024-02-20")
    assert r.returncode == 0, r.stderr.decode()
    assert b"1 day(s) rolled up" in r.stdout
    csv_out = mplex("report", "--from", "2024-02-01", "--to", "2024-02-29", "--format", "csv")
    json_out = mplex("report", "--from", "2024-02-01", "--to", "2024-02-29", "--format", "json")
    assert csv_out.returncode == 0 and json_out.returncode == 0, csv_out.stderr.decode() + json_out.stderr.decode()
    from services.billing.config import BillingConfig

    rep = build_report(db, BillingConfig.from_settings(settings), day_from=date(2024, 2, 1), day_to=date(2024, 2, 29))
    db.commit()
    assert csv_out.stdout == report_csv(rep)
    assert json_out.stdout == report_json_bytes(rep)
    assert mplex("report", "--from", "2024-02-01", "--to", "2024-02-29", "--format", "csv").stdout == csv_out.stdout

    st = mplex("statements", "--month", "2024-02")
    assert str(tenant.id).encode() in st.stdout and b"issued" in st.stdout, st.stdout.decode() + st.stderr.decode()
    bad = mplex("report", "--from", "2024-02-10", "--to", "2024-02-01")
    assert bad.returncode != 0 and b"before it starts" in bad.stderr
