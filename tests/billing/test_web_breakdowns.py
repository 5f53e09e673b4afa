"""The web app's money views over HTTP on the real gateway app: usage per API key (daily rows' billed amounts
apportioned by key, adding up exactly), one request's ledger record and price (the playground), the token
budget in dollars, and finance's daily trend with idle cost and net margin."""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from services.billing.key_usage import apportion
from services.common.models import Role
from tests.billing.conftest import make_engine_price, make_price
from tests.billing.test_api import api, signed_in  # noqa: F401 (fixture)
from tests.factories import make_adapter, make_adapter_version, make_api_key, make_tenant, make_usage_event, make_user, unique


@pytest.mark.parametrize(("total", "weights", "parts"), [
    (10, [1, 1, 1], [4, 3, 3]),
    (7, [3, 0, 1], [5, 0, 2]),
    (0, [5, 5], [0, 0]),
    (5, [0, 0], [3, 2]),
    (1_000_001, [2, 1], [666_667, 333_334]),  # remainders 1/3 and 2/3: the larger gets the spare one
    (3, [], []),
])
def test_apportion_adds_up_exactly(total, weights, parts):
    got = apportion(total, weights)
    assert got == parts
    assert sum(got) == (total if weights else 0)


@pytest.fixture
def priced(db, settings):
    """A tenant on a priced plan (0.20 / 0.10 / 0.60 per 1M tokens, adapter surcharge 0.05) with two keys, and
    another tenant with usage of its own."""
    plan = unique("plan")
    make_price(db, plan=plan)
    noon = datetime.now(timezone.utc).replace(day=1, hour=12, minute=0, second=0, microsecond=0)
    a, b = make_tenant(db, plan=plan, name=unique("Alpha")), make_tenant(db, plan=plan, name=unique("Beta"))
    k1, k2 = make_api_key(db, tenant=a, name=unique("backend")), make_api_key(db, tenant=a, name=unique("batch"))
    kb = make_api_key(db, tenant=b, name=unique("theirs"))
    users = {"a": make_user(db, tenant=a, role=Role.TENANT_MEMBER), "b": make_user(db, tenant=b, role=Role.TENANT_MEMBER),
             "finance": make_user(db, role=Role.FINANCE)}
    return {"a": a, "b": b, "k1": k1, "k2": k2, "kb": kb, "noon": noon,
            "h": {k: signed_in(db, settings, u) for k, u in users.items()}}


