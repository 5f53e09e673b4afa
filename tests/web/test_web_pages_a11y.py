"""Every page of every role at 1440 px and 390 px in real Chromium: axe-core finds no serious or critical
accessibility problem, nothing scrolls sideways on a phone, no console error; each page is saved as a screenshot
(test-artifacts/web/page-<role>-<page>-<width>px.png)."""
from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.web.helpers import WIDTH_IDS, WIDTHS, check_a11y, shot, sign_in, tid, visit

ROLES = ["admin@demo.test", "member@demo.test", "platform@multiplex.test", "finance@multiplex.test"]
# Pages reached from another page rather than from the navigation.
DEEP = {
    "admin@demo.test": ["/adapters/upload"],
    "platform@multiplex.test": ["/admin/tenants/{tenant}/adapters"],
}


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
@pytest.mark.parametrize("email", ROLES)
def test_every_page_is_accessible_and_fits(page, web_stack, email):
    role = email.split("@")[0]
    page.goto("/")
    expect(tid(page, "login-form")).to_be_visible()
    check_a11y(page, "the sign-in page")
    shot(page, "page-sign-in")
    sign_in(page, email)
    nav = page.locator("[data-testid^='nav-']")
    for test_id in [nav.nth(i).get_attribute("data-testid") for i in range(nav.count())]:
        tid(page, test_id).click()
        expect(tid(page, test_id)).to_have_attribute("aria-current", "page")
        expect(page.locator("[role=status].state-loading")).to_have_count(0, timeout=30_000)
        visit(page, f"page-{role}-{test_id.removeprefix('nav-')}")
    for path in DEEP.get(email, []):
        page.goto(path.format(tenant=web_stack.tenant_id))
        expect(page.get_by_role("heading", level=1)).to_be_visible()
        expect(page.locator("[role=status].state-loading")).to_have_count(0, timeout=30_000)
        visit(page, f"page-{role}-{path.strip('/').split('/')[-1]}")
    page.goto("/no-such-page")
    expect(tid(page, "not-found")).to_be_visible()
    visit(page, f"page-{role}-not-found")
