"""API key scopes on the management API, as docs/api.md ("API key scopes") promises them: `usage:read` opens the
usage and spend routes, `adapters:write` the tenant upload, each for the key's own tenant only; a key without
the scope gets 403 missing_scope; everything else under /api still needs a signed-in user."""
from __future__ import annotations

import httpx
import pytest
from sqlalchemy.orm import Session

from services.common.keys import SCOPE_ADAPTERS_WRITE, SCOPE_INFERENCE, SCOPE_USAGE_READ
from tests.factories import make_api_key
from tests.gateway.mgmt_harness import (  # noqa: F401 (fixtures)
    bearer,
    browser,
    gateway,
    world,
)

USAGE_ROUTES = ("/api/tenant/usage", "/api/tenant/usage/keys", "/api/tenant/spend", "/api/tenant/requests/{a}")


@pytest.fixture(scope="module")
def keys(world, db_engine):
    with Session(db_engine, expire_on_commit=False) as db:
        made = {
            "a_usage": make_api_key(db, tenant=world.a.tenant, scopes=[SCOPE_USAGE_READ]),
            "a_write": make_api_key(db, tenant=world.a.tenant, scopes=[SCOPE_ADAPTERS_WRITE]),
            "a_all": make_api_key(db, tenant=world.a.tenant, scopes=[SCOPE_INFERENCE, SCOPE_USAGE_READ, SCOPE_ADAPTERS_WRITE]),
            "b_usage": make_api_key(db, tenant=world.b.tenant, scopes=[SCOPE_USAGE_READ]),
            "a_revoked": make_api_key(db, tenant=world.a.tenant, scopes=[SCOPE_USAGE_READ], revoked=True),
        }
        db.commit()
    return {name: k.secret for name, k in made.items()}


def _get(gateway, path: str, key: str | None, world) -> httpx.Response:
    path = path.format(a=world.a.event.request_id)
    return httpx.get(f"{gateway.url}{path}", headers=bearer(key) if key else {}, timeout=30)


def test_usage_read_opens_the_usage_routes_for_its_own_tenant(gateway, world, keys):
    for path in USAGE_ROUTES:
        for key in (keys["a_usage"], keys["a_all"]):
            r = _get(gateway, path, key, world)
            assert r.status_code == 200, (path, r.text)
            assert str(world.b.tenant.id) not in r.text and world.b.key.row.prefix not in r.text
    rows = _get(gateway, "/api/tenant/usage?group_by=adapter", keys["a_usage"], world).json()["rows"]
    assert [r["adapter"] for r in rows] == [world.a.adapter.name]
    assert _get(gateway, "/api/tenant/requests/{a}", keys["a_usage"], world).json()["request_id"] == world.a.event.request_id


def test_a_key_sees_only_its_tenant(gateway, world, keys):
    r = _get(gateway, "/api/tenant/requests/{a}", keys["b_usage"], world)
    assert r.status_code == 404 and world.a.event.request_id not in r.text
    rows = _get(gateway, "/api/tenant/usage?group_by=adapter", keys["b_usage"], world).json()["rows"]
    assert [r["adapter"] for r in rows] == [world.b.adapter.name]


def test_a_signed_in_browser_sending_a_key_is_judged_by_the_key(gateway, world, keys, browser):
    api = browser(world.a.member.email)
    assert api.get(f"/api/tenant/requests/{world.a.event.request_id}").status_code == 200  # the session alone
    r = api.get(f"/api/tenant/requests/{world.a.event.request_id}", headers=bearer(keys["b_usage"]))
    assert r.status_code == 404  # the header decides: B's key does not see A's request
    r = api.get("/api/tenant/usage", headers=bearer(world.a.key.secret))
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"


@pytest.mark.parametrize("name", ["inference", "a_write"])
def test_a_key_without_usage_read_is_refused(gateway, world, keys, name):
    key = world.a.key.secret if name == "inference" else keys[name]
    for path in USAGE_ROUTES:
        r = _get(gateway, path, key, world)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "missing_scope"


def test_bad_and_revoked_keys_are_401(gateway, world, keys):
    for key in (keys["a_revoked"], "mpx_notakey", keys["a_usage"][:-2] + "zz"):
        r = _get(gateway, "/api/tenant/usage", key, world)
        assert r.status_code == 401, r.text


def test_adapters_write_opens_the_upload_and_nothing_else(gateway, world, keys):
    url = f"{gateway.url}/api/tenant/adapters"
    form = {"data": {"name": " "}, "files": {"eval_set": ("eval.jsonl", b"")}}
    # A blank name: the handler's own validation answers, so the key got past authentication (without CSRF).
    r = httpx.post(url, headers=bearer(keys["a_write"]), **form, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    for key in (keys["a_usage"], world.a.key.secret):
        r = httpx.post(url, headers=bearer(key), **form, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"
    r = httpx.post(url, **form, timeout=30)
    assert r.status_code == 401  # no key and no session
    for path in ("/api/tenant", "/api/tenant/keys", "/api/tenant/adapters"):  # routes no scope opens
        r = httpx.get(f"{gateway.url}{path}", headers=bearer(keys["a_all"]), timeout=30)
        assert r.status_code == 401, (path, r.text)
