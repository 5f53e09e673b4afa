"""Web sign-in on the real gateway: login/logout/me, cookie flags, CSRF on writes, sessions stored as hashes,
failed-login lockout in Redis."""
from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select, update

from services.common.models import Role, User, WebSession
from services.gateway.api.auth import LOGIN_MAX_FAILURES, LOGIN_WINDOW_S, _failure_key
from tests.factories import DEFAULT_PASSWORD, make_tenant, make_user
from tests.gateway.mgmt_harness import browser, gateway, make_gateway_settings  # noqa: F401 (fixtures)


def _cookie(response, name: str = "mplex_session") -> dict[str, str | bool]:
    """The Set-Cookie header for `name`, as {attribute (lower-case): value or True}."""
    for header in response.headers.get_list("set-cookie"):
        first, *attrs = [p.strip() for p in header.split(";")]
        key, _, value = first.partition("=")
        if key == name:
            out: dict[str, str | bool] = {"value": value.strip('"')}
            for a in attrs:
                k, eq, v = a.partition("=")
                out[k.lower()] = v if eq else True
            return out
    raise AssertionError(f"no Set-Cookie for {name}: {response.headers.get_list('set-cookie')}")


@pytest.fixture
def tenant_admin(db):
    tenant = make_tenant(db)
    return make_user(db, tenant=tenant, role=Role.TENANT_ADMIN)


def test_login_sets_a_hardened_cookie_and_returns_the_user(gateway, browser, tenant_admin, db):
    api = browser()
    r = api.login(tenant_admin.email.upper())  # emails are case-insensitive
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["user"] == {"id": str(tenant_admin.id), "email": tenant_admin.email, "role": "tenant_admin",
                            "tenant_id": str(tenant_admin.tenant_id), "tenant_name": tenant_admin.tenant.name}
    assert len(body["csrf_token"]) >= 32
    c = _cookie(r)
    assert c["httponly"] is True and c["samesite"].lower() == "lax" and c["path"] == "/"
    assert "secure" not in c  # local http in the test settings
    assert int(c["max-age"]) == gateway.settings.session_ttl_s
    # Only hashes are stored: the cookie token is not in the database, its sha256 is.
    stored = db.scalar(select(WebSession).where(WebSession.user_id == tenant_admin.id))
    assert stored.id == hashlib.sha256(c["value"].encode()).hexdigest()
    assert body["csrf_token"] not in (stored.csrf_token_hash, stored.id)
    assert db.scalar(select(User.last_login_at).where(User.id == tenant_admin.id)) is not None


def test_cookie_is_secure_when_settings_say_so(settings, tmp_path_factory, tenant_admin):
    from fastapi.testclient import TestClient

    from services.gateway.app import create_app

    app = create_app(make_gateway_settings(settings, tmp_path_factory, cookie_secure=True), web_dist=None)
    with TestClient(app, base_url="https://testserver") as client:
        r = client.post("/api/auth/login", json={"email": tenant_admin.email, "password": DEFAULT_PASSWORD})
        assert r.status_code == 200, r.text
        assert _cookie(r)["secure"] is True
        assert client.get("/api/auth/me").status_code == 200  # sent back over https


def test_me_reports_the_session_and_its_csrf_token(browser, tenant_admin):
    api = browser()
    r = api.get("/api/auth/me")
    assert r.status_code == 401 and r.json()["error"]["code"] == "not_signed_in"
    login = api.login(tenant_admin.email)
    me = api.get("/api/auth/me")
    assert me.status_code == 200
    assert me.json() == login.json()


def test_bad_credentials_are_one_indistinguishable_401(browser, tenant_admin):
    api = browser()
    wrong = api.login(tenant_admin.email, "not the right password")
    unknown = api.login("nobody-at-all@example.test", "not the right password")
    assert wrong.status_code == unknown.status_code == 401
    assert wrong.json() == unknown.json()
    assert wrong.json()["error"]["code"] == "invalid_credentials"
    assert not wrong.headers.get_list("set-cookie") and not unknown.headers.get_list("set-cookie")
    assert api.get("/api/auth/me").status_code == 401


def test_malformed_sign_in_bodies_are_400(browser):
    api = browser()
    assert api.http.post("/api/auth/login", json={"email": "x"}).status_code == 400
    assert api.http.post("/api/auth/login", json={"email": "a@b.test", "password": ""}).status_code == 400
    assert api.http.post("/api/auth/login", content=b"email=a@b.test&password=x",
                         headers={"content-type": "application/x-www-form-urlencoded"}).status_code == 400


def test_disabled_user_cannot_sign_in(browser, tenant_admin, db):
    db.execute(update(User).where(User.id == tenant_admin.id).values(disabled_at=datetime.now(timezone.utc)))
    db.commit()
    assert browser().login(tenant_admin.email).status_code == 401


