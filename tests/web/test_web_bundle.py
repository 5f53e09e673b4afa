"""The built app as the gateway serves it: every file the browser fetches to show the sign-in page is under
500 kB gzipped in total; hashed assets are cached for a year as immutable, index.html is revalidated, app
paths fall back to index.html, API paths never do."""
from __future__ import annotations

import gzip
import re

import httpx
from playwright.sync_api import expect

from tests.web.helpers import tid

BUDGET_GZIP_BYTES = 500_000
IMMUTABLE = "public, max-age=31536000, immutable"
HASHED = re.compile(r"^/assets/[\w.-]+-[\w-]{8,}\.(js|css)$")


def test_the_bundle_is_small_and_served_with_the_right_cache_headers(page, web_stack):
    fetched: dict[str, bytes] = {}
    headers: dict[str, dict] = {}

    def on_response(response) -> None:
        path = response.url.removeprefix(web_stack.url)
        if response.url.startswith(web_stack.url) and not path.startswith("/api/"):
            fetched[path] = response.body()
            headers[path] = response.headers

    page.on("response", on_response)
    page.goto("/")
    expect(tid(page, "login-form")).to_be_visible()
    page.wait_for_load_state("networkidle")

    assets = [p for p in fetched if p.startswith("/assets/")]
    assert any(p.endswith(".js") for p in assets) and any(p.endswith(".css") for p in assets), list(fetched)
    for path in assets:
        assert HASHED.match(path), f"{path} has no content hash in its name"
        assert headers[path]["cache-control"] == IMMUTABLE, (path, headers[path])
    assert headers["/"]["cache-control"] == "no-cache"
    gz = sum(len(gzip.compress(body, 9)) for body in fetched.values())
    assert gz < BUDGET_GZIP_BYTES, f"{gz} bytes gzipped: {sorted((p, len(b)) for p, b in fetched.items())}"

    with httpx.Client(base_url=web_stack.url, timeout=10) as http:
        index = http.get("/")
        # Every asset index.html names is one the browser fetched (nothing loaded from elsewhere, e.g. a CDN).
        named = set(re.findall(r'(?:src|href)="(/assets/[^"]+)"', index.text))
        assert named and named <= set(assets)
        assert not re.search(r'(?:src|href)="https?://', index.text)
        deep = http.get("/admin/versions/0a1b2c")  # an app path: the SPA shell, revalidated
        assert deep.status_code == 200 and deep.text == index.text and deep.headers["cache-control"] == "no-cache"
        missing = http.get("/api/no-such-endpoint")  # an API path: a JSON 404, never the shell
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
