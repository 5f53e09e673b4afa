"""The BOLA matrix: every management endpoint × every role, on the real gateway.

- Anonymous callers get 401; a role not allowed gets 403 and changes nothing.
- Tenant-scoped endpoints called by tenant A with tenant B's ids answer 404, byte-for-byte like an id that
  does not exist, leak none of B's identifiers, and leave B untouched.
- Tenant-scoped listings show nothing of B.
- Every /api/tenant/..., /api/admin/... and /api/finance/... route in the app must have a row here (a new endpoint fails
  `test_every_management_route_is_in_the_matrix` until it is added).

To add an endpoint: one `Endpoint(...)` row in ENDPOINTS.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

import pytest
from sqlalchemy.orm import Session

from services.common.models import Adapter, AdapterVersion, ApiKey, Batch, BatchFile, Tenant, TenantLimits
from tests.gateway.mgmt_harness import (  # noqa: F401 (fixtures)
    audit_count,
    browser,
    gateway,
    v1_models,
    world,
)

ROLES = ("tenant_member", "tenant_admin", "platform_admin", "finance")
TENANT = ("tenant_member", "tenant_admin")
TENANT_ADMIN = ("tenant_admin",)
PLATFORM = ("platform_admin",)
FINANCE = ("finance", "platform_admin")
MANAGEMENT_PREFIXES = ("/api/tenant", "/api/admin", "/api/finance")


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # the route template; its one path parameter is written {id}
    roles: tuple[str, ...]  # allowed; other roles get 403, anonymous 401
    target: str | None = None  # what {id} names: key | version | adapter | tenant | request
    tenant_scoped: bool = True  # ids are the caller's tenant's only (another tenant's = 404)
    body: dict | None = None  # a valid body: if a check failed open, the call would act

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


ENDPOINTS = [
    # tenant pages (api/tenant.py)
    Endpoint("GET", "/api/tenant", TENANT),
    Endpoint("GET", "/api/tenant/keys", TENANT),
    Endpoint("POST", "/api/tenant/keys", TENANT_ADMIN, body={"name": "bola"}),
    Endpoint("DELETE", "/api/tenant/keys/{id}", TENANT_ADMIN, target="key"),
    Endpoint("GET", "/api/tenant/adapters", TENANT),
    Endpoint("GET", "/api/tenant/adapter-versions/{id}", TENANT, target="version"),
    Endpoint("GET", "/api/tenant/storage", TENANT),
    # tenant usage (billing, api/tenant_usage.py) and uploads (adapters)
    Endpoint("GET", "/api/tenant/usage", TENANT),
    Endpoint("GET", "/api/tenant/spend", TENANT),
    Endpoint("POST", "/api/tenant/adapters", TENANT_ADMIN),
    # the web app's breakdowns and playground (api/tenant_usage.py, api/playground.py)
    Endpoint("GET", "/api/tenant/usage/keys", TENANT),
    Endpoint("GET", "/api/tenant/requests/{id}", TENANT, target="request"),
    Endpoint("POST", "/api/tenant/playground/key", TENANT),
    # the web app's batches page (api/tenant_batches.py)
    Endpoint("GET", "/api/tenant/batches", TENANT),
    Endpoint("POST", "/api/tenant/batches/{id}/cancel", TENANT, target="batch"),
    Endpoint("GET", "/api/tenant/batch-files/{id}/content", TENANT, target="batch_file"),
    # platform admin (api/admin.py): any tenant's ids, platform_admin only
    Endpoint("GET", "/api/admin/tenants", PLATFORM, tenant_scoped=False),
    Endpoint("POST", "/api/admin/tenants", PLATFORM, tenant_scoped=False, body={"name": "BOLA", "slug": "bola-x"}),
    Endpoint("PATCH", "/api/admin/tenants/{id}", PLATFORM, "tenant", False, {"status": "suspended"}),
    Endpoint("GET", "/api/admin/tenants/{id}/adapters", PLATFORM, "tenant", False),
    Endpoint("GET", "/api/admin/tenants/{id}/storage", PLATFORM, "tenant", False),
    Endpoint("PUT", "/api/admin/tenants/{id}/storage", PLATFORM, "tenant", False, {"quota_bytes": 1}),
    Endpoint("POST", "/api/admin/tenants/{id}/users", PLATFORM, "tenant", False,
             {"email": "bola@example.test", "password": "bola password 1", "role": "tenant_admin"}),
    Endpoint("GET", "/api/admin/adapter-versions/{id}", PLATFORM, "version", False),
    Endpoint("POST", "/api/admin/adapter-versions/{id}/override", PLATFORM, "version", False,
             {"decision": "rejected", "reason": "bola"}),
    Endpoint("POST", "/api/admin/adapters/{id}/rollback", PLATFORM, "adapter", False, {"version": 1}),
    Endpoint("DELETE", "/api/admin/adapters/{id}", PLATFORM, "adapter", False),
    Endpoint("GET", "/api/admin/tenants/{id}/users", PLATFORM, "tenant", False),
    Endpoint("GET", "/api/admin/adapters/{id}", PLATFORM, "adapter", False),
    Endpoint("GET", "/api/admin/engines", PLATFORM, tenant_scoped=False),
    Endpoint("GET", "/api/admin/engines/history", PLATFORM, tenant_scoped=False),
    Endpoint("POST", "/api/admin/tenants/{id}/adapters", PLATFORM, "tenant", False),
    # finance (api/finance.py): role checks only
    Endpoint("GET", "/api/finance/report", FINANCE, tenant_scoped=False),
    Endpoint("GET", "/api/finance/report.csv", FINANCE, tenant_scoped=False),
    Endpoint("GET", "/api/finance/trend", FINANCE, tenant_scoped=False),
]


def _template(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{id}", path)


def app_routes(app) -> set[tuple[str, str]]:
    """(method, path template) of every route the app serves: the router tree (routers included into
    the app, however deep) and, as a cross-check, the OpenAPI schema."""
    found: set[tuple[str, str]] = set()

    def add(path, methods) -> None:
        for m in methods or ():
            if path and m not in ("HEAD", "OPTIONS"):
                found.add((m, _template(path)))

    for route in app.routes:
        contexts = getattr(route, "effective_route_contexts", None)  # FastAPI's included routers
        if contexts is not None:
            for c in contexts():
                add(c.path, c.methods)
        else:
            add(getattr(route, "path", None), getattr(route, "methods", None))
    for path, ops in app.openapi().get("paths", {}).items():
        add(path, [m.upper() for m in ops])
    return found


def _assert_served(gateway, ep: Endpoint) -> None:
    assert (ep.method, ep.path) in app_routes(gateway.app), f"{ep} is in the matrix but the app does not serve it"


def _ids(tw) -> dict[str, str]:
    from services.common.batch_contract import batch_public_id, file_public_id

    return {"key": str(tw.key.row.id), "version": str(tw.v1.id), "adapter": str(tw.adapter.id), "tenant": str(tw.tenant.id),
            "request": tw.event.request_id, "batch": batch_public_id(tw.batch.id), "batch_file": file_public_id(tw.batch_file.id)}


def _call(api, ep: Endpoint, id_: str | None = None):
    path = ep.path.replace("{id}", id_) if id_ is not None else ep.path
    return api.request(ep.method, path, json=ep.body) if ep.body is not None else api.request(ep.method, path)


def _state(db_engine, tw) -> dict:
    """Everything a management call could change about one tenant."""
    with Session(db_engine) as s:
        t = s.get(Tenant, tw.tenant.id)
        lim = s.get(TenantLimits, tw.tenant.id)
        a = s.get(Adapter, tw.adapter.id)
        b = s.get(Batch, tw.batch.id)
        return {
            "batch": (str(b.status), b.cancelling_at, s.get(BatchFile, tw.batch_file.id).deleted_at),
            "tenant": (t.name, t.plan, str(t.status)),
            "limits": (lim.tokens_per_min, lim.requests_per_min, lim.concurrent_requests, lim.monthly_token_budget,
                       lim.storage_quota_bytes),
            "keys": sorted((str(k.id), k.revoked_at) for k in s.query(ApiKey).filter(ApiKey.tenant_id == t.id)),
            "adapter": (a.active_version_id, a.deleted_at),
            "versions": sorted((str(v.id), str(v.status), v.override_reason)
                               for v in s.query(AdapterVersion).filter(AdapterVersion.adapter_id == a.id)),
        }


@pytest.fixture
def untouched(db_engine, world, gateway):
    """Asserts after the test that no audit row was written and neither tenant changed, and that B's key
    still works on the OpenAI API."""
    before = (audit_count(db_engine, world), _state(db_engine, world.a), _state(db_engine, world.b))
    yield
    assert (audit_count(db_engine, world), _state(db_engine, world.a), _state(db_engine, world.b)) == before
    assert v1_models(gateway, world.b.key.secret).status_code == 200


def test_every_management_route_is_in_the_matrix(gateway):
    served = {r for r in app_routes(gateway.app) if r[1].startswith(MANAGEMENT_PREFIXES)}
    covered = {(e.method, e.path) for e in ENDPOINTS}
    missing = sorted(served - covered)
    assert not missing, f"management routes with no row in the BOLA matrix: {missing}"
    stale = [str(e) for e in ENDPOINTS if (e.method, e.path) not in served]
    assert not stale, f"matrix rows for routes the app does not serve: {stale}"


def test_route_enumeration_sees_included_routers(gateway):
    """The guard above is only as good as the enumeration: it must see routes from every included router."""
    routes = app_routes(gateway.app)
    assert {("POST", "/api/auth/login"), ("DELETE", "/api/tenant/keys/{id}"), ("POST", "/v1/chat/completions"),
            ("POST", "/api/admin/adapter-versions/{id}/override")} <= routes


@pytest.mark.parametrize("ep", ENDPOINTS, ids=str)
def test_anonymous_is_401(gateway, browser, world, ep, untouched):
    _assert_served(gateway, ep)
    r = _call(browser(), ep, _ids(world.b).get(ep.target))
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "not_signed_in"


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("ep", ENDPOINTS, ids=str)
def test_roles(gateway, browser, world, ep, role, untouched):
    """A role not allowed is refused before anything happens, whoever's ids it names."""
    _assert_served(gateway, ep)
    allowed = role in ep.roles
    if allowed and ep.method != "GET":
        pytest.skip("allowed writes act for real: tests/gateway/test_{tenant,admin}_api.py cover them")
    ids = _ids(world.a if ep.tenant_scoped else world.b)
    r = _call(browser(world.email(role)), ep, ids.get(ep.target))
    if allowed:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "role_required"
    for marker in world.b.markers():
        assert marker not in r.text


