"""The management API the web app's newer pages use, on the real gateway: the playground's temporary key (works
on /v1 at once, inference only, throttled, replaced on the next mint and revoked at sign-out), a tenant's users,
one adapter with its tenant and active version, versions that say whether they are active, and the engine fleet
with adapters named, health and a short history."""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta

import pytest
from sqlalchemy import select

from services.common.keys import SCOPE_INFERENCE
from services.common.models import ApiKey, AuditLog
from services.common.engine_registry import REGISTRY_SET, entry_key, history_key
from services.gateway.crud import PLAYGROUND_KEY_LIMITS, PLAYGROUND_KEY_TTL
from tests.gateway.mgmt_harness import browser, gateway, v1_models, world  # noqa: F401 (fixtures)


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_playground_key_is_temporary_inference_only_and_one_per_user(gateway, browser, world, db):
    api = browser(world.a.member.email)  # members may use the playground too
    r = api.post("/api/tenant/playground/key")
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["name"] == f"Playground · {world.a.member.email}"
    assert first["limits"] == {"requests_per_min": PLAYGROUND_KEY_LIMITS["requests_per_min"],
                               "concurrent_requests": PLAYGROUND_KEY_LIMITS["concurrent_requests"]}
    lifetime = _ts(first["expires_at"]) - _ts(first["created_at"])
    assert timedelta(0) < lifetime <= PLAYGROUND_KEY_TTL + timedelta(seconds=5)
    row = db.get(ApiKey, uuid.UUID(first["id"]))
    assert row.tenant_id == world.a.tenant.id and row.scopes == [SCOPE_INFERENCE] and row.created_by == world.a.member.id
    assert (row.requests_per_min, row.concurrent_requests) == (30, 2)
    assert v1_models(gateway, first["key"]).status_code == 200
    listed = {k["id"]: k for k in api.get("/api/tenant/keys").json()["data"]}
    assert listed[first["id"]]["expires_at"] is not None and first["key"] not in json.dumps(listed)
    assert db.scalar(select(AuditLog.action).where(AuditLog.target_id == str(row.id))) == "key.create"

    # Minting again replaces it at once (the key cache is dropped, although its TTL is minutes long).
    second = api.post("/api/tenant/playground/key").json()
    assert v1_models(gateway, first["key"]).status_code == 401
    assert v1_models(gateway, second["key"]).status_code == 200
    # Another user's playground key is not touched by this user's mint.
    other = browser(world.a.admin.email)
    theirs = other.post("/api/tenant/playground/key").json()
    assert v1_models(gateway, second["key"]).status_code == 200 and v1_models(gateway, theirs["key"]).status_code == 200

    # Signing out ends the user's playground key with the session.
    assert api.post("/api/auth/logout").status_code == 204
    assert v1_models(gateway, second["key"]).status_code == 401
    assert v1_models(gateway, theirs["key"]).status_code == 200


