"""The platform admin's API and the `mplex admin` CLI on the real gateway: tenants (create, suspend, limits —
effective at once on the request path), users, engines, gate overrides, rollback, delete, audit rows,
and the demo seed."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import orjson
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from services.common.keys import parse_key
from services.common.passwords import hash_password
from services.common.models import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    ApiKey,
    AuditLog,
    Role,
    Tenant,
    TenantLimits,
    User,
)
from services.common.engine_registry import REGISTRY_SET, entry_key
from services.gateway.crud import NEW_TENANT_LIMITS
from tests.factories import (
    make_adapter,
    make_adapter_version,
    make_api_key,
    make_tenant,
    make_usage_event,
    make_user,
    unique,
)
from tests.gateway.mgmt_harness import bearer, browser, gateway, v1_models, world  # noqa: F401 (fixtures)
from tests.stack import ROOT


@pytest.fixture
def admin(browser, world):
    return browser(world.platform_admin.email)


def _audit(db, **where) -> list[AuditLog]:
    q = select(AuditLog).order_by(AuditLog.id)
    for k, v in where.items():
        q = q.where(getattr(AuditLog, k) == v)
    return list(db.scalars(q))


def _wait_for(predicate, what: str, timeout: float = 10.0):
    """Poll until `predicate()` is truthy (for effects bounded by a cache far shorter than `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.1)


# -- tenants --------------------------------------------------------------------------------------------------
def test_tenant_list_counts_this_months_tokens(admin, db):
    tenant = make_tenant(db, limits={"monthly_token_budget": 1_000_000})
    make_usage_event(db, tenant=tenant, prompt_tokens=100, completion_tokens=20)
    make_usage_event(db, tenant=tenant, prompt_tokens=7, completion_tokens=3)
    first_of_month = datetime.now(timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    make_usage_event(db, tenant=tenant, prompt_tokens=5000, completion_tokens=5000,
                     created_at=first_of_month - timedelta(seconds=1))  # last month: not counted
    idle = make_tenant(db)
    data = {t["id"]: t for t in admin.get("/api/admin/tenants").json()["data"]}
    assert data[str(tenant.id)]["usage_this_month_tokens"] == 130
    assert data[str(tenant.id)]["limits"]["monthly_token_budget"] == 1_000_000
    assert data[str(idle.id)]["usage_this_month_tokens"] == 0
    assert set(data[str(idle.id)]) == {"id", "name", "slug", "plan", "status", "limits", "usage_this_month_tokens",
                                       "billed_this_month_microusd", "user_count"}
    assert (data[str(idle.id)]["billed_this_month_microusd"], data[str(idle.id)]["user_count"]) == (0, 0)


def test_create_tenant_then_its_users_sign_in(admin, browser, world, db):
    slug = unique("acme")
    r = admin.post("/api/admin/tenants", json={"name": "Acme", "slug": slug, "plan": "pro",
                                               "limits": {"tokens_per_min": 5000, "concurrent_requests": 4}})
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["slug"] == slug and t["plan"] == "pro" and t["status"] == "active"
    assert t["limits"] == {**NEW_TENANT_LIMITS, "tokens_per_min": 5000, "concurrent_requests": 4}  # the rest: defaults
    tid = uuid.UUID(t["id"])
    [created] = _audit(db, tenant_id=tid, action="tenant.create")
    assert created.actor_user_id == world.platform_admin.id and created.details["slug"] == slug

    r = admin.post(f"/api/admin/tenants/{tid}/users",
                   json={"email": "Owner@Acme.Example", "password": "a long enough secret", "role": "tenant_admin"})
    assert r.status_code == 201, r.text
    assert r.json() == {"id": r.json()["id"], "email": "owner@acme.example", "role": "tenant_admin",
                        "tenant_id": str(tid), "tenant_name": "Acme"}
    [made] = _audit(db, tenant_id=tid, action="user.create")
    assert "a long enough secret" not in json.dumps(made.details)
    me = browser("owner@acme.example", "a long enough secret").get("/api/tenant").json()
    assert me["id"] == str(tid)

    again = admin.post(f"/api/admin/tenants/{tid}/users",
                       json={"email": "owner@acme.example", "password": "a long enough secret", "role": "tenant_member"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "email_taken"
    weak = admin.post(f"/api/admin/tenants/{tid}/users", json={"email": "x@acme.example", "password": "short", "role": "tenant_member"})
    assert weak.status_code == 400 and weak.json()["error"]["param"] == "password"
    platform = admin.post(f"/api/admin/tenants/{tid}/users",
                          json={"email": "y@acme.example", "password": "a long enough secret", "role": "platform_admin"})
    assert platform.status_code == 400
    missing = admin.post(f"/api/admin/tenants/{uuid.uuid4()}/users",
                         json={"email": "z@acme.example", "password": "a long enough secret", "role": "tenant_member"})
    assert missing.status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"name": "X", "slug": "Bad Slug"}, "slug"),
    ({"name": "X", "slug": "-leading"}, "slug"),
    ({"name": "X", "slug": "trailing-newline\n"}, "slug"),
    ({"name": "", "slug": "fine-slug"}, "name"),
    ({"name": "X", "slug": "fine-slug", "limits": {"tokens_per_min": -1}}, "limits.tokens_per_min"),
    ({"name": "X", "slug": "fine-slug", "limits": {"requests_per_min": 2**31}}, "limits.requests_per_min"),
    ({"name": "X", "slug": "fine-slug", "limits": {"bogus": 1}}, "limits.bogus"),
])
def test_create_tenant_validation(admin, body, param):
    r = admin.post("/api/admin/tenants", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_new_tenant_without_limits_gets_finite_defaults(admin, db):
    r = admin.post("/api/admin/tenants", json={"name": "Quiet", "slug": unique("quiet")})
    assert r.status_code == 201, r.text
    assert r.json()["limits"] == NEW_TENANT_LIMITS
    assert all(v is not None and v > 0 for v in NEW_TENANT_LIMITS.values())
    row = db.get(TenantLimits, uuid.UUID(r.json()["id"]))  # stored, so the request path and the admin see the same
    assert (row.tokens_per_min, row.requests_per_min, row.concurrent_requests, row.monthly_token_budget) == tuple(
        NEW_TENANT_LIMITS.values())
    [created] = _audit(db, tenant_id=row.tenant_id, action="tenant.create")
    assert created.details["limits"] == NEW_TENANT_LIMITS


def test_an_admin_can_still_create_a_tenant_with_a_window_unlimited(admin):
    r = admin.post("/api/admin/tenants", json={"name": "Big", "slug": unique("big"),
                                               "limits": {"monthly_token_budget": None, "requests_per_min": 0}})
    assert r.status_code == 201, r.text
    assert r.json()["limits"] == {**NEW_TENANT_LIMITS, "monthly_token_budget": None, "requests_per_min": 0}


def test_duplicate_slug_is_a_conflict(admin, world):
    r = admin.post("/api/admin/tenants", json={"name": "Copy", "slug": world.a.tenant.slug})
    assert r.status_code == 409 and r.json()["error"]["code"] == "slug_taken"


def test_patch_changes_only_what_is_given(admin, db):
    tenant = make_tenant(db, limits={"tokens_per_min": 1000, "requests_per_min": 10})
    r = admin.patch(f"/api/admin/tenants/{tenant.id}", json={"limits": {"requests_per_min": None, "concurrent_requests": 3}})
    assert r.status_code == 200, r.text
    assert r.json()["limits"] == {"tokens_per_min": 1000, "requests_per_min": None, "concurrent_requests": 3,
                                  "monthly_token_budget": None}
    r = admin.patch(f"/api/admin/tenants/{tenant.id}", json={"name": "Renamed", "plan": "enterprise"})
    assert (r.json()["name"], r.json()["plan"], r.json()["limits"]["tokens_per_min"]) == ("Renamed", "enterprise", 1000)
    actions = [a.action for a in _audit(db, tenant_id=tenant.id)]
    assert actions == ["tenant.limits", "tenant.update"]
    limits_row = _audit(db, tenant_id=tenant.id, action="tenant.limits")[0]
    assert limits_row.details["before"]["requests_per_min"] == 10 and limits_row.details["after"]["requests_per_min"] is None
    assert admin.patch(f"/api/admin/tenants/{tenant.id}", json={"status": "deleted"}).status_code == 400
    assert admin.patch(f"/api/admin/tenants/{uuid.uuid4()}", json={"plan": "x"}).status_code == 404


def test_suspension_and_activation_apply_to_keys_at_once(gateway, admin, db):
    tenant = make_tenant(db)
    key = make_api_key(db, tenant=tenant)
    assert v1_models(gateway, key.secret).status_code == 200  # now cached for minutes (KEY_CACHE_TTL_S)
    r = admin.patch(f"/api/admin/tenants/{tenant.id}", json={"status": "suspended"})
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    refused = v1_models(gateway, key.secret)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "tenant_suspended"
    assert admin.patch(f"/api/admin/tenants/{tenant.id}", json={"status": "active"}).status_code == 200
    assert v1_models(gateway, key.secret).status_code == 200
    assert [a.action for a in _audit(db, tenant_id=tenant.id)] == ["tenant.suspend", "tenant.activate"]


def test_new_limits_replace_the_cached_ones(gateway, admin, db, redis_client):
    tenant = make_tenant(db, limits={"tokens_per_min": 1000})
    key = make_api_key(db, tenant=tenant)
    assert v1_models(gateway, key.secret).status_code == 200
    entry = f"kc:{key.row.key_hash}"
    assert orjson.loads(redis_client.get(entry))["tenant_limits"]["tokens_per_min"] == 1000
    assert admin.patch(f"/api/admin/tenants/{tenant.id}", json={"limits": {"tokens_per_min": 50}}).status_code == 200
    assert redis_client.get(entry) is None
    assert v1_models(gateway, key.secret).status_code == 200
    assert orjson.loads(redis_client.get(entry))["tenant_limits"]["tokens_per_min"] == 50


# -- engines --------------------------------------------------------------------------------------------------
def test_engines_come_from_the_live_registry(admin, redis_client):
    now = time.time()
    engines = {
        unique("eng"): {"url": "http://10.0.0.1:9000", "running": 3, "waiting": 1, "kv_usage": 0.25,
                        "slot_adapters": ["a" * 64], "host_adapters": ["a" * 64, "b" * 64]},
        unique("eng"): {"url": "http://10.0.0.2:9000", "running": 0, "waiting": 0, "kv_usage": 0.0,
                        "slot_adapters": [], "host_adapters": []},
    }
    gone = unique("eng")  # in the set, but its entry expired: a dead engine
    for eid, snap in engines.items():
        redis_client.set(entry_key(eid), json.dumps({"id": eid, "base_model": "mplex-demo", "max_num_seqs": 64,
                                                     "max_model_len": 512, "ts": now, **snap}), ex=30)
    redis_client.sadd(REGISTRY_SET, *engines, gone)
    try:
        data = {e["id"]: e for e in admin.get("/api/admin/engines").json()["data"]}
        assert gone not in data
        for eid, snap in engines.items():
            e = data[eid]
            assert {k: e[k] for k in snap} == snap
            assert e["base_model"] == "mplex-demo"
            assert abs(datetime.fromisoformat(e["updated_at"]).timestamp() - now) < 1e-3
    finally:
        redis_client.srem(REGISTRY_SET, *engines, gone)
        redis_client.delete(*(entry_key(e) for e in engines))


# -- adapters -------------------------------------------------------------------------------------------------
@pytest.fixture
def adapter_family(db):
    """v1 ready (active), v2 rejected by the gate, v3 still evaluating."""
    tenant = make_tenant(db)
    adapter = make_adapter(db, tenant=tenant)
    v1 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.READY, activate=True)
    v2 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.REJECTED)
    v2.status_reasons = [{"code": "margin_below_threshold", "message": "worse than base"}]
    db.commit()
    v3 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.EVALUATING)
    key = make_api_key(db, tenant=tenant)
    return tenant, adapter, v1, v2, v3, key


def _model_ids(gateway, key) -> set[str]:
    return {m["id"] for m in v1_models(gateway, key.secret).json()["data"]}


def test_override_to_ready_records_why_and_moves_the_active_version(gateway, admin, browser, world, adapter_family, db):
    tenant, adapter, v1, v2, v3, key = adapter_family
    r = admin.post(f"/api/admin/adapter-versions/{v2.id}/override",
                   json={"decision": "ready", "reason": "  gate eval set was stale  "})
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["status"] == "ready" and v["ready_at"] is not None
    assert v["override"]["by"] == world.platform_admin.email and v["override"]["reason"] == "gate eval set was stale"
    db.expire_all()
    assert db.get(Adapter, adapter.id).active_version_id == v2.id  # newer than v1
    assert admin.get(f"/api/admin/adapter-versions/{v2.id}").json() == v
    # The tenant sees the override but not who made it.
    member = browser(make_user(db, tenant=tenant).email)
    assert member.get(f"/api/tenant/adapter-versions/{v2.id}").json()["override"]["by"] == "platform admin"
    [row] = _audit(db, action="adapter.override", target_id=str(v2.id))
    assert row.actor_user_id == world.platform_admin.id and row.tenant_id == tenant.id
    assert row.details["before"] == "rejected" and row.details["after"] == "ready"
    assert row.details["reason"] == "gate eval set was stale"
    assert row.details["active_version"] == {"before": 1, "after": 2}


def test_override_to_rejected_of_the_active_version_falls_back(gateway, admin, adapter_family, db):
    tenant, adapter, v1, v2, v3, key = adapter_family
    assert adapter.name in _model_ids(gateway, key)
    r = admin.post(f"/api/admin/adapter-versions/{v1.id}/override", json={"decision": "rejected", "reason": "leaks PII"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "rejected"
    assert {"code": "admin_override", "message": "leaks PII"} in r.json()["reasons"]
    db.expire_all()
    assert db.get(Adapter, adapter.id).active_version_id is None  # no other ready version
    assert adapter.name not in _model_ids(gateway, key)


@pytest.mark.parametrize("body, status, code", [
    ({"decision": "ready", "reason": ""}, 400, None),
    ({"decision": "ready"}, 400, None),
    ({"decision": "evaluating", "reason": "x"}, 400, None),
    ({"decision": "ready", "reason": "x" * 2001}, 400, None),
])
def test_override_validation(admin, adapter_family, body, status, code):
    v2 = adapter_family[3]
    r = admin.post(f"/api/admin/adapter-versions/{v2.id}/override", json=body)
    assert r.status_code == status, r.text


def test_override_conflicts(admin, adapter_family, db):
    _, _, v1, _, v3, _ = adapter_family
    r = admin.post(f"/api/admin/adapter-versions/{v3.id}/override", json={"decision": "ready", "reason": "ship it"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_not_final"
    r = admin.post(f"/api/admin/adapter-versions/{v1.id}/override", json={"decision": "ready", "reason": "again"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_in_state"
    assert admin.post(f"/api/admin/adapter-versions/{uuid.uuid4()}/override",
                      json={"decision": "ready", "reason": "x"}).status_code == 404
    db.expire_all()
    assert db.get(AdapterVersion, v3.id).status == AdapterStatus.EVALUATING


def test_rollback_moves_the_pointer_to_a_ready_version_only(admin, adapter_family, db, world):
    tenant, adapter, v1, v2, v3, key = adapter_family
    make_adapter_version(db, adapter=adapter, status=AdapterStatus.READY, activate=True)  # v4
    r = admin.post(f"/api/admin/adapters/{adapter.id}/rollback", json={"version": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == str(adapter.id) and body["name"] == adapter.name and body["active_version"] == 1
    assert [v["version"] for v in body["versions"]] == [1, 2, 3, 4]
    db.expire_all()
    assert db.get(Adapter, adapter.id).active_version_id == v1.id
    for version, status, code in [(2, 409, "version_not_ready"), (3, 409, "version_not_ready"), (9, 404, "not_found")]:
        r = admin.post(f"/api/admin/adapters/{adapter.id}/rollback", json={"version": version})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), version
    assert admin.post(f"/api/admin/adapters/{adapter.id}/rollback", json={"version": 0}).status_code == 400
    assert admin.post(f"/api/admin/adapters/{adapter.id}/rollback", json={"version": 4}).json()["active_version"] == 4
    rows = _audit(db, action="adapter.rollback", target_id=str(adapter.id))
    assert [(r.details["before"], r.details["after"]) for r in rows] == [(4, 1), (1, 4)]
    assert all(r.actor_user_id == world.platform_admin.id for r in rows)


def test_delete_stops_routing_at_once(gateway, admin, adapter_family, db):
    tenant, adapter, v1, v2, v3, key = adapter_family

    def complete() -> httpx.Response:
        return httpx.post(f"{gateway.url}/v1/completions", headers=bearer(key.secret), timeout=30,
                          json={"model": adapter.name, "prompt": "hello world", "max_tokens": 2})

    before = complete()  # resolves (and caches the resolution); no engine runs in this test
    assert before.status_code == 503 and before.json()["error"]["code"] == "no_engine_available"
    assert admin.delete(f"/api/admin/adapters/{adapter.id}").status_code == 204
    after = complete()
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    assert adapter.name not in _model_ids(gateway, key)
    db.expire_all()
    assert db.get(Adapter, adapter.id).deleted_at is not None
    # Versions stay readable for admins (billing, forensics); the adapter itself is gone.
    assert admin.get(f"/api/admin/adapter-versions/{v1.id}").status_code == 200
    assert admin.delete(f"/api/admin/adapters/{adapter.id}").status_code == 404
    assert admin.post(f"/api/admin/adapters/{adapter.id}/rollback", json={"version": 1}).status_code == 404
    [row] = _audit(db, action="adapter.delete", target_id=str(adapter.id))
    assert row.tenant_id == tenant.id
    # The name is free again for a new adapter.
    assert make_adapter(db, tenant=tenant, name=adapter.name).id != adapter.id


def test_tenant_users_cannot_reach_admin_routes(browser, world, adapter_family):
    _, adapter, v1, _, _, _ = adapter_family
    for email in (world.a.admin.email, world.a.member.email, world.finance.email):
        api = browser(email)
        for method, path, body in [
            ("GET", "/api/admin/tenants", None), ("POST", "/api/admin/tenants", {"name": "x", "slug": "xx-x"}),
            ("PATCH", f"/api/admin/tenants/{world.a.tenant.id}", {"status": "suspended"}),
            ("POST", f"/api/admin/adapter-versions/{v1.id}/override", {"decision": "rejected", "reason": "x"}),
            ("DELETE", f"/api/admin/adapters/{adapter.id}", None), ("GET", "/api/admin/engines", None),
        ]:
            r = api.request(method, path, json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "role_required", (email, method, path)


# -- the CLI --------------------------------------------------------------------------------------------------
@pytest.fixture
def cli(settings):
    """`mplex ...` in this process (the settings fixture points it at the test database and Redis)."""
    from services.cli import app

    runner = CliRunner()

    def run(*args: str, ok: bool = True, input: str | None = None):
        result = runner.invoke(app, list(args), input=input)
        if ok:
            assert result.exit_code == 0, f"mplex {' '.join(args)} -> {result.exit_code}\n{result.output}"
        return result

    return run


def test_cli_tenant_lifecycle(cli, db, gateway):
    slug = unique("cli")
    out = json.loads(cli("admin", "tenant", "create", slug, "--name", "CLI Co", "--tokens-per-min", "1_000",
                         "--monthly-tokens", "none", "--json").stdout)
    assert out["slug"] == slug and out["limits"]["tokens_per_min"] == 1000
    tid = uuid.UUID(out["id"])
    assert cli("admin", "tenant", "create", slug, ok=False).exit_code == 1  # slug taken

    listed = {t["slug"]: t for t in json.loads(cli("admin", "tenant", "list", "--json").stdout)}
    assert listed[slug]["status"] == "active" and listed[slug]["usage_this_month_tokens"] == 0

    limits = json.loads(cli("admin", "tenant", "limits", slug, "--concurrent", "2", "--tokens-per-min", "unlimited",
                            "--json").stdout)
    assert limits == {"tokens_per_min": None, "requests_per_min": NEW_TENANT_LIMITS["requests_per_min"],
                      "concurrent_requests": 2, "monthly_token_budget": None}
    assert db.get(TenantLimits, tid).concurrent_requests == 2
    assert cli("admin", "tenant", "limits", slug, "--concurrent", "lots", ok=False).exit_code == 1

    key = json.loads(cli("admin", "key", "create", "--tenant", slug, "--name", "ci", "--json").stdout)
    parse_key(key["key"])
    assert v1_models(gateway, key["key"]).status_code == 200  # cached by the gateway from here on
    cli("admin", "tenant", "suspend", str(tid))
    # Dropped from Redis by the CLI; the gateway's in-process copy lasts about a second (KeyAuth.LOCAL_TTL_S),
    # far less than the key-cache TTL these tests run with.
    _wait_for(lambda: v1_models(gateway, key["key"]).status_code == 403, "suspension to reach the gateway")
    cli("admin", "tenant", "activate", slug)
    _wait_for(lambda: v1_models(gateway, key["key"]).status_code == 200, "activation to reach the gateway")

    db.expire_all()
    rows = _audit(db, tenant_id=tid)
    assert [r.action for r in rows] == ["tenant.create", "tenant.limits", "key.create", "tenant.suspend", "tenant.activate"]
    assert all(r.actor_user_id is None and r.details["via"] == "cli" for r in rows)


def test_cli_create_without_limits_gets_the_defaults(cli, db):
    out = json.loads(cli("admin", "tenant", "create", unique("cli-plain"), "--concurrent", "none", "--json").stdout)
    assert out["limits"] == {**NEW_TENANT_LIMITS, "concurrent_requests": None}  # 'none' still means unlimited
    assert db.get(TenantLimits, uuid.UUID(out["id"])).tokens_per_min == NEW_TENANT_LIMITS["tokens_per_min"]


def test_cli_users_and_keys(cli, db, gateway, browser):
    tenant = make_tenant(db)
    email = f"{unique('ops')}@example.test"
    cli("admin", "user", "create", email, "--role", "tenant_admin", "--tenant", tenant.slug,
        input="cli password 123\ncli password 123\n")
    assert browser(email, "cli password 123").get("/api/tenant").json()["id"] == str(tenant.id)
    assert cli("admin", "user", "create", f"x{email}", "--role", "tenant_admin", "--password", "cli password 123",
               ok=False).exit_code == 1  # a tenant role needs --tenant
    pa = f"{unique('root')}@example.test"
    cli("admin", "user", "create", pa, "--role", "platform_admin", "--password", "platform password 1")
    assert db.scalar(select(User).where(User.email == pa)).tenant_id is None

    full = cli("admin", "key", "create", "--tenant", str(tenant.id), "--name", "batch",
               "--scope", "inference", "--scope", "usage:read").stdout.strip()
    prefix = parse_key(full).prefix
    listed = json.loads(cli("admin", "key", "list", "--tenant", tenant.slug, "--json").stdout)
    assert [(k["prefix"], k["scopes"], k["revoked_at"]) for k in listed] == [(prefix, ["inference", "usage:read"], None)]
    assert full not in cli("admin", "key", "list", "--tenant", tenant.slug).stdout

    assert v1_models(gateway, full).status_code == 200
    cli("admin", "key", "revoke", f"mpx_{prefix}_")
    _wait_for(lambda: v1_models(gateway, full).status_code == 401, "revocation to reach the gateway")
    db.expire_all()
    assert db.scalar(select(ApiKey).where(ApiKey.prefix == prefix)).revoked_at is not None
    assert cli("admin", "key", "revoke", str(uuid.uuid4()), ok=False).exit_code == 1
    assert cli("admin", "key", "list", "--tenant", "no-such-tenant", ok=False).exit_code == 1


def test_cli_is_registered_in_the_mplex_command(stack_env):
    import os

    env = {**os.environ, **stack_env}
    r = subprocess.run([sys.executable, "-m", "services.cli", "admin", "tenant", "list", "--json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), list)


def test_seed_demo_is_idempotent_and_its_sign_ins_work(cli, db, gateway, browser):
    from services.gateway.seed import DEMO_SLUG, DEMO_USERS

    first = json.loads(cli("admin", "seed-demo").stdout)
    second = json.loads(cli("admin", "seed-demo", "--existing-key", first["api_key"]).stdout)
    assert second == first  # nothing new: same tenant, same users, the same key still valid
    third = json.loads(cli("admin", "seed-demo").stdout)
    assert third["api_key"] != first["api_key"]  # a secret cannot be read back: without it, a fresh key

    tenant = db.scalar(select(Tenant).where(Tenant.slug == DEMO_SLUG))
    assert str(tenant.id) == first["tenant_id"]
    row = db.get(TenantLimits, tenant.id)
    assert None not in (row.tokens_per_min, row.requests_per_min, row.concurrent_requests, row.monthly_token_budget)
    for u in DEMO_USERS:
        assert db.scalar(select(User).where(User.email == u.email)).role == u.role
        me = browser(u.email, u.password).get("/api/auth/me").json()["user"]
        assert me["role"] == str(u.role)
        assert (me["tenant_id"] == str(tenant.id)) == u.role.is_tenant_role
    for k in (first["api_key"], third["api_key"]):
        assert v1_models(gateway, k).status_code == 200
    # A developer's changed password is put back so the documented sign-in keeps working.
    demo_admin = db.scalar(select(User).where(User.email == DEMO_USERS[0].email))
    demo_admin.password_hash = hash_password("changed by a developer")
    db.commit()
    cli("admin", "seed-demo", "--existing-key", first["api_key"])
    assert browser().login(DEMO_USERS[0].email, DEMO_USERS[0].password).status_code == 200
    assert db.scalars(select(User).where(User.role == Role.PLATFORM_ADMIN, User.email == DEMO_USERS[2].email)).all()


def test_seed_demo_refuses_prod(cli, monkeypatch, settings):
    prod = settings.model_copy(update={"env": "prod"})
    monkeypatch.setattr("services.common.settings.get_settings", lambda: prod)
    r = cli("admin", "seed-demo", ok=False)
    assert r.exit_code == 1 and "prod" in r.output


# -- fuzzing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["platform_admin", "tenant_admin"])
def test_signed_in_fuzzing_finds_no_server_errors(gateway, browser, world, role):
    """Schemathesis from the gateway's own OpenAPI schema, signed in (the repo-wide fuzz test sends only an
    API key, which stops every management call at 401): whatever the bodies and ids, no 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings

    api = browser(world.email(role))
    cookies, headers = dict(api.http.cookies), {"x-csrf-token": api.csrf}
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path.startswith(("/api/auth", "/api/tenant", "/api/admin"))
           and op.path != "/api/auth/logout"]  # signing out would end the fuzzing session
    assert len(ops) >= 15
    calls = 0
    for op in ops:

        @given(case=op.as_strategy())
        @hsettings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            nonlocal calls
            calls += 1
            r = case.call(headers=headers, cookies=cookies, timeout=60)
            assert r.status_code < 500, f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:300]}"

        check()
    assert calls >= len(ops) * 5
    # The session survived the fuzzing (nothing it sent could sign it out or break it).
    assert api.get("/api/auth/me").status_code == 200