NOT_UUIDS = {"request", "batch", "batch_file"}
TENANT_ID_ENDPOINTS = [e for e in ENDPOINTS if e.tenant_scoped and e.target is not None]


@pytest.mark.parametrize("role", TENANT)
@pytest.mark.parametrize("ep", TENANT_ID_ENDPOINTS, ids=str)
def test_other_tenants_ids_are_404_like_missing_ones(gateway, browser, world, ep, role, untouched):
    _assert_served(gateway, ep)
    if role not in ep.roles:
        pytest.skip("role refused before any lookup (test_roles)")
    api = browser(world.email(role))
    theirs_id = _ids(world.b)[ep.target]
    missing_id = str(uuid.uuid4())
    theirs, missing = _call(api, ep, theirs_id), _call(api, ep, missing_id)
    assert theirs.status_code == missing.status_code == 404, (theirs.text, missing.text)
    assert theirs.content == missing.content  # nothing tells "exists elsewhere" from "does not exist"
    assert {k.lower() for k in theirs.headers} == {k.lower() for k in missing.headers}
    for marker in world.b.markers():
        assert marker not in theirs.text
    # An id of the caller's own, of the wrong kind, is no way round either. (Request, batch and batch-file ids are
    # not UUIDs: routes whose id is a UUID refuse them as malformed, 400, before any lookup; they are tried on the
    # routes whose ids are strings only.)
    for kind, own in _ids(world.a).items():
        if kind != ep.target and (kind in NOT_UUIDS) == (ep.target in NOT_UUIDS):
            r = _call(api, ep, own)
            assert r.status_code == 404 and r.content == missing.content, (kind, r.text)


