"""`GET /api/admin/tenants/{id}/adapters`: a platform admin sees one tenant's adapters (every version, status,
reasons), only that tenant's; an unknown tenant is a 404; tenant roles are refused (test_bola covers all roles)."""
from __future__ import annotations

import uuid

from tests.gateway.mgmt_harness import browser, gateway, world  # noqa: F401 (fixtures)


def test_admin_lists_one_tenants_adapters_with_their_versions(browser, world):
    admin = browser(world.platform_admin.email)
    r = admin.get(f"/api/admin/tenants/{world.a.tenant.id}/adapters")
    assert r.status_code == 200, r.text
    adapters = r.json()["data"]
    assert [a["name"] for a in adapters] == [world.a.adapter.name]  # nothing of tenant b
    a = adapters[0]
    assert a["active_version"] == world.a.v1.version
    by_id = {v["id"]: v for v in a["versions"]}
    assert by_id[str(world.a.v1.id)]["status"] == "ready"
    rejected = by_id[str(world.a.v2.id)]
    assert rejected["status"] == "rejected" and rejected["reasons"][0]["code"] == "margin_below_threshold"

    missing = admin.get(f"/api/admin/tenants/{uuid.uuid4()}/adapters")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Tenant not found."


def test_tenant_roles_cannot_list_a_tenants_adapters_through_the_admin_api(browser, world):
    tenant_admin = browser(world.a.admin.email)
    r = tenant_admin.get(f"/api/admin/tenants/{world.a.tenant.id}/adapters")
    assert r.status_code == 403 and r.json()["error"]["type"]
