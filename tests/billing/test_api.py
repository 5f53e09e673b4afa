"""Tenant usage/spend and finance report endpoints over HTTP: the real gateway app (create_app) with real
Postgres, Redis, session cookies and role checks; tenants see only their own usage, finance needs its role."""
from __future__ import annotations

import csv
import io
import uuid
from datetime import date, datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from services.billing.config import BillingConfig
from services.billing.reports import build_report, report_csv, report_json_bytes
from services.common.models import Role
from services.gateway.auth import SESSION_COOKIE, create_session
from tests.billing.conftest import make_price
from tests.factories import make_adapter, make_adapter_version, make_tenant, make_usage_event, make_user, unique


@pytest.fixture
def api(settings, database_url, service_urls, tmp_path):
    """create_app on a Gateway holding what the management API uses (no engines, no base model files)."""
    import aiohttp

    from services.common.db import make_db_engine, make_sessionmaker
    from services.gateway.app import create_app
    from services.gateway.auth import KeyAuth
    from services.gateway.metering import Meter
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.quotas import Quotas
    from services.gateway.router import Registry, Router
    from services.gateway.state import Gateway, make_redis

    engine = make_db_engine(database_url, pool_size=4, max_overflow=4)
    factory = make_sessionmaker(engine)
    redis = make_redis(service_urls.redis_url)
    metrics = GatewayMetrics()
    gw = Gateway(settings=settings, session_factory=factory, redis=redis,
                 key_auth=KeyAuth(redis, factory, settings.secret(), settings.key_cache_ttl_s), quotas=Quotas(redis),
                 registry=Registry(redis), router=Router(), resolver=None, meter=Meter(factory, tmp_path / "spool", metrics),
                 http=None, metrics=metrics)

    async def client_session():
        return aiohttp.ClientSession()

    with TestClient(create_app(settings, gateway=gw, web_dist=None)) as client:
        gw.http = client.portal.call(client_session)  # aiohttp needs the app's running loop
        client.gw = gw
        yield client
    engine.dispose()


def signed_in(db, settings, user) -> dict[str, str]:
    token, _csrf = create_session(db, user, settings.secret(), 3600, "pytest", "127.0.0.1")
    db.commit()
    return {"Cookie": f"{SESSION_COOKIE}={token}"}


@pytest.fixture
def world(db, settings):
    """Two tenants on one priced plan with usage this month and last month; users of every role."""
    plan = unique("plan")
    make_price(db, plan=plan)  # 0.20 / 0.10 / 0.60 per 1M, adapter surcharge 0.05
    now = datetime.now(timezone.utc)
    this_month = now.replace(day=1, hour=12, minute=0, second=0, microsecond=0)
    last_month = (this_month - timedelta(days=1)).replace(day=1)
    a, b = make_tenant(db, plan=plan, name=unique("Alpha")), make_tenant(db, plan=plan, name=unique("Beta"))
    ad = make_adapter(db, tenant=a, name=unique("summarize"))
    v1 = make_adapter_version(db, adapter=ad)
    make_usage_event(db, tenant=a, prompt_tokens=10_000, completion_tokens=5_000, created_at=this_month)  # 2000 + 3000
    make_usage_event(db, tenant=a, adapter_version=v1, model=ad.name, prompt_tokens=10_000, cached_tokens=10_000,
                     completion_tokens=0, created_at=this_month + timedelta(hours=1))  # 1000 + 500 surcharge
    make_usage_event(db, tenant=a, prompt_tokens=1_000_000, completion_tokens=0, created_at=last_month)  # 200000
    make_usage_event(db, tenant=b, prompt_tokens=777, completion_tokens=333, created_at=this_month)
    users = {
        "a_member": make_user(db, tenant=a, role=Role.TENANT_MEMBER),
        "a_admin": make_user(db, tenant=a, role=Role.TENANT_ADMIN),
        "b_member": make_user(db, tenant=b, role=Role.TENANT_MEMBER),
        "finance": make_user(db, role=Role.FINANCE),
        "platform": make_user(db, role=Role.PLATFORM_ADMIN),
    }
    db.commit()
    return {"a": a, "b": b, "adapter": ad, "this_month": this_month.date(), "last_month": last_month.date(),
            "headers": {k: signed_in(db, settings, u) for k, u in users.items()}}