TENANT_LISTINGS = [e for e in ENDPOINTS if e.tenant_scoped and e.target is None and e.method == "GET"]


@pytest.mark.parametrize("role", TENANT)
@pytest.mark.parametrize("ep", TENANT_LISTINGS, ids=str)
def test_tenant_listings_show_nothing_of_other_tenants(gateway, browser, world, ep, role, untouched):
    _assert_served(gateway, ep)
    r = _call(browser(world.email(role)), ep)
    assert r.status_code == 200, r.text
    for marker in world.b.markers():
        assert marker not in r.text, f"{ep} shows tenant B's {marker!r} to tenant A"
    for query in ({"tenant_id": str(world.b.tenant.id)}, {"tenant": world.b.tenant.slug}):
        widened = browser(world.email(role)).request("GET", ep.path, params=query)
        assert widened.status_code in (200, 400)
        for marker in world.b.markers():
            assert marker not in widened.text, f"{ep}?{query} shows tenant B's {marker!r}"


def test_tenant_listings_do_show_the_callers_own_objects(browser, world):
    """The negative checks above mean something only if the same calls show A's own objects."""
    api = browser(world.a.admin.email)
    assert str(world.a.key.row.id) in api.get("/api/tenant/keys").text
    adapters = api.get("/api/tenant/adapters").text
    assert world.a.adapter.name in adapters and str(world.a.v2.id) in adapters
    assert api.get(f"/api/tenant/adapter-versions/{world.a.v1.id}").status_code == 200


