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


def _daily(db, tenant) -> UsageDaily:
    db.expire_all()
    return db.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant.id)).one()


def test_batch_lines_are_billed_at_the_batch_rate_in_the_daily_rows(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)  # 0.2 / 0.6 micro-USD per token in / out; batch: 50 % off
    tenant = make_tenant(db, plan=plan)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT)
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, completion_tokens=500, created_at=AT, service_tier="batch")
    rollup_days(db, config, [D])
    row = _daily(db, tenant)
    # each request lists at 200 + 300 = 500 micro-USD; the batch one is billed half of it
    assert (row.requests, row.amount_micros, row.discount_micros, row.amount_micros - row.discount_micros) == (2, 1000, 250, 750)


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
