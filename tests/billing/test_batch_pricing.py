"""Batch API usage is priced at the price book's batch rate: in daily roll-ups (hence usage, spend, statements
and finance reports, which read them) and for a single request, compounding with a contract discount."""
from __future__ import annotations

from datetime import date, datetime, timezone

from sqlalchemy import select

from services.billing.pricebook import PriceBook
from services.billing.pricing import price_usage
from services.billing.rollup import rollup_days
from services.common.models import UsageDaily
from tests.billing.conftest import make_contract, make_price
from tests.factories import make_tenant, make_usage_event, unique

D = date(2024, 6, 3)
AT = datetime(2024, 6, 3, 12, tzinfo=timezone.utc)


def _daily(db, tenant, tier: str = "batch") -> UsageDaily:
    db.expire_all()
    return db.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant.id, UsageDaily.service_tier == tier)).one()


def test_batch_lines_are_billed_at_the_batch_rate_in_their_own_daily_row(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)  # 0.2 / 0.6 micro-USD per token in / out; batch: 50 % off
    tenant = make_tenant(db, plan=plan)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT, service_tier="batch")
    make_usage_event(db, tenant=tenant, prompt_tokens=10, completion_tokens=0, created_at=AT, service_tier="batch")
    rollup_days(db, config, [D])
    live, batch = _daily(db, tenant, "default"), _daily(db, tenant, "batch")
    # each big request lists at 200 + 300 = 500 micro-USD; the batch ones are billed half of it
    assert (live.requests, live.amount_micros, live.discount_micros) == (1, 500, 0)
    assert (batch.requests, batch.prompt_tokens, batch.amount_micros, batch.discount_micros) == (2, 1010, 502, 251)
    assert live.model == batch.model and live.adapter_version_id == batch.adapter_version_id is None
    assert rollup_days(db, config, [D]).changed == 0  # idempotent on the natural key with its tier


def test_the_batch_rate_is_per_price_row_and_compounds_with_a_contract(db, config):
    plan = unique("plan")
    make_price(db, plan=plan, batch_discount_bps=3000)
    tenant = make_tenant(db, plan=plan)
    make_contract(db, tenant=tenant, discount_bps=2000)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT, service_tier="batch")
    rollup_days(db, config, [D])
    row = _daily(db, tenant)
    assert row.amount_micros == 500 and row.amount_micros - row.discount_micros == 280  # 500 x 0.8 x 0.7
    # one request priced on its own (the gateway's pricer, /api/tenant/requests/{id}) agrees
    book = PriceBook.load(db)
    rec = make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT, service_tier="batch")
    assert price_usage(book, plan, rec).billed_micros == 280
    live = make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT)
    assert price_usage(book, plan, live).billed_micros == 400


def test_usage_shows_batch_lines_apart_for_the_tenant_and_period_only(db, config):
    from datetime import timedelta

    from services.billing.usage import batch_usage, tenant_usage

    plan = unique("plan")
    make_price(db, plan=plan)
    tenant, other = make_tenant(db, plan=plan), make_tenant(db, plan=plan)
    make_usage_event(db, tenant=tenant, prompt_tokens=10, completion_tokens=5, created_at=AT, service_tier="batch")
    make_usage_event(db, tenant=tenant, prompt_tokens=7, completion_tokens=3, created_at=AT, service_tier="batch")
    make_usage_event(db, tenant=tenant, prompt_tokens=100, completion_tokens=50, created_at=AT)  # live
    make_usage_event(db, tenant=tenant, prompt_tokens=1, completion_tokens=1, created_at=AT + timedelta(days=40),
                     service_tier="batch")  # another period
    make_usage_event(db, tenant=other, prompt_tokens=9, completion_tokens=9, created_at=AT, service_tier="batch")
    out = tenant_usage(db, config, tenant_id=tenant.id, day_from=D, day_to=D, group_by=("day",))
    assert out["batch"] == {"requests": 2, "prompt_tokens": 17, "completion_tokens": 8}
    assert out["totals"]["requests"] == 3  # the batch lines are in the totals too, billed at the batch rate
    assert batch_usage(db, tenant_id=other.id, start=AT - timedelta(hours=1), end=AT + timedelta(hours=1))["requests"] == 1


def test_statements_and_the_finance_csv_show_batch_lines_apart_with_unchanged_totals(db, config):
    import csv
    import io

    from services.billing.reports import CSV_COLUMNS, build_report, report_csv, report_json
    from services.billing.statements import issue_statement
    from services.billing.usage import tenant_usage
    from services.common.models import Statement, StatementLine
    from tests.factories import make_adapter, make_adapter_version

    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    ad = make_adapter(db, tenant=tenant, name=unique("sql"))
    v1 = make_adapter_version(db, adapter=ad, version=1)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT)  # 500
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT, service_tier="batch")  # 250
    make_usage_event(db, tenant=tenant, adapter_version=v1, model=ad.name, prompt_tokens=1000, completion_tokens=0,
                     created_at=AT, service_tier="batch")  # (200 + 50 surcharge) / 2 = 125
    db.commit()
    first = issue_statement(db, config, tenant_id=tenant.id, period=date(2024, 6, 1), today=date(2024, 8, 1))
    assert first.total_micros == 500 + 250 + 125
    lines = db.scalars(select(StatementLine).where(StatementLine.statement_id == first.statement_id)
                       .order_by(StatementLine.line_no)).all()
    assert [(ln.model, ln.service_tier, ln.requests, ln.amount_micros - ln.discount_micros) for ln in lines] == [
        ("mplex-demo", "default", 1, 500), ("mplex-demo", "batch", 1, 250), (f"{ad.name}@1", "batch", 1, 125)]
    assert lines[1].description == "mplex-demo (base model), Batch API"
    assert db.get(Statement, first.statement_id).total_micros == sum(ln.amount_micros - ln.discount_micros for ln in lines)
    db.commit()
    assert issue_statement(db, config, tenant_id=tenant.id, period=date(2024, 6, 1), today=date(2024, 8, 1)).status == "unchanged"

    rep = build_report(db, config, day_from=D, day_to=D, tenant_id=tenant.id)
    db.commit()
    table = list(csv.DictReader(io.StringIO(report_csv(rep).decode())))
    assert list(table[0]) == list(CSV_COLUMNS) and CSV_COLUMNS[-1] == "service_tier"
    mine = [r for r in table if r["tenant_id"] == str(tenant.id)]
    assert [(r["level"], r["adapter"], r["service_tier"], r["billed_microusd"]) for r in mine] == [
        ("tenant", "", "", "875"), ("breakdown", "", "default", "500"), ("breakdown", "", "batch", "250"),
        ("breakdown", f"{ad.name}@1", "batch", "125")]
    breakdown = report_json(rep)["rows"][0]["breakdown"]
    assert [b["service_tier"] for b in breakdown] == ["default", "batch", "batch"]
    # The tenant's usage totals are the same money, whichever rows it is split into.
    assert tenant_usage(db, config, tenant_id=tenant.id, day_from=D, day_to=D, group_by=("day",))["totals"]["billed_microusd"] == 875
