"""Property-based billing invariants over random ledgers and price books, on real Postgres (hypothesis).

Each example: a fresh plan, two fresh tenants (one with an adapter), random effective-dated list prices,
contracts, engine-hour prices and 1-40 events over ~2 months. Checked against a reference written here
independently of the roll-up (per-event price lookup by scanning rows, exact rationals):

- roll-ups equal the reference row by row; their sums equal the ledger's (tokens, requests, compute);
- statements equal the sum of their roll-ups; lines add up to the statement;
- the month's export equals the statements to the micro-dollar, CSV equals JSON;
- re-running roll-ups and exports changes no row and no byte;
- a late event for a closed day is picked up by the next roll-up and yields a new statement revision.
"""
from __future__ import annotations

import csv
import io
import math
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select, text

from services.billing.config import BillingConfig
from services.billing.reports import build_report, month_period, report_csv, report_json
from services.billing.rollup import rollup_pending, stored_daily
from services.billing.statements import issue_statements
from services.common.ids import new_request_id
from services.common.models import EngineUsageReport, Statement, StatementLine, TenantPriceOverride, UsageEvent
from services.billing.pricebook import set_engine_price, set_list_price
from tests.factories import make_adapter, make_adapter_version, make_base_model, make_tenant, unique

T0 = datetime(2023, 1, 20, tzinfo=timezone.utc)
SPAN_S = 62 * 86400  # the ledger covers 20 Jan .. 23 Mar: three months, two of them partly
TODAY = date(2030, 1, 1)  # every month of the ledger is closed
BASE = "mplex-demo"

offsets = st.integers(-3 * 86400, SPAN_S)  # price rows may start before the ledger (or in the middle: unpriced gaps)
price = st.integers(0, 4_000_000)


@dataclass(frozen=True)
class Ev:
    tenant: int
    adapter: bool
    spelled: int  # the adapter requested as name (0) or name@1 (1)
    prompt: int
    cached: int
    completion: int
    compute_us: int
    engine: int  # 0: none, 1: the reported engine, 2: an engine that never reported
    offset_s: int