def _upload_parts(tmp_path) -> list:
    from services.common.lora_format import BaseDims
    from tests.adapters.tinymodel import write_adapter

    d = write_adapter(tmp_path / "bola-adapter", BaseDims(64, 128, 2, 4, 2, 16), rank=4)
    return [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in sorted(d.iterdir())]


def test_uploads_land_in_the_callers_tenant_only(db_engine, browser, world, tmp_path):
    """The allowed writes the matrix skips, for uploads: a tenant admin's upload lands in their own tenant
    whatever the request names (tenant B in the query string), and changes nothing of B; B's version of it
    is invisible to A. (This gateway's base-model directory has no model dimensions, as a gateway in front
    of remote engines may: the upload must not need them — it once answered 500 KeyError.)"""
    from sqlalchemy import select

    before_b = _state(db_engine, world.b)
    a_admin = browser(world.a.admin.email)
    r = a_admin.request("POST", "/api/tenant/adapters", params={"tenant_id": str(world.b.tenant.id)},
                        data={"name": "bola-upload"}, files=_upload_parts(tmp_path))
    assert r.status_code == 202, r.text
    with Session(db_engine) as s:
        v = s.get(AdapterVersion, uuid.UUID(r.json()["version_id"]))
        assert v.tenant_id == world.a.tenant.id
        assert s.scalar(select(Adapter.tenant_id).where(Adapter.id == v.adapter_id)) == world.a.tenant.id
    assert _state(db_engine, world.b) == before_b
    # A platform admin uploads for B; A's admin cannot read that version, nor see it listed.
    r = browser(world.platform_admin.email).request("POST", f"/api/admin/tenants/{world.b.tenant.id}/adapters",
                                                      data={"name": "bola-for-b"}, files=_upload_parts(tmp_path))
    assert r.status_code == 202, r.text
    b_version = r.json()["version_id"]
    assert a_admin.get(f"/api/tenant/adapter-versions/{b_version}").status_code == 404
    assert b_version not in a_admin.get("/api/tenant/adapters").text
    assert browser(world.b.admin.email).get(f"/api/tenant/adapter-versions/{b_version}").status_code == 200


# -- the Batch API (/v1/files, /v1/batches): API keys of the tenant, never another's ids -------------------------
BATCH_PREFIXES = ("/v1/files", "/v1/batches")


@dataclass(frozen=True)
class V1Endpoint:
    method: str
    path: str
    target: str | None = None  # file | batch
    body: dict | None = None

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


V1_ENDPOINTS = [
    V1Endpoint("POST", "/v1/files"),
    V1Endpoint("GET", "/v1/files/{id}", "file"),
    V1Endpoint("GET", "/v1/files/{id}/content", "file"),
    V1Endpoint("DELETE", "/v1/files/{id}", "file"),
    V1Endpoint("POST", "/v1/batches", "file"),  # {id} travels in the body: input_file_id
    V1Endpoint("GET", "/v1/batches"),
    V1Endpoint("GET", "/v1/batches/{id}", "batch"),
    V1Endpoint("POST", "/v1/batches/{id}/cancel", "batch"),
]