def test_usage_per_key_apportions_the_daily_rows_exactly(api, db, priced):
    a, noon = priced["a"], priced["noon"]
    # One daily row (same day, model, no adapter) shared by three requests of two keys: 1 + 2 + 3 micro-USD worth
    # of tokens that round once, as a row, to 6 (0.2 per 1M input: 5 tokens = 1 µUSD).
    make_usage_event(db, tenant=a, api_key=priced["k1"].row, prompt_tokens=5, completion_tokens=0, created_at=noon)
    make_usage_event(db, tenant=a, api_key=priced["k2"].row, prompt_tokens=10, completion_tokens=0, created_at=noon)
    make_usage_event(db, tenant=a, api_key=priced["k2"].row, prompt_tokens=15, completion_tokens=0, created_at=noon)
    # A second row for k1 with an adapter, and one request with no key at all.
    ad = make_adapter(db, tenant=a, name=unique("sum"))
    v1 = make_adapter_version(db, adapter=ad)
    make_usage_event(db, tenant=a, api_key=priced["k1"].row, adapter_version=v1, model=ad.name, prompt_tokens=10_000,
                     completion_tokens=5_000, created_at=noon + timedelta(hours=1))  # 2000 + 3000 + 750 surcharge
    make_usage_event(db, tenant=a, prompt_tokens=1_000, completion_tokens=0, created_at=noon)  # no key: 200
    make_usage_event(db, tenant=priced["b"], api_key=priced["kb"].row, prompt_tokens=777, completion_tokens=1, created_at=noon)

    r = api.get("/api/tenant/usage/keys", headers=priced["h"]["a"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["from"] == noon.date().isoformat()
    rows = {row["key_name"]: row for row in body["rows"]}
    assert set(rows) == {priced["k1"].row.name, priced["k2"].row.name, None}
    assert priced["kb"].row.name not in r.text and str(priced["kb"].row.id) not in r.text
    k1, k2, none = rows[priced["k1"].row.name], rows[priced["k2"].row.name], rows[None]
    assert (k1["requests"], k1["prompt_tokens"], k1["completion_tokens"]) == (2, 10_005, 5_000)
    assert (k2["requests"], k2["prompt_tokens"], k2["key_prefix"], k2["revoked"]) == (2, 25, priced["k2"].row.prefix, False)
    # The shared row's 206 µUSD (5 + 10 + 15 + 1000 tokens at 0.2/1M = 206) split 1 : 5 : 200 by what each used.
    assert (k1["billed_microusd"], k2["billed_microusd"], none["billed_microusd"]) == (1 + 5_750, 5, 200)
    usage = api.get("/api/tenant/usage", headers=priced["h"]["a"]).json()
    assert body["totals"]["billed_microusd"] == usage["totals"]["billed_microusd"] == 5_956
    assert body["totals"]["requests"] == usage["totals"]["requests"] == 5

    # The other tenant sees only its own key; naming tenant A changes nothing.
    theirs = api.get("/api/tenant/usage/keys", params={"tenant_id": str(a.id)}, headers=priced["h"]["b"]).json()
    assert [row["key_id"] for row in theirs["rows"]] == [str(priced["kb"].row.id)]
    assert priced["k1"].row.name not in str(theirs)
    assert api.get("/api/tenant/usage/keys", params={"from": "2024-13-01"}, headers=priced["h"]["a"]).status_code == 400
    assert api.get("/api/tenant/usage/keys", headers=priced["h"]["finance"]).status_code == 403


def test_one_requests_ledger_record_and_price_are_the_callers_only(api, db, priced):
    a = priced["a"]
    rid = f"req_{uuid.uuid4().hex}"
    make_usage_event(db, tenant=a, api_key=priced["k1"].row, prompt_tokens=10, completion_tokens=1, request_id=rid)
    big = f"req_{uuid.uuid4().hex}"  # 600k input x 0.2 + 400k cached x 0.1 + 100k output x 0.6 per 1M tokens
    make_usage_event(db, tenant=a, prompt_tokens=1_000_000, cached_tokens=400_000, completion_tokens=100_000, request_id=big)
    r = api.get(f"/api/tenant/requests/{big}", headers=priced["h"]["a"])
    assert r.status_code == 200, r.text
    rec = r.json()
    assert (rec["prompt_tokens"], rec["cached_tokens"], rec["completion_tokens"]) == (1_000_000, 400_000, 100_000)
    assert rec["billed_microusd"] == 120_000 + 40_000 + 60_000 and rec["adapter"] is None and rec["status"] == "ok"
    # The response id the client saw (chatcmpl-<request id>) works too.
    assert api.get(f"/api/tenant/requests/chatcmpl-{rid}", headers=priced["h"]["a"]).json()["request_id"] == rid
    # Another tenant's request is a 404 exactly like a missing one.
    theirs = api.get(f"/api/tenant/requests/{big}", headers=priced["h"]["b"])
    missing = api.get(f"/api/tenant/requests/req_{uuid.uuid4().hex}", headers=priced["h"]["b"])
    assert theirs.status_code == missing.status_code == 404 and theirs.content == missing.content


def test_spend_states_the_token_budget_in_dollars(api, db, priced):
    from services.common.models import TenantLimits

    a = priced["a"]
    db.add(TenantLimits(tenant_id=a.id, monthly_token_budget=2_000_000))
    db.commit()
    none_yet = api.get("/api/tenant/spend", headers=priced["h"]["a"]).json()["budget_in_dollars"]
    assert none_yet == {"used_microusd": 0, "budget_microusd": None, "microusd_per_million_tokens": None}
    make_usage_event(db, tenant=a, prompt_tokens=10_000, completion_tokens=5_000, created_at=priced["noon"])  # 5000 µUSD
    s = api.get("/api/tenant/spend", headers=priced["h"]["a"]).json()
    assert s["budget"] == {"monthly_token_budget": 2_000_000, "used_tokens": 15_000}
    assert s["budget_in_dollars"] == {"used_microusd": 5_000, "budget_microusd": 2_000_000 * 5_000 // 15_000,
                                      "microusd_per_million_tokens": 5_000 * 1_000_000 // 15_000}


def test_finance_trend_per_day_with_idle_cost_and_net_margin(api, db, priced):
    engine_type = unique("gpu")
    make_engine_price(db, name=engine_type, price_per_hour=3_600_000)  # 1 µUSD per ms
    day = priced["noon"]
    make_usage_event(db, tenant=priced["a"], prompt_tokens=10_000, completion_tokens=5_000, created_at=day)  # 5000 µUSD
    eng = unique("eng")
    for start, busy, idle in ((day, 1_000, 2_000_000), (day + timedelta(days=1), 0, 500_000)):  # idle: 2 s, then 0.5 s
        db.execute(text("INSERT INTO engine_usage_reports (engine_id, engine_type, base_model, window_start, window_end, "
                        "busy_us, idle_us) VALUES (:e, :t, 'mplex-demo', :s, :end, :b, :i)"),
                   {"e": eng, "t": engine_type, "s": start, "end": start + timedelta(seconds=3), "b": busy, "i": idle})
    db.commit()
    first, second = day.date(), day.date() + timedelta(days=1)
    params = {"from": first.isoformat(), "to": second.isoformat()}
    assert api.get("/api/finance/trend", params=params, headers=priced["h"]["a"]).status_code == 403
    r = api.get("/api/finance/trend", params=params, headers=priced["h"]["finance"])
    assert r.status_code == 200, r.text
    rows = {row["day"]: row for row in r.json()["rows"]}
    assert list(rows) == [first.isoformat(), second.isoformat()]
    d1, d2 = rows[first.isoformat()], rows[second.isoformat()]
    # Other tests' rows share the database: check this test's contribution through the report's own figures.
    report = api.get("/api/finance/report", params={"from": first.isoformat(), "to": first.isoformat()},
                     headers=priced["h"]["finance"]).json()
    assert d1["billed_microusd"] == report["totals"]["billed_microusd"] >= 5_000
    assert d1["unallocated_cost_microusd"] == report["unallocated_cost_microusd"] >= 2_000
    assert d1["margin_microusd"] == d1["billed_microusd"] - d1["compute_cost_microusd"]
    assert d1["net_margin_microusd"] == d1["margin_microusd"] - d1["unallocated_cost_microusd"] == report["net_margin_microusd"]
    assert d2["unallocated_cost_microusd"] >= 500
    bad = api.get("/api/finance/trend", params={"from": second.isoformat(), "to": first.isoformat()}, headers=priced["h"]["finance"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "to"