events_st = st.builds(
    lambda tenant, adapter, spelled, prompt, cached_frac, completion, compute, engine, offset: Ev(
        tenant, adapter and tenant == 0, spelled, prompt, prompt * cached_frac // 4, completion, compute, engine, offset),
    st.integers(0, 1), st.booleans(), st.integers(0, 1), st.integers(0, 6000), st.integers(0, 4), st.integers(0, 6000),
    st.integers(0, 20_000_000), st.integers(0, 2), st.integers(0, SPAN_S - 1),
)
list_prices_st = st.lists(st.tuples(offsets, price, price, price, st.integers(0, 500_000)), min_size=1, max_size=3,
                          unique_by=lambda t: t[0])
coarse = st.integers(-1, 12).map(lambda k: k * 5 * 86400)  # contract edges on a 5-day grid: overlaps are likely
_terms = (st.one_of(st.none(), st.integers(0, 10_000)), st.one_of(st.none(), price), st.one_of(st.none(), price))
_length = st.one_of(st.none(), st.integers(1, 8).map(lambda k: k * 5 * 86400))
# Tenant 0 always gets an all-models and a model-specific contract (random terms and dates, often overlapping:
# the specific one must win where both apply); any further contracts are random.
contracts_st = st.tuples(
    st.tuples(st.just(0), st.just(False), coarse, _length, *_terms),
    st.tuples(st.just(0), st.just(True), coarse, _length, *_terms),
    st.lists(st.tuples(st.integers(0, 1), st.booleans(), coarse, _length, *_terms), max_size=3),
).map(lambda t: [t[0], t[1], *t[2]])
engine_prices_st = st.lists(st.tuples(offsets, st.integers(0, 5_000_000)), max_size=2, unique_by=lambda t: t[0])


def at(offset_s: int) -> datetime:
    return T0 + timedelta(seconds=offset_s)


def half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


# -- the reference: per event, scanning price rows; exact rationals ------------------------------------
def ref_prices(lps, contracts, tenant_id, plan, t):
    lp = max((r for r in lps if r["plan"] == plan and r["effective_from"] <= t), key=lambda r: r["effective_from"], default=None)
    active = [c for c in contracts if c["tenant_id"] == tenant_id and c["effective_from"] <= t
              and (c["effective_to"] is None or t < c["effective_to"])]
    specific = [c for c in active if c["base_model"] == BASE]
    pool = specific or active
    con = max(pool, key=lambda c: c["effective_from"]) if pool else None
    out = {}
    for col in ("input", "cached_input", "output", "adapter_surcharge"):
        v = con.get(col) if con else None
        if v is None:
            v = lp[col] if lp else None
        if v is None:
            return None
        out[col] = v
    out["keep"] = Fraction(10_000 - ((con or {}).get("discount_bps") or 0), 10_000)
    return out


def reference(events, lps, contracts, eng_prices, tenants, plan, engine_type_of):
    acc = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "compute_us": 0,
                               "list": Fraction(0), "billed": Fraction(0), "compute": Fraction(0), "unpriced_requests": 0,
                               "uncosted_compute_us": 0})
    for e in events:
        a = acc[(e["created_at"].date(), e["tenant_id"], e["model"], e["adapter_version_id"], e.get("service_tier", "default"))]
        a["requests"] += 1
        for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "compute_us"):
            a[k] += e[k]
        p = ref_prices(lps, contracts, e["tenant_id"], plan, e["created_at"])
        if p is None:
            a["unpriced_requests"] += 1
        else:
            amount = Fraction((e["prompt_tokens"] - e["cached_tokens"]) * p["input"] + e["cached_tokens"] * p["cached_input"]
                              + e["completion_tokens"] * p["output"], 10**6)
            if e["adapter_version_id"] is not None:
                amount += Fraction((e["prompt_tokens"] + e["completion_tokens"]) * p["adapter_surcharge"], 10**6)
            a["list"] += amount
            a["billed"] += amount * p["keep"]
        if e["compute_us"]:
            etype = engine_type_of(e["engine_id"])
            rows = [r for r in eng_prices if r[0] == etype and r[1] <= e["created_at"]]
            if rows:
                a["compute"] += Fraction(e["compute_us"] * max(rows, key=lambda r: r[1])[2], 3_600_000_000)
            else:
                a["uncosted_compute_us"] += e["compute_us"]
    out = {}
    for key, a in acc.items():
        amount, billed = half_up(a["list"]), half_up(a["billed"])
        out[key] = {"requests": a["requests"], "prompt_tokens": a["prompt_tokens"], "cached_tokens": a["cached_tokens"],
                    "completion_tokens": a["completion_tokens"], "compute_us": a["compute_us"], "amount_micros": amount,
                    "discount_micros": amount - billed, "compute_cost_micros": half_up(a["compute"]),
                    "unpriced_requests": a["unpriced_requests"], "uncosted_compute_us": a["uncosted_compute_us"],
                    "exact_billed": a["billed"]}
    return out


@pytest.fixture
def session(db_engine):
    from sqlalchemy.orm import Session

    with Session(db_engine, expire_on_commit=False) as s:
        yield s


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=st.lists(events_st, min_size=1, max_size=40), lps_in=list_prices_st, contracts_in=contracts_st,
       engines_in=engine_prices_st, late_offset=st.integers(0, 20 * 86400), late_tokens=st.integers(1, 50_000))
