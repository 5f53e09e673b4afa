"""The tenant pages' API on the real gateway: own tenant, API keys (create, list, revoke — revocation is
immediate on /v1/models), adapters; role checks and the audit trail."""
from __future__ import annotations

import uuid

from sqlalchemy import select

from services.common.keys import SCOPE_INFERENCE, SCOPE_USAGE_READ, hash_secret, parse_key
from services.common.models import AdapterStatus, ApiKey, AuditLog, GateDecision, EvalRun, Role
from tests.factories import make_adapter, make_adapter_version, make_api_key, make_tenant, make_user
from tests.gateway.mgmt_harness import browser, gateway, v1_models, world  # noqa: F401 (fixtures)


def test_own_tenant_with_limits(browser, world):
    body = browser(world.a.member.email).get("/api/tenant").json()
    t = world.a.tenant
    assert body == {"id": str(t.id), "name": t.name, "slug": t.slug, "plan": "default", "status": "active",
                    "limits": {"tokens_per_min": 100_000, "requests_per_min": None, "concurrent_requests": None,
                               "monthly_token_budget": None}}


def test_tenant_without_a_limits_row_is_unlimited(browser, db):
    tenant = make_tenant(db)
    body = browser(make_user(db, tenant=tenant).email).get("/api/tenant").json()
    assert set(body["limits"].values()) == {None}


def test_key_lifecycle_create_list_use_revoke(gateway, browser, world, db, redis_client):
    api = browser(world.a.admin.email)
    r = api.post("/api/tenant/keys", json={"name": "  production  "})
    assert r.status_code == 201, r.text
    created = r.json()
    assert set(created) == {"id", "name", "prefix", "key", "created_at"}
    assert created["name"] == "production"
    parsed = parse_key(created["key"])
    assert parsed.prefix == created["prefix"]
    row = db.get(ApiKey, uuid.UUID(created["id"]))
    assert row.tenant_id == world.a.tenant.id and row.key_hash == hash_secret(created["key"])
    assert row.scopes == [SCOPE_INFERENCE] and row.created_by == world.a.admin.id

    # The new key works on the OpenAI API, and the secret is never shown again.
    assert v1_models(gateway, created["key"]).status_code == 200
    listing = api.get("/api/tenant/keys")
    assert listing.status_code == 200 and created["key"] not in listing.text
    mine = next(k for k in listing.json()["data"] if k["id"] == created["id"])
    assert mine == {"id": created["id"], "name": "production", "prefix": created["prefix"], "scopes": [SCOPE_INFERENCE],
                    "created_at": mine["created_at"], "last_used_at": mine["last_used_at"], "revoked_at": None,
                    "expires_at": None}
    assert listing.json()["data"][0]["id"] == created["id"]  # newest first

    # Revocation is immediate on this gateway although the key cache TTL is minutes long.
    assert redis_client.get(f"kc:{row.key_hash}") is not None
    assert api.delete(f"/api/tenant/keys/{created['id']}").status_code == 204
    r = v1_models(gateway, created["key"])
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    revoked = next(k for k in api.get("/api/tenant/keys").json()["data"] if k["id"] == created["id"])
    assert revoked["revoked_at"] is not None
    # Revoking again is a no-op that keeps the first revocation time.
    assert api.delete(f"/api/tenant/keys/{created['id']}").status_code == 204
    again = next(k for k in api.get("/api/tenant/keys").json()["data"] if k["id"] == created["id"])
    assert again["revoked_at"] == revoked["revoked_at"]

    audit = db.scalars(select(AuditLog).where(AuditLog.target_id == created["id"]).order_by(AuditLog.id)).all()
    assert [a.action for a in audit] == ["key.create", "key.revoke"]
    for a in audit:
        assert a.actor_user_id == world.a.admin.id and a.tenant_id == world.a.tenant.id
        assert a.request_id.startswith("req_") and a.ip == "127.0.0.1"
        assert created["key"] not in str(a.details) and row.key_hash not in str(a.details)


def test_last_used_is_recorded(gateway, browser, db, world):
    key = make_api_key(db, tenant=world.a.tenant)
    assert v1_models(gateway, key.secret).status_code == 200
    api = browser(world.a.member.email)
    import time

    deadline = time.monotonic() + 20  # written off the request path, shortly after
    while time.monotonic() < deadline:
        row = next(k for k in api.get("/api/tenant/keys").json()["data"] if k["id"] == str(key.row.id))
        if row["last_used_at"] is not None:
            break
        time.sleep(0.2)
    assert row["last_used_at"] is not None


