"""Daily roll-ups on real Postgres: amounts by the price book, idempotent upserts, late events by ingest time."""
from __future__ import annotations

import uuid
from datetime import date, datetime, timedelta, timezone

from sqlalchemy import select, text

from services.billing.pricebook import PriceBook
from services.billing.rollup import compute_daily, current_daily_rows, read_cursor, rollup_days, rollup_pending, stored_daily
from services.common.models import EngineUsageReport, UsageDaily
from tests.billing.conftest import make_contract, make_engine_price, make_price
from tests.factories import make_adapter, make_adapter_version, make_tenant, make_usage_event, unique

D1 = date(2024, 3, 4)
D2 = date(2024, 3, 5)


def at(day: date, hour: int, minute: int = 0) -> datetime:
    return datetime(day.year, day.month, day.day, hour, minute, tzinfo=timezone.utc)


def rows_of(db, tenant) -> list[UsageDaily]:
    db.expire_all()
    return list(db.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant.id).order_by(UsageDaily.day, UsageDaily.model)))


def test_rollup_prices_each_day_and_model(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    version = make_adapter_version(db, adapter=make_adapter(db, tenant=tenant, name=unique("ad")))
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, cached_tokens=400, completion_tokens=250, created_at=at(D1, 1))
    make_usage_event(db, tenant=tenant, prompt_tokens=1000, cached_tokens=0, completion_tokens=0, created_at=at(D1, 23, 59))
    make_usage_event(db, tenant=tenant, adapter_version=version, model="x", prompt_tokens=1000, cached_tokens=400,
                     completion_tokens=250, created_at=at(D1, 12))
    make_usage_event(db, tenant=tenant, prompt_tokens=3, cached_tokens=0, completion_tokens=1, created_at=at(D2, 0))
    db.commit()

    result = rollup_days(db, config, [D1, D2])
    assert result.days == (D1, D2)
    rows = rows_of(db, tenant)
    by = {(r.day, r.model): r for r in rows}
    assert set(by) == {(D1, "mplex-demo"), (D1, "x"), (D2, "mplex-demo")}
    base = by[(D1, "mplex-demo")]
    # 600x0.2 + 400x0.1 + 250x0.6 = 310 micro; + 1000 x 0.2 = 200 micro
    assert (base.requests, base.prompt_tokens, base.cached_tokens, base.completion_tokens) == (2, 2000, 400, 250)
    assert (base.amount_micros, base.discount_micros) == (510, 0)
    assert base.adapter_version_id is None and base.base_model == "mplex-demo"
    adapter = by[(D1, "x")]
    assert adapter.adapter_version_id == version.id and adapter.amount_micros == 373  # 372.5 with surcharge, half up
    tiny = by[(D2, "mplex-demo")]
    assert tiny.amount_micros == 1  # 0.6 + 0.6 = 1.2 micro -> 1
    assert all(r.unpriced_requests == 0 for r in rows)