def _batch_line(model: str) -> bytes:
    import json

    return json.dumps({"custom_id": "bola", "method": "POST", "url": "/v1/completions",  # this model has no chat template
                       "body": {"model": model, "prompt": "hi", "max_tokens": 2}}).encode()


def _v1(gateway, ep: V1Endpoint, key: str | None, id_: str | None = None):
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = gateway.url + (ep.path.replace("{id}", id_) if id_ and "{id}" in ep.path else ep.path)
    if ep.path == "/v1/files" and ep.method == "POST":
        files = {"file": ("b.jsonl", _batch_line(gateway.settings.base_model_name))}
        return httpx.post(url, headers=headers, data={"purpose": "batch"}, files=files, timeout=30)
    if ep.path == "/v1/batches" and ep.method == "POST":
        body = {"input_file_id": id_ or "file-" + "0" * 32, "endpoint": "/v1/completions", "completion_window": "24h"}
        return httpx.post(url, headers=headers, json=body, timeout=30)
    return httpx.request(ep.method, url, headers=headers, timeout=30)


@pytest.fixture
def batch_ids(gateway, world):
    """A file and a batch of each tenant, made through the API with its own key."""
    out = {}
    for label, tw in (("a", world.a), ("b", world.b)):
        f = _v1(gateway, V1_ENDPOINTS[0], tw.key.secret)
        assert f.status_code == 200, f.text
        b = _v1(gateway, V1_ENDPOINTS[4], tw.key.secret, f.json()["id"])
        assert b.status_code == 200, b.text
        out[label] = {"file": f.json()["id"], "batch": b.json()["id"]}
    return out


def _b_state(gateway, world, ids) -> tuple:
    key = world.b.key.secret
    f = _v1(gateway, V1_ENDPOINTS[2], key, ids["b"]["file"])
    b = _v1(gateway, V1_ENDPOINTS[6], key, ids["b"]["batch"]).json()
    return f.status_code, f.content, b["status"], b["cancelling_at"]


def test_every_batch_api_route_is_in_the_matrix(gateway):
    served = {r for r in app_routes(gateway.app) if r[1].startswith(BATCH_PREFIXES)}
    assert served == {(e.method, e.path) for e in V1_ENDPOINTS}


@pytest.mark.parametrize("ep", V1_ENDPOINTS, ids=str)
def test_batch_api_needs_a_key_with_the_inference_scope(gateway, world, db_engine, ep):
    assert _v1(gateway, ep, None, "file-" + "0" * 32).status_code == 401
    with Session(db_engine) as db:
        from tests.factories import make_api_key

        usage_only = make_api_key(db, tenant=db.get(Tenant, world.a.tenant.id), scopes=["usage:read"]).secret
    r = _v1(gateway, ep, usage_only, "file-" + "0" * 32)
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope", r.text


@pytest.mark.parametrize("ep", [e for e in V1_ENDPOINTS if e.target], ids=str)
def test_batch_api_other_tenants_ids_are_404_like_missing_ones(gateway, world, batch_ids, ep):
    before = _b_state(gateway, world, batch_ids)
    key = world.a.key.secret
    theirs = _v1(gateway, ep, key, batch_ids["b"][ep.target])
    missing = _v1(gateway, ep, key, ("file-" if ep.target == "file" else "batch_") + uuid.uuid4().hex)
    assert theirs.status_code == missing.status_code == 404, (theirs.text, missing.text)
    assert theirs.content == missing.content
    for marker in world.b.markers() + [batch_ids["b"]["file"], batch_ids["b"]["batch"]]:
        assert marker not in theirs.text
    assert _b_state(gateway, world, batch_ids) == before  # B's file and batch are untouched
    own = _v1(gateway, ep, key, batch_ids["a"][ep.target])  # the same call on A's own id does act
    assert own.status_code == 200, own.text


def test_batch_listing_shows_only_the_callers_batches(gateway, world, batch_ids):
    listed = _v1(gateway, V1Endpoint("GET", "/v1/batches"), world.a.key.secret).text
    assert batch_ids["a"]["batch"] in listed and batch_ids["b"]["batch"] not in listed
    assert batch_ids["b"]["file"] not in listed