def test_logout_needs_csrf_then_revokes_the_session_server_side(browser, tenant_admin):
    api = browser(tenant_admin.email)
    token = api.http.cookies.get("mplex_session")
    r = api.post("/api/auth/logout", csrf=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    assert api.get("/api/auth/me").status_code == 200
    r = api.post("/api/auth/logout")
    assert r.status_code == 204
    cleared = _cookie(r)
    assert cleared["value"] == "" and int(cleared["max-age"]) == 0
    assert api.get("/api/auth/me").status_code == 401
    # Replaying the old cookie does not bring the session back.
    replay = browser()
    replay.http.cookies.set("mplex_session", token)
    assert replay.get("/api/auth/me").status_code == 401
    assert browser().post("/api/auth/logout").status_code == 204  # signed out already: nothing to do


def test_signing_in_again_replaces_the_previous_session(browser, tenant_admin):
    api = browser(tenant_admin.email)
    first = api.http.cookies.get("mplex_session")
    assert api.login(tenant_admin.email).status_code == 200
    assert api.http.cookies.get("mplex_session") != first
    old = browser()
    old.http.cookies.set("mplex_session", first)
    assert old.get("/api/auth/me").status_code == 401


def test_expired_session_is_signed_out(browser, tenant_admin, db):
    api = browser(tenant_admin.email)
    sid = hashlib.sha256(api.http.cookies.get("mplex_session").encode()).hexdigest()
    db.execute(update(WebSession).where(WebSession.id == sid).values(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
    db.commit()
    assert api.get("/api/auth/me").status_code == 401
    assert api.get("/api/tenant").status_code == 401


def test_writes_need_the_sessions_own_csrf_token(browser, tenant_admin, db):
    api = browser(tenant_admin.email)
    other = browser(make_user(db, tenant=make_tenant(db), role=Role.TENANT_ADMIN).email)
    for headers in ({}, {"x-csrf-token": "0" * 64}, {"x-csrf-token": other.csrf}):
        r = api.post("/api/tenant/keys", json={"name": "ci"}, csrf=False, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", (headers, r.text)
    assert api.get("/api/tenant/keys").json()["data"] == []  # none of those created anything
    assert api.post("/api/tenant/keys", json={"name": "ci"}).status_code == 201
    # Reads need no token.
    assert api.get("/api/tenant/keys", csrf=False).status_code == 200


def test_failed_sign_ins_lock_out_that_email_from_that_ip(browser, tenant_admin, redis_client, db):
    api = browser()
    for _ in range(LOGIN_MAX_FAILURES):
        assert api.login(tenant_admin.email, "wrong password here").status_code == 401
    locked = api.login(tenant_admin.email)  # even the right password, while locked
    assert locked.status_code == 429
    assert locked.json()["error"]["code"] == "too_many_sign_in_attempts"
    assert 0 < int(locked.headers["retry-after"]) <= LOGIN_WINDOW_S
    ttl = redis_client.ttl(_failure_key(tenant_admin.email, "127.0.0.1"))
    assert 0 < ttl <= LOGIN_WINDOW_S
    # Another account from the same address is unaffected.
    someone_else = make_user(db, tenant=make_tenant(db))
    assert browser().login(someone_else.email).status_code == 200
    # When the window ends the account can sign in again (the window is the key's TTL: end it now).
    redis_client.delete(_failure_key(tenant_admin.email, "127.0.0.1"))
    assert api.login(tenant_admin.email).status_code == 200


def test_successful_sign_in_resets_the_failure_count(browser, tenant_admin, redis_client):
    api = browser()
    for _ in range(LOGIN_MAX_FAILURES - 1):
        assert api.login(tenant_admin.email, "wrong password here").status_code == 401
    assert api.login(tenant_admin.email).status_code == 200
    assert redis_client.get(_failure_key(tenant_admin.email, "127.0.0.1")) is None
    for _ in range(LOGIN_MAX_FAILURES - 1):
        assert api.login(tenant_admin.email, "wrong password here").status_code == 401
    assert api.login(tenant_admin.email).status_code == 200


@pytest.mark.parametrize("role", [Role.PLATFORM_ADMIN, Role.FINANCE])
def test_platform_roles_sign_in_without_a_tenant(browser, db, role):
    user = make_user(db, role=role)
    body = browser(user.email).get("/api/auth/me").json()
    assert body["user"]["role"] == str(role)
    assert body["user"]["tenant_id"] is None and body["user"]["tenant_name"] is None


def test_api_is_unusable_without_signing_in(browser):
    api = browser()
    for method, path in [("GET", "/api/tenant"), ("GET", "/api/tenant/keys"), ("POST", "/api/tenant/keys"),
                         ("GET", "/api/admin/tenants")]:
        r = api.request(method, path, json={})
        assert r.status_code == 401, (method, path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