def test_rerunning_a_day_leaves_rows_identical_and_untouched(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    for i in range(5):
        make_usage_event(db, tenant=tenant, prompt_tokens=100 + i, completion_tokens=7 * i, created_at=at(D1, i))
    db.commit()
    rollup_days(db, config, [D1])
    first = [(r.id, r.updated_at, r.amount_micros, r.requests) for r in rows_of(db, tenant)]
    again = rollup_days(db, config, [D1], tenant_ids=[tenant.id])
    assert again.changed == 0  # unchanged rows are not rewritten: same ids, same updated_at
    assert [(r.id, r.updated_at, r.amount_micros, r.requests) for r in rows_of(db, tenant)] == first


def test_late_event_for_a_closed_day_is_picked_up_by_ingest_time(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    make_usage_event(db, tenant=tenant, prompt_tokens=10_000, completion_tokens=0, created_at=at(D1, 3))
    db.commit()
    rollup_pending(db, config)
    assert [(r.day, r.requests, r.amount_micros) for r in rows_of(db, tenant)] == [(D1, 1, 2000)]
    cursor = read_cursor(db)
    db.commit()

    # Arrives now (recorded_at = now) for a day long closed, e.g. replayed from a gateway's spool.
    make_usage_event(db, tenant=tenant, prompt_tokens=5_000, completion_tokens=0, created_at=at(D1, 4))
    db.commit()
    live = [r for r in current_daily_rows(db, config, day_from=D1, day_to=D1, tenant_id=tenant.id)]
    assert [(r.requests, r.amount_micros) for r in live] == [(2, 3000)]  # readers see it before the roll-up
    db.commit()
    result = rollup_pending(db, config)
    assert D1 in result.days and result.recorded_through > cursor
    assert [(r.day, r.requests, r.amount_micros) for r in rows_of(db, tenant)] == [(D1, 2, 3000)]


def test_an_open_transaction_holds_the_cursor_back(db, db_engine, config):
    """A ledger row inserted by a transaction that commits after a roll-up ran must still be rolled up:
    its recorded_at (transaction start) is before the roll-up, so the cursor must not have passed it."""
    from sqlalchemy.orm import Session

    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    db.commit()
    with Session(db_engine) as slow:
        slow.execute(text("SELECT 1"))  # the slow writer's transaction has started (recorded_at = now())
        slow.execute(
            text("INSERT INTO usage_events (request_id, tenant_id, model, base_model, prompt_tokens, completion_tokens, "
                 "status, http_status, created_at) VALUES (:r, :t, 'mplex-demo', 'mplex-demo', 10000, 0, 'ok', 200, :c)"),
            {"r": f"req_{uuid.uuid4().hex}", "t": tenant.id, "c": at(D2, 5)},
        )
        recorded = slow.execute(text("SELECT now()")).scalar_one()
        rollup_pending(db, config)  # runs while the insert is uncommitted
        assert read_cursor(db) <= recorded
        db.commit()
        slow.commit()
    rollup_pending(db, config)
    assert [(r.day, r.requests, r.amount_micros) for r in rows_of(db, tenant)] == [(D2, 1, 2000)]


def test_price_changes_mid_day_and_contracts(db, config):
    plan = unique("plan")
    make_price(db, plan=plan, input=1_000_000, cached_input=0, output=0, adapter_surcharge=0)
    make_price(db, plan=plan, effective_from=at(D1, 12), input=2_000_000, cached_input=0, output=0, adapter_surcharge=0)
    a, b = make_tenant(db, plan=plan), make_tenant(db, plan=plan)
    # b: 10% off everything all the time; from 18:00 a model-specific contract at 3.00/M with 50% off wins.
    make_contract(db, tenant=b, discount_bps=1000)
    make_contract(db, tenant=b, base_model="mplex-demo", effective_from=at(D1, 18), effective_to=at(D1, 20),
                  discount_bps=5000, input=3_000_000)
    for tenant in (a, b):
        for hour in (6, 13, 19, 21):
            make_usage_event(db, tenant=tenant, prompt_tokens=1_000, completion_tokens=0, created_at=at(D1, hour))
    db.commit()
    rollup_days(db, config, [D1], tenant_ids=[a.id, b.id])
    (ra,) = rows_of(db, a)
    assert (ra.amount_micros, ra.discount_micros) == (1000 + 2000 + 2000 + 2000, 0)
    (rb,) = rows_of(db, b)
    # list: 1000 + 2000 + 3000 (contract price) + 2000; billed: 900 + 1800 + 1500 + 1800
    assert rb.amount_micros == 8000 and rb.amount_micros - rb.discount_micros == 6000
    # The point-in-time resolution agrees with the segments the roll-up joined.
    book = PriceBook.load(db)
    assert book.unit_prices_at(b.id, plan, "mplex-demo", at(D1, 19)).input == 3_000_000
    assert book.unit_prices_at(b.id, plan, "mplex-demo", at(D1, 19)).keep_bps == 5000
    assert book.unit_prices_at(b.id, plan, "mplex-demo", at(D1, 20)).keep_bps == 9000
    assert book.unit_prices_at(a.id, plan, "mplex-demo", at(D1, 11, 59)).input == 1_000_000


def test_unpriced_usage_is_counted_not_fatal(db, config):
    priced_plan, missing_plan = unique("plan"), unique("plan")
    make_price(db, plan=priced_plan)
    ok, gap = make_tenant(db, plan=priced_plan), make_tenant(db, plan=missing_plan)
    make_usage_event(db, tenant=ok, prompt_tokens=1000, completion_tokens=0, created_at=at(D1, 1))
    make_usage_event(db, tenant=gap, prompt_tokens=1000, completion_tokens=0, created_at=at(D1, 1))
    make_usage_event(db, tenant=gap, prompt_tokens=1000, completion_tokens=0, created_at=at(D1, 2))
    db.commit()
    rollup_days(db, config, [D1], tenant_ids=[ok.id, gap.id])
    assert [(r.amount_micros, r.unpriced_requests) for r in rows_of(db, ok)] == [(200, 0)]
    assert [(r.requests, r.amount_micros, r.unpriced_requests) for r in rows_of(db, gap)] == [(2, 0, 2)]


def test_compute_cost_uses_the_engine_type_from_reports(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    h100, default = unique("h100"), config.default_engine_type
    make_engine_price(db, name=h100, price_per_hour=3_600_000)  # 1 micro-USD per ms
    make_engine_price(db, name=default, price_per_hour=360_000)  # 0.1 micro-USD per ms
    tenant = make_tenant(db, plan=plan)
    gpu, cpu = unique("gpu-engine"), unique("cpu-engine")
    db.add(EngineUsageReport(engine_id=gpu, engine_type=h100, window_start=at(D1, 0), window_end=at(D1, 1), busy_us=1, idle_us=0))
    db.commit()
    e1 = make_usage_event(db, tenant=tenant, created_at=at(D1, 5), compute_us=1500)  # 1.5 ms on the H100
    e2 = make_usage_event(db, tenant=tenant, created_at=at(D1, 6), compute_us=2000)  # 2 ms on an unreported engine
    # The factory writes no engine id: these carry one.
    for eng, us in ((gpu, 1500), (cpu, 2000)):
        db.execute(
            text("INSERT INTO usage_events (request_id, tenant_id, model, base_model, prompt_tokens, completion_tokens, "
                 "status, http_status, created_at, engine_id, compute_us) VALUES (:r, :t, 'm2', 'mplex-demo', 0, 0, 'ok', 200, :c, :e, :us)"),
            {"r": f"req_{uuid.uuid4().hex}", "t": tenant.id, "c": at(D1, 7), "e": eng, "us": us},
        )
    db.commit()
    rows = compute_daily(db, PriceBook.load(db), config, day_from=D1, day_to=D1, tenant_ids=[tenant.id])
    by = {r.model: r for r in rows}
    # m2: 1.5 ms x 1 + 2 ms x 0.1 = 1.7 -> 2; mplex-demo events had no engine: compute 3500 us at the default price = 0.35 -> 0
    assert by["m2"].compute_us == 3500 and by["m2"].compute_cost_micros == 2
    assert by["mplex-demo"].compute_us == e1.compute_us + e2.compute_us
    assert by["mplex-demo"].compute_cost_micros == 0 and by["mplex-demo"].uncosted_compute_us == 0


def test_current_rows_equal_what_the_rollup_stores(db, config):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    for i in range(6):
        make_usage_event(db, tenant=tenant, prompt_tokens=17 * i, completion_tokens=5, created_at=at(D1 + timedelta(days=i % 3), i))
    db.commit()
    live = current_daily_rows(db, config, day_from=D1, day_to=D1 + timedelta(days=2), tenant_id=tenant.id)
    db.commit()
    rollup_pending(db, config)
    stored = sorted(stored_daily(db, day_from=D1, day_to=D1 + timedelta(days=2), tenant_id=tenant.id), key=lambda r: r.day)
    assert live == stored and len(stored) == 3
    assert current_daily_rows(db, config, day_from=D1, day_to=D1 + timedelta(days=2), tenant_id=tenant.id) == stored