def test_tenant_usage_is_the_callers_tenant_only(api, world):
    h = world["headers"]
    month = world["this_month"]
    r = api.get("/api/tenant/usage", headers=h["a_member"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["from"] == month.isoformat() and body["group_by"] == ["day"]
    assert body["totals"] == {"requests": 2, "prompt_tokens": 20_000, "cached_tokens": 10_000, "completion_tokens": 5_000,
                              "billed_microusd": 6_500}
    assert body["rows"] == [{"day": month.isoformat(), **body["totals"]}]

    # Naming the other tenant in the query changes nothing: the session decides.
    sneaky = api.get("/api/tenant/usage", params={"tenant_id": str(world["b"].id)}, headers=h["a_member"])
    assert sneaky.json() == body
    b_body = api.get("/api/tenant/usage", params={"tenant_id": str(world["a"].id)}, headers=h["b_member"]).json()
    assert b_body["totals"]["requests"] == 1 and b_body["totals"]["prompt_tokens"] == 777


def test_tenant_usage_groupings_and_periods(api, world):
    h, a_month = world["headers"], world["this_month"]
    by_adapter = api.get("/api/tenant/usage", params={"group_by": "adapter"}, headers=h["a_admin"]).json()
    assert by_adapter["rows"] == [
        {"adapter": None, "requests": 1, "prompt_tokens": 10_000, "cached_tokens": 0, "completion_tokens": 5_000, "billed_microusd": 5_000},
        {"adapter": world["adapter"].name, "requests": 1, "prompt_tokens": 10_000, "cached_tokens": 10_000, "completion_tokens": 0,
         "billed_microusd": 1_500},
    ]
    per_day_adapter = api.get("/api/tenant/usage", params={"group_by": "day,adapter"}, headers=h["a_admin"]).json()
    assert [(r["day"], r["adapter"]) for r in per_day_adapter["rows"]] == [(a_month.isoformat(), None), (a_month.isoformat(), world["adapter"].name)]
    by_model = api.get("/api/tenant/usage", params={"group_by": "model"}, headers=h["a_admin"]).json()
    assert [r["model"] for r in by_model["rows"]] == ["mplex-demo"]

    last = world["last_month"]
    two_months = api.get("/api/tenant/usage", params={"from": last.isoformat(), "to": (a_month + timedelta(days=1)).isoformat()},
                         headers=h["a_member"]).json()
    assert [r["day"] for r in two_months["rows"]] == [last.isoformat(), a_month.isoformat()]
    assert two_months["totals"]["billed_microusd"] == 6_500 + 200_000


@pytest.mark.parametrize(("params", "param"), [
    ({"group_by": "tenant"}, "group_by"), ({"group_by": "day,day"}, "group_by"), ({"from": "2024-02-30"}, "from"),
    ({"from": "2024-03-02", "to": "2024-03-01"}, "to"), ({"from": "2020-01-01", "to": "2024-01-01"}, "from"),
    ({"from": "9999-12-31", "to": "9999-12-31"}, "from"), ({"from": "0001-01-01", "to": "0001-01-02"}, "from"),
])
def test_tenant_usage_rejects_bad_queries_with_openai_errors(api, world, params, param):
    r = api.get("/api/tenant/usage", params=params, headers=world["headers"]["a_member"])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_tenant_endpoints_need_a_tenant_role(api, world):
    h = world["headers"]
    for path in ("/api/tenant/usage", "/api/tenant/spend"):
        assert api.get(path).status_code == 401
        assert api.get(path).json()["error"]["code"] == "not_signed_in"
        for role in ("finance", "platform"):
            r = api.get(path, headers=h[role])
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def test_spend_this_month_with_live_quota_meters(api, world, db):
    from services.common.models import TenantLimits
    from services.gateway.quotas import Limits, Scope

    db.add(TenantLimits(tenant_id=world["a"].id, tokens_per_min=100_000, requests_per_min=60, concurrent_requests=4,
                        monthly_token_budget=1_000_000))
    db.commit()
    gw = api.gw
    scope = Scope("tenant", str(world["a"].id), Limits(100_000, 60, 4, 1_000_000))
    reservation = api.portal.call(gw.quotas.reserve, f"req_{uuid.uuid4().hex}", [scope], 1234)
    try:
        r = api.get("/api/tenant/spend", headers=world["headers"]["a_member"])
        assert r.status_code == 200, r.text
        s = r.json()
        today = datetime.now(timezone.utc).date()
        assert s["period"]["from"] == today.replace(day=1).isoformat()
        assert s["billed_microusd"] == 6_500
        assert s["projected_microusd"] >= s["billed_microusd"]
        assert s["budget"] == {"monthly_token_budget": 1_000_000, "used_tokens": 25_000}
        assert s["meters"]["tokens_per_min"] == {"limit": 100_000, "used": 1234}
        assert s["meters"]["requests_per_min"] == {"limit": 60, "used": 1}
        assert s["meters"]["concurrent"] == {"limit": 4, "used": 1}
        assert s["meters"]["monthly_tokens"] == {"limit": 1_000_000, "used": 25_000}
    finally:
        api.portal.call(gw.quotas.settle, reservation, 0)
    after = api.get("/api/tenant/spend", headers=world["headers"]["a_member"]).json()
    assert after["meters"]["concurrent"]["used"] == 0


def test_finance_report_roles_and_formats(api, world, db, settings):
    h = world["headers"]
    params = {"from": world["last_month"].isoformat(), "to": (world["this_month"] + timedelta(days=1)).isoformat()}
    for who in ("a_member", "a_admin", "b_member"):
        for path in ("/api/finance/report", "/api/finance/report.csv"):
            r = api.get(path, params=params, headers=h[who])
            assert r.status_code == 403 and r.json()["error"]["code"] == "role_required"
    assert api.get("/api/finance/report", params=params).status_code == 401

    for who in ("finance", "platform"):
        r = api.get("/api/finance/report", params=params, headers=h[who])
        assert r.status_code == 200, r.text
        rows = {row["tenant_id"]: row for row in r.json()["rows"]}
        a = rows[str(world["a"].id)]
        assert (a["requests"], a["billed_microusd"]) == (3, 206_500)
        assert [(x["model"], x["adapter"]) for x in a["breakdown"]] == [("mplex-demo", None), ("mplex-demo", f"{world['adapter'].name}@1")]
        assert str(world["b"].id) in rows

    csv_resp = api.get("/api/finance/report.csv", params=params, headers=h["finance"])
    assert csv_resp.status_code == 200
    assert csv_resp.headers["content-type"].startswith("text/csv")
    assert csv_resp.headers["content-disposition"] == (
        f'attachment; filename="mplex-cost-report_{params["from"]}_{params["to"]}.csv"')
    table = list(csv.DictReader(io.StringIO(csv_resp.text)))
    a_row = next(r for r in table if r["level"] == "tenant" and r["tenant_id"] == str(world["a"].id))
    assert a_row["billed_microusd"] == "206500"

    # The endpoint serves exactly the bytes the CLI would write for the same period.
    config = BillingConfig.from_settings(settings)
    db.rollback()
    rep = build_report(db, config, day_from=date.fromisoformat(params["from"]), day_to=date.fromisoformat(params["to"]))
    assert csv_resp.content == report_csv(rep)
    assert api.get("/api/finance/report", params=params, headers=h["finance"]).content == report_json_bytes(rep)

    bad = api.get("/api/finance/report", params={"from": "2024-05-02", "to": "2024-05-01"}, headers=h["finance"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "to"
    edge = api.get("/api/finance/report.csv", params={"from": "9999-12-31", "to": "9999-12-31"}, headers=h["finance"])
    assert edge.status_code == 400 and edge.json()["error"]["param"] == "from"