def test_playground_key_needs_a_tenant_role_and_the_csrf_token(browser, world):
    for role in ("platform_admin", "finance"):
        r = browser(world.email(role)).post("/api/tenant/playground/key")
        assert r.status_code == 403 and r.json()["error"]["code"] == "role_required"
    api = browser(world.a.member.email)
    r = api.request("POST", "/api/tenant/playground/key", csrf=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"


def test_admin_lists_a_tenants_users_without_secrets(browser, world):
    admin = browser(world.platform_admin.email)
    r = admin.get(f"/api/admin/tenants/{world.a.tenant.id}/users")
    assert r.status_code == 200, r.text
    users = {u["email"]: u for u in r.json()["data"]}
    assert set(users) == {world.a.admin.email, world.a.member.email}
    assert users[world.a.admin.email]["role"] == "tenant_admin" and users[world.a.member.email]["disabled"] is False
    assert set(users[world.a.admin.email]) == {"id", "email", "role", "created_at", "last_login_at", "disabled"}
    assert admin.get(f"/api/admin/tenants/{uuid.uuid4()}/users").status_code == 404
    tenants = {t["id"]: t for t in admin.get("/api/admin/tenants").json()["data"]}
    assert tenants[str(world.a.tenant.id)]["user_count"] == 2


def test_one_adapter_with_its_tenant_and_which_version_is_active(browser, world):
    admin = browser(world.platform_admin.email)
    r = admin.get(f"/api/admin/adapters/{world.a.adapter.id}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["tenant_id"], body["tenant_name"], body["name"]) == (str(world.a.tenant.id), world.a.tenant.name,
                                                                        world.a.adapter.name)
    assert {v["version"]: v["active"] for v in body["versions"]} == {1: True, 2: False}
    assert admin.get(f"/api/admin/adapters/{uuid.uuid4()}").status_code == 404
    # Tenants read the same flag on their versions.
    member = browser(world.a.member.email)
    assert member.get(f"/api/tenant/adapter-versions/{world.a.v1.id}").json()["active"] is True
    assert member.get(f"/api/tenant/adapter-versions/{world.a.v2.id}").json()["active"] is False


@pytest.fixture
def fake_engine(redis_client, world):
    """A registry entry and history as an engine would publish them, holding world A's v1 and an unknown hash."""
    engine_id = f"web-test-{uuid.uuid4().hex[:6]}"
    now = time.time()
    snap = {"id": engine_id, "url": "http://10.0.0.9:9000", "base_model": "mplex-demo", "running": 3, "waiting": 1,
            "kv_usage": 0.5, "max_num_seqs": 8, "slots_total": 4, "tokens_total": 900, "ts": now,
            "slot_adapters": [world.a.v1.content_sha256], "host_adapters": [world.a.v1.content_sha256, "f" * 64]}
    samples = [{"ts": now - 10, "tokens": 100, "running": 1, "waiting": 0, "kv_usage": 0.1, "slots_used": 0, "slots_total": 4},
               {"ts": now - 5, "tokens": 600, "running": 2, "waiting": 3, "kv_usage": 0.4, "slots_used": 1, "slots_total": 4},
               {"ts": now, "tokens": 50, "running": 3, "waiting": 1, "kv_usage": 0.5, "slots_used": 1, "slots_total": 4}]

    def publish(**changes) -> None:
        redis_client.set(entry_key(engine_id), json.dumps({**snap, **changes}), ex=30)

    publish()
    redis_client.sadd(REGISTRY_SET, engine_id)
    redis_client.lpush(history_key(engine_id), *[json.dumps(s) for s in samples])  # newest first, like the engine
    yield engine_id, publish
    redis_client.delete(entry_key(engine_id), history_key(engine_id))
    redis_client.srem(REGISTRY_SET, engine_id)


def test_engines_name_their_adapters_and_say_how_healthy_they_are(browser, world, fake_engine):
    engine_id, publish = fake_engine
    admin = browser(world.platform_admin.email)

    def mine() -> dict:
        return next(e for e in admin.get("/api/admin/engines").json()["data"] if e["id"] == engine_id)

    e = mine()
    named = {a["content_id"]: a for a in e["adapters"]}
    assert named[world.a.v1.content_sha256]["names"] == [f"{world.a.adapter.name}@1"]
    assert named[world.a.v1.content_sha256]["tenants"] == [world.a.tenant.name]
    assert named["f" * 64] == {"content_id": "f" * 64, "names": [], "tenants": []}  # loaded, but no live version has it
    assert e["slots_total"] == 4 and e["health"] == {"state": "healthy", "reasons": []}
    publish(kv_usage=0.97, waiting=20)
    e = mine()
    assert e["health"]["state"] == "degraded" and len(e["health"]["reasons"]) == 2
    publish(ts=time.time() - 10)
    assert mine()["health"]["state"] == "unhealthy"

    hist = next(h for h in admin.get("/api/admin/engines/history").json()["data"] if h["id"] == engine_id)
    s = hist["samples"]
    assert [x["waiting"] for x in s] == [0, 3, 1]  # oldest first
    # 500 tokens in 5 s, then the counter went down (a restart): no rate for that step.
    assert [x["tokens_per_s"] for x in s] == [None, 100.0, None]
    assert s[1]["slots_used"] == 1 and s[1]["kv_usage"] == 0.4