def test_key_scopes_are_validated(browser, world, db):
    api = browser(world.a.admin.email)
    r = api.post("/api/tenant/keys", json={"name": "reporting", "scopes": [SCOPE_USAGE_READ]})
    assert r.status_code == 201
    assert db.get(ApiKey, uuid.UUID(r.json()["id"])).scopes == [SCOPE_USAGE_READ]
    for bad in ([], ["admin"], ["inference", "root"]):
        r = api.post("/api/tenant/keys", json={"name": "x", "scopes": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "scopes", (bad, r.text)
    for bad_name in ("", "   ", "x" * 201, "tab\there"):
        assert api.post("/api/tenant/keys", json={"name": bad_name}).status_code == 400, bad_name


def test_body_ids_never_widen_the_tenant(browser, world, db):
    """A tenant_id (or any other id) in the body is ignored: the key lands in the caller's tenant."""
    api = browser(world.a.admin.email)
    r = api.post("/api/tenant/keys", json={"name": "sneaky", "tenant_id": str(world.b.tenant.id),
                                           "tenant": world.b.tenant.slug})
    assert r.status_code == 201
    assert db.get(ApiKey, uuid.UUID(r.json()["id"])).tenant_id == world.a.tenant.id


def test_member_reads_but_cannot_manage_keys(gateway, browser, world, db):
    key = make_api_key(db, tenant=world.a.tenant)
    api = browser(world.a.member.email)
    assert api.get("/api/tenant/keys").status_code == 200
    r = api.post("/api/tenant/keys", json={"name": "mine"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "role_required"
    assert api.delete(f"/api/tenant/keys/{key.row.id}").status_code == 403
    assert v1_models(gateway, key.secret).status_code == 200


def test_platform_roles_have_no_tenant_pages(browser, world):
    for user in (world.finance, world.platform_admin):
        api = browser(user.email)
        for path in ("/api/tenant", "/api/tenant/keys", "/api/tenant/adapters",
                     f"/api/tenant/adapter-versions/{world.a.v1.id}"):
            r = api.get(path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "role_required", (user.role, path)


def test_revoking_a_missing_key_is_404(browser, world):
    api = browser(world.a.admin.email)
    r = api.delete(f"/api/tenant/keys/{uuid.uuid4()}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert api.delete("/api/tenant/keys/not-a-uuid").status_code == 400


def test_too_many_live_keys_is_a_conflict(browser, db, monkeypatch):
    from services.gateway import crud

    tenant = make_tenant(db)
    for _ in range(3):
        make_api_key(db, tenant=tenant)
    make_api_key(db, tenant=tenant, revoked=True)  # revoked keys do not count
    api = browser(make_user(db, tenant=tenant, role=Role.TENANT_ADMIN).email)
    # The limit is read per call, so lowering it in this process bounds the gateway thread too.
    monkeypatch.setattr(crud, "MAX_LIVE_KEYS_PER_TENANT", 4)
    assert api.post("/api/tenant/keys", json={"name": "fourth"}).status_code == 201
    r = api.post("/api/tenant/keys", json={"name": "fifth"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_keys"


def test_adapters_list_versions_status_and_gate_results(browser, db):
    tenant = make_tenant(db)
    adapter = make_adapter(db, tenant=tenant, name="support-bot")
    v1 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.READY, rank=8, activate=True)
    v2 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.REJECTED, rank=16)
    v2.status_reasons = [{"code": "margin_below_threshold", "message": "no better than the base model"}]
    v2.gate_config = {"min_margin": 0.05}
    v2.progress_percent, v2.progress_step = 100, "done"
    db.add(EvalRun(adapter_version_id=v2.id, attempt=1, status="finished", decision=GateDecision.FAIL,
                   metrics={"margin": 0.01}, examples=[{"prompt": "hi", "adapter": "a", "base": "b"}],
                   reasons=[{"code": "margin_below_threshold", "passed": False}, {"code": "fp8_agreement_ok", "passed": True}],
                   finished_at=v2.created_at))
    v3 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.EVALUATING)
    v3.progress_percent, v3.progress_step = 40, "evaluating"
    gone = make_adapter(db, tenant=tenant, name="deleted-one")
    gone_v = make_adapter_version(db, adapter=gone, status=AdapterStatus.READY, activate=True)
    from datetime import datetime, timezone

    gone.deleted_at = datetime.now(timezone.utc)
    db.commit()

    api = browser(make_user(db, tenant=tenant).email)
    data = api.get("/api/tenant/adapters").json()["data"]
    assert [a["name"] for a in data] == ["support-bot"]  # deleted adapters are gone
    a = data[0]
    assert a["id"] == str(adapter.id) and a["active_version"] == 1
    assert [v["version"] for v in a["versions"]] == [1, 2, 3]
    assert [v["status"] for v in a["versions"]] == ["ready", "rejected", "evaluating"]
    rejected = a["versions"][1]
    assert rejected["reasons"] == [{"code": "margin_below_threshold", "message": "no better than the base model"}]
    assert rejected["eval"] == {"passed": False, "metrics": {"margin": 0.01}, "thresholds": {"min_margin": 0.05},
                                "examples": [{"prompt": "hi", "adapter": "a", "base": "b"}],
                                # every check of the gate, the passed ones too (the version's reasons: only refusals)
                                "reasons": [{"code": "margin_below_threshold", "passed": False},
                                            {"code": "fp8_agreement_ok", "passed": True}]}
    assert rejected["rank"] == 16 and rejected["content_sha256"] == v2.content_sha256
    assert rejected["override"] is None and rejected["ready_at"] is None
    assert a["versions"][2]["progress"] == {"percent": 40, "step": "evaluating"} and a["versions"][2]["eval"] is None
    assert a["versions"][0]["ready_at"] is not None

    one = api.get(f"/api/tenant/adapter-versions/{v2.id}")
    assert one.status_code == 200 and one.json() == rejected
    assert api.get(f"/api/tenant/adapter-versions/{gone_v.id}").status_code == 404
    assert api.get(f"/api/tenant/adapter-versions/{v1.id}").json()["adapter_name"] == "support-bot"


def test_suspended_tenant_users_still_see_their_pages(browser, db):
    from services.common.models import TenantStatus

    tenant = make_tenant(db, status=TenantStatus.SUSPENDED)
    body = browser(make_user(db, tenant=tenant).email).get("/api/tenant").json()
    assert body["status"] == "suspended"