def test_rollups_statements_and_exports_reconcile(session, events, lps_in, contracts_in, engines_in, late_offset, late_tokens):
    db = session
    plan = unique("plan")
    default_type, reported_type = unique("cpu"), unique("h100")
    config = BillingConfig(default_engine_type=default_type, settle_lag_s=0.0)
    make_base_model(db, name=BASE)
    tenants = [make_tenant(db, plan=plan), make_tenant(db, plan=plan)]
    adapter = make_adapter(db, tenant=tenants[0], name=unique("ad"))
    version = make_adapter_version(db, adapter=adapter)

    lps = []
    for off, pin, pcached, pout, psur in lps_in:
        set_list_price(db, base_model=BASE, plan=plan, effective_from=at(off), input=pin, cached_input=pcached, output=pout,
                       adapter_surcharge=psur)
        lps.append({"plan": plan, "effective_from": at(off), "input": pin, "cached_input": pcached, "output": pout,
                    "adapter_surcharge": psur})
    contracts = []
    for ti, specific, off, length, bps, pin, pout in contracts_in:
        if bps is None and pin is None and pout is None:
            bps = 2500  # a contract must say something
        start, end = at(off), (at(off + length) if length is not None else None)
        if db.scalar(select(TenantPriceOverride.id).where(TenantPriceOverride.tenant_id == tenants[ti].id,
                                                           TenantPriceOverride.base_model.is_(None) if not specific else TenantPriceOverride.base_model == BASE,
                                                           TenantPriceOverride.effective_from == start)):
            continue  # (tenant, model, start) is unique
        db.add(TenantPriceOverride(tenant_id=tenants[ti].id, base_model=BASE if specific else None, effective_from=start,
                                   effective_to=end, discount_bps=bps, input_per_mtok_micros=pin, output_per_mtok_micros=pout))
        db.flush()
        contracts.append({"tenant_id": tenants[ti].id, "base_model": BASE if specific else None, "effective_from": start,
                          "effective_to": end, "discount_bps": bps, "input": pin, "output": pout, "cached_input": None,
                          "adapter_surcharge": None})
    eng_prices = []
    for i, (off, per_hour) in enumerate(engines_in):
        etype = (default_type, reported_type)[i % 2]
        set_engine_price(db, name=etype, effective_from=at(off), price_per_hour=per_hour)
        eng_prices.append((etype, at(off), per_hour))
    reported_engine, silent_engine = unique("eng-r"), unique("eng-s")
    db.add(EngineUsageReport(engine_id=reported_engine, engine_type=reported_type, window_start=T0 - timedelta(days=1),
                             window_end=T0 - timedelta(days=1) + timedelta(seconds=15), busy_us=0, idle_us=15_000_000))
    db.commit()

    def engine_type_of(engine_id):
        return reported_type if engine_id == reported_engine else default_type

    rows = []
    for e in events:
        rows.append({
            "request_id": new_request_id(), "tenant_id": tenants[e.tenant].id,
            "model": (adapter.name if e.spelled == 0 else f"{adapter.name}@1") if e.adapter else BASE, "base_model": BASE,
            "adapter_version_id": version.id if e.adapter else None, "prompt_tokens": e.prompt, "cached_tokens": e.cached,
            "completion_tokens": e.completion, "status": "ok", "http_status": 200, "created_at": at(e.offset_s),
            "engine_id": (None, reported_engine, silent_engine)[e.engine], "compute_us": e.compute_us,
        })
    db.execute(insert(UsageEvent), rows)
    db.commit()
    tenant_ids = [t.id for t in tenants]

    # 1. Roll-ups equal the reference, row by row.
    rollup_pending(db, config)
    days = (T0.date(), (T0 + timedelta(seconds=SPAN_S)).date())

    def stored():
        got = [r for r in stored_daily(db, day_from=days[0], day_to=days[1]) if r.tenant_id in tenant_ids]
        db.commit()
        return {r.key: r for r in got}

    ref = reference(rows, lps, contracts, eng_prices, tenant_ids, plan, engine_type_of)
    got = stored()
    assert set(got) == set(ref)
    for key, r in got.items():
        expected = {k: v for k, v in ref[key].items() if k != "exact_billed"}
        assert {k: getattr(r, k) for k in expected} == expected, key
        assert r.base_model == BASE

    # ... and their sums equal the ledger's; rounding once per row drifts by at most half a micro-USD per row.
    ledger = db.execute(text(
        "SELECT count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(compute_us) FROM usage_events "
        "WHERE tenant_id = ANY(:t)"), {"t": tenant_ids}).one()
    db.commit()
    sums = [sum(getattr(r, f) for r in got.values()) for f in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "compute_us")]
    assert sums == [int(v) for v in ledger]
    exact_total = sum(v["exact_billed"] for v in ref.values())
    assert abs(sum(r.billed_micros for r in got.values()) - exact_total) <= Fraction(len(got), 2)

    # 2. Re-running the roll-up changes nothing.
    assert rollup_pending(db, config).changed == 0
    from services.billing.rollup import rollup_days

    again = rollup_days(db, config, sorted({k[0] for k in got}), tenant_ids=tenant_ids)
    assert again.changed == 0 and stored() == got

    # 3. Statements equal the sum of their roll-ups; exports equal the statements.
    months = sorted({k[0].replace(day=1) for k in got})
    for period in months:
        results = {r.tenant_id: r for r in issue_statements(db, config, period=period, tenant_ids=tenant_ids, today=TODAY)}
        first, last = month_period(period)
        report = build_report(db, config, day_from=first, day_to=last)
        db.commit()
        report_rows = {t.tenant_id: t for t in report.tenants}
        for tid in tenant_ids:
            month_rows = [r for r in got.values() if r.tenant_id == tid and first <= r.day <= last]
            if not month_rows:
                assert tid not in report_rows
                continue
            res = results[tid]
            billed = sum(r.billed_micros for r in month_rows)
            assert report_rows[tid].totals.billed_micros == billed
            assert report_rows[tid].totals.compute_cost_micros == sum(r.compute_cost_micros for r in month_rows)
            if sum(r.unpriced_requests for r in month_rows):
                assert res.status == "refused"
                continue
            assert res.status == "issued" and res.revision == 1
            stmt = db.get(Statement, res.statement_id)
            lines = db.scalars(select(StatementLine).where(StatementLine.statement_id == stmt.id)).all()
            db.commit()
            assert stmt.total_micros == billed == report_rows[tid].totals.billed_micros
            assert stmt.amount_micros == sum(r.amount_micros for r in month_rows) == sum(ln.amount_micros for ln in lines)
            assert stmt.discount_micros == sum(r.discount_micros for r in month_rows) == sum(ln.discount_micros for ln in lines)
            assert stmt.requests == sum(ln.requests for ln in lines) == sum(r.requests for r in month_rows)
            assert sorted(ln.adapter_version_id or uuid.UUID(int=0) for ln in lines) == sorted(
                {r.adapter_version_id or uuid.UUID(int=0) for r in month_rows})

        # CSV = JSON, and byte-identical when re-run.
        csv_bytes = report_csv(report)
        table = list(csv.DictReader(io.StringIO(csv_bytes.decode())))
        js = report_json(report)
        for row in js["rows"]:
            c = next(r for r in table if r["level"] == "tenant" and r["tenant_id"] == row["tenant_id"])
            assert int(c["billed_microusd"]) == row["billed_microusd"] and int(c["margin_microusd"]) == row["margin_microusd"]
            details = [r for r in table if r["level"] == "breakdown" and r["tenant_id"] == row["tenant_id"]]
            assert sum(int(r["billed_microusd"]) for r in details) == row["billed_microusd"]
        total = next(r for r in table if r["level"] == "total")
        assert int(total["billed_microusd"]) == js["totals"]["billed_microusd"] == sum(t.totals.billed_micros for t in report.tenants)
        assert report_csv(build_report(db, config, day_from=first, day_to=last)) == csv_bytes
        db.commit()
        assert all(r.status == "unchanged" for r in issue_statements(db, config, period=period, tenant_ids=tenant_ids, today=TODAY)
                   if r.status != "refused")

    # 4. A late event for a closed day: the next roll-up includes it, and the month gets a new revision.
    late_at = at(late_offset)
    late = {"request_id": new_request_id(), "tenant_id": tenants[1].id, "model": BASE, "base_model": BASE,
            "adapter_version_id": None, "prompt_tokens": late_tokens, "cached_tokens": 0, "completion_tokens": 0,
            "status": "ok", "http_status": 200, "created_at": late_at, "engine_id": None, "compute_us": 0}
    db.execute(insert(UsageEvent), [late])
    db.commit()
    result = rollup_pending(db, config)
    assert late_at.date() in result.days
    ref2 = reference(rows + [late], lps, contracts, eng_prices, tenant_ids, plan, engine_type_of)
    key = (late_at.date(), tenants[1].id, BASE, None, "default")
    after = stored()
    assert after[key].requests == ref2[key]["requests"] and after[key].amount_micros == ref2[key]["amount_micros"]
    period = late_at.date().replace(day=1)
    before = db.scalar(select(Statement).where(Statement.tenant_id == tenants[1].id, Statement.period == period)
                       .order_by(Statement.revision.desc()).limit(1))
    db.commit()
    (res,) = issue_statements(db, config, period=period, tenant_ids=[tenants[1].id], today=TODAY)
    month_rows = [r for r in after.values() if r.tenant_id == tenants[1].id and r.day.replace(day=1) == period]
    if any(r.unpriced_requests for r in month_rows):
        assert res.status == "refused"
    else:
        assert res.status == "issued"
        assert res.revision == (before.revision + 1 if before is not None else 1)
        assert res.total_micros == sum(r.billed_micros for r in month_rows)
        if before is not None:
            db.refresh(before)
            assert before.total_micros == sum(r.billed_micros for r in got.values()
                                              if r.tenant_id == tenants[1].id and r.day.replace(day=1) == period)
    db.commit()
