"""Small helpers for the browser tests: sign in through the form, read numbers the page shows, wait on the server."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

from playwright.sync_api import Page, expect

T = TypeVar("T")

DESKTOP = {"width": 1440, "height": 900}
PHONE = {"width": 390, "height": 844}
WIDTHS = [DESKTOP, PHONE]  # `@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)`
WIDTH_IDS = ["1440px", "390px"]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "web"
AXE = ROOT / "web" / "node_modules" / "axe-core" / "axe.min.js"
BLOCKING = ("serious", "critical")

PASSWORDS = {
    "admin@demo.test": "demo-admin-pass",
    "member@demo.test": "demo-member-pass",
    "platform@multiplex.test": "platform-admin-pass",
    "finance@multiplex.test": "finance-demo-pass",
}


def tid(page: Page, test_id: str):
    return page.get_by_test_id(test_id)


def sign_in(page: Page, email: str, path: str = "/") -> None:
    """Sign in through the form, as a person would; lands on the role's start page (or `path`)."""
    page.goto(path)
    tid(page, "login-email").fill(email)
    tid(page, "login-password").fill(PASSWORDS[email])
    tid(page, "login-submit").click()
    expect(tid(page, "current-user")).to_contain_text(email)


def number(page: Page, test_id: str) -> int:
    """An integer the page prints with thousands separators (e.g. `1,234`)."""
    text = tid(page, test_id).inner_text().strip()
    return int(text.replace(",", "").replace("\u202f", "").replace("\xa0", ""))


def micro_usd(page: Page, test_id: str) -> int:
    return int(tid(page, test_id).get_attribute("data-microusd"))


def csrf_token(page: Page) -> str:
    """The signed-in browser's CSRF token, from the same endpoint the app restores its session with."""
    r = page.context.request.get("/api/auth/me")
    assert r.ok, r.text()
    return r.json()["csrf_token"]


def wait_for(fn: Callable[[], T | None], timeout: float = 60, interval: float = 0.5, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(interval)


# -- the ledger, read straight from the database (the oracle the pages are checked against) ------------------
DEMO_PRICES = {"input": 200_000, "cached_input": 100_000, "output": 600_000, "adapter_surcharge": 50_000}  # per 1M tokens
CPU_PER_HOUR = 400_000  # micro-USD per engine-hour of the demo "cpu" engine type
PICO_PER_MICRO = 1_000_000
US_PER_HOUR = 3_600_000_000


def _half_up(n: int, d: int) -> int:
    return (2 * n + d) // (2 * d)


def ledger_totals(db_engine, day_from, day_to, tenant_id=None) -> dict[str, int]:
    """Requests, tokens, billed and attributed cost for UTC days [day_from, day_to] computed from usage_events
    with the demo prices: money rounded once per (day, tenant, model, adapter, tier) as the billing rules say."""
    from datetime import datetime, time, timedelta, timezone

    from sqlalchemy import text

    lo = datetime.combine(day_from, time.min, timezone.utc)
    hi = datetime.combine(day_to + timedelta(days=1), time.min, timezone.utc)
    sql = ("SELECT (created_at AT TIME ZONE 'UTC')::date, tenant_id, model, adapter_version_id, service_tier = 'batch', "
           "count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(compute_us) "
           "FROM usage_events WHERE created_at >= :lo AND created_at < :hi" + (" AND tenant_id = :t" if tenant_id else "")
           + " GROUP BY 1, 2, 3, 4, 5")
    out = dict.fromkeys(("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "billed_microusd",
                         "compute_cost_microusd"), 0)
    groups: dict[tuple, list[int]] = {}  # daily row -> [billed pico x kept basis points, compute us]
    with db_engine.connect() as conn:
        for *key, batch, n, p, c, o, us in conn.execute(text(sql), {"lo": lo, "hi": hi, "t": tenant_id}):
            pico = (p - c) * DEMO_PRICES["input"] + c * DEMO_PRICES["cached_input"] + o * DEMO_PRICES["output"]
            if key[3] is not None:  # an adapter
                pico += (p + o) * DEMO_PRICES["adapter_surcharge"]
            g = groups.setdefault((*key, batch), [0, 0])  # a batch line's daily row is its own
            g[0] += pico * (5_000 if batch else 10_000)
            g[1] += us
            out["requests"] += n
            out["prompt_tokens"] += p
            out["cached_tokens"] += c
            out["completion_tokens"] += o
    for billed_scaled, us in groups.values():
        out["billed_microusd"] += _half_up(billed_scaled, PICO_PER_MICRO * 10_000)
        out["compute_cost_microusd"] += _half_up(us * CPU_PER_HOUR, US_PER_HOUR)
    return out


def ledger_count(db_engine, **where) -> int:
    from sqlalchemy import text

    clause = " AND ".join(f"{k} = :{k}" for k in where) or "true"
    with db_engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM usage_events WHERE {clause}"), where).scalar_one()


# -- accessibility and screenshots -------------------------------------------------------------------------
@cache
def _axe_source() -> str:
    if not AXE.exists():
        raise AssertionError(f"{AXE} is missing: run `npm ci` in web/ (axe-core is a dev dependency)")
    return AXE.read_text()


def check_a11y(page: Page, what: str) -> list[dict]:
    """Run axe-core on the page as it is now; fail on any serious or critical violation. axe is evaluated through
    the DevTools protocol, not added as a <script>: the app's CSP (rightly) refuses inline scripts."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(_axe_source())
    violations = page.evaluate("""async () => {
        const r = await window.axe.run(document, {resultTypes: ['violations']});
        return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
                                        nodes: v.nodes.slice(0, 5).map(n => n.target.join(' '))}));
    }""")
    bad = [v for v in violations if v["impact"] in BLOCKING]
    assert not bad, f"axe found serious/critical accessibility problems on {what} ({page.url}):\n" + "\n".join(
        f"  {v['impact']} {v['id']}: {v['help']} at {v['nodes']}" for v in bad)
    return violations


def shot(page: Page, name: str) -> Path:
    """A full-page screenshot under test-artifacts/web/, named after the view and the viewport width."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    width = page.viewport_size["width"] if page.viewport_size else 0
    path = ARTIFACTS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{width}px.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def no_sideways_scroll(page: Page) -> None:
    """The page fits its viewport's width (a phone never scrolls sideways)."""
    width = page.viewport_size["width"]
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"{page.url} is {scroll} px wide in a {width} px viewport"


def visit(page: Page, what: str) -> None:
    """The checks every page gets: settled, accessible, fits a phone, saved as a screenshot."""
    page.wait_for_load_state("networkidle")
    check_a11y(page, what)
    no_sideways_scroll(page)
    shot(page, what)


def expected_http_error(page: Page, status: int, url_pattern: str) -> None:
    """A refusal the test provoked on purpose (the API's contract: 404 for an unknown id, 409 for a conflict, 400
    for bad input). Chromium logs every such response as a console error; drop exactly those lines, and require
    that the refusal was seen, so any other console error still fails the test."""
    pattern = re.compile(rf"status of {status} .*{url_pattern}")
    matched = [p for p in page.problems if pattern.search(p)]
    assert matched, f"expected a {status} from {url_pattern}; the browser saw: {page.problems}"
    page.problems[:] = [p for p in page.problems if p not in matched]
