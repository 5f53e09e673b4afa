"""The built app under the gateway's security headers, in real Chromium against the real stack: every page runs
with no Content-Security-Policy violation, another site cannot frame it, the bundle reaches the browser
brotli-encoded and decodes to the built files' exact bytes (gzip or identity for clients that ask for that), and
the OpenAI API's SSE stream still streams, unencoded, with the headers."""
from __future__ import annotations

import gzip
import json

import httpx
import pytest
from playwright.sync_api import expect

from services.gateway.security import API_CSP, WEB_CSP
from tests.web.helpers import sign_in, tid

# Collects every CSP violation a document reports (Chromium also logs them, but not always as console errors).
RECORD_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) =>
  window.__csp.push(`${e.effectiveDirective} blocked ${e.blockedURI || "inline"} at ${e.sourceFile}:${e.lineNumber}`));
"""


@pytest.mark.parametrize("email", ["admin@demo.test", "platform@multiplex.test", "finance@multiplex.test"])
def test_every_page_runs_under_the_csp_without_a_violation(page, web_stack, email):
    documents = []
    page.on("response", lambda r: documents.append(r) if r.request.resource_type == "document" else None)
    page.add_init_script(RECORD_VIOLATIONS)
    sign_in(page, email)
    nav = page.locator("[data-testid^='nav-']")
    expect(nav.first).to_be_visible()
    for test_id in [nav.nth(i).get_attribute("data-testid") for i in range(nav.count())]:
        tid(page, test_id).click()
        expect(tid(page, test_id)).to_have_attribute("aria-current", "page")
        page.wait_for_load_state("networkidle")
        assert page.evaluate("window.__csp") == [], f"{email} on {page.url}"
    # The first load of this URL caches it; the second revalidates it: a 304, whose headers Chromium merges into
    # the cached page's.
    for _ in range(2):
        page.reload()
        expect(nav.first).to_be_visible()
        page.wait_for_load_state("networkidle")
        assert page.evaluate("window.__csp") == [], f"{email} on {page.url} after a reload"
    first = [d for d in documents if d.status == 200]  # a revalidated reload may be reported as its 304
    assert first and all(d.headers["content-security-policy"] == WEB_CSP for d in first)
    assert all(d.headers["x-frame-options"] == "DENY" for d in documents)


def test_another_site_cannot_frame_the_app(page, web_stack):
    page.set_content(f'<iframe src="{web_stack.url}/admin/tenants" width="600" height="400"></iframe>')
    frame = page.frames[1]
    page.wait_for_load_state("load")
    assert frame.url.startswith("chrome-error://"), frame.url  # Chromium's blocked-frame page, not the app
    assert frame.locator("[data-testid='login-form']").count() == 0
    # Chromium says why on the console; that refusal is the point here, not a problem with the page.
    page.problems[:] = [p for p in page.problems if "frame-ancestors" not in p]


def test_the_bundle_reaches_the_browser_brotli_encoded_as_the_built_bytes(page, web_stack, web_dist):
    seen = {}

    def on_response(response) -> None:
        path = response.url.removeprefix(web_stack.url)
        if path.startswith("/assets/"):
            seen[path] = (response.headers.get("content-encoding"), response.body())

    page.on("response", on_response)
    page.goto("/")
    expect(tid(page, "login-form")).to_be_visible()
    page.wait_for_load_state("networkidle")
    assert any(p.endswith(".js") for p in seen) and any(p.endswith(".css") for p in seen), list(seen)
    for path, (encoding, body) in seen.items():
        assert encoding == "br", path  # Chromium accepts br; every asset of the app is big enough to have one
        assert body == (web_dist / path.lstrip("/")).read_bytes(), path  # as decoded by Chromium


def test_http_clients_get_the_encoding_they_accept(web_stack, web_dist):
    assets = sorted(p for p in (web_dist / "assets").iterdir() if p.suffix in (".js", ".css"))
    assert assets
    with httpx.Client(base_url=web_stack.url, timeout=10) as http:
        for asset in assets:
            original = asset.read_bytes()
            for accept, encoding, expected in [("br, gzip", "br", asset.with_name(asset.name + ".br").read_bytes()),
                                               ("gzip", "gzip", asset.with_name(asset.name + ".gz").read_bytes()),
                                               ("identity", None, original)]:
                with http.stream("GET", f"/assets/{asset.name}", headers={"accept-encoding": accept}) as r:
                    raw = b"".join(r.iter_raw())
                assert r.status_code == 200 and r.headers.get("content-encoding") == encoding, (asset.name, accept)
                assert raw == expected and int(r.headers["content-length"]) == len(expected)
                assert r.headers["vary"] == "Accept-Encoding"
                assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
                assert r.headers["x-content-type-options"] == "nosniff"
                if encoding == "gzip":
                    assert gzip.decompress(raw) == original


def test_streamed_completions_still_stream_unencoded_with_the_headers(web_stack):
    body = {"model": web_stack.kit.model_name, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Sort: pear apple fig"}]}
    headers = {"authorization": f"Bearer {web_stack.api_key}", "accept-encoding": "gzip, br"}
    with httpx.Client(base_url=web_stack.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "content-encoding" not in r.headers
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["content-security-policy"] == API_CSP
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
