"""The gateway's security headers and its compressed static files, on the real app (real Postgres and Redis):
every response says nosniff and cannot be framed, HTML gets the strict CSP, the API's JSON and error shapes are
untouched, and a precompressed file goes out as exactly the bytes the build wrote (identity when not accepted)."""
from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gateway.security import API_CSP, DOCS_CSP, HSTS, WEB_CSP
from tests.gateway.mgmt_harness import make_gateway_settings

ASSET = "assets/app-0123abcd.js"
SMALL = "assets/app-0123abcd.css"  # under the build's 1 kB threshold: no compressed siblings
INDEX = b'<!doctype html><html><head><script type="module" src="/assets/app-0123abcd.js"></script></head></html>'


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """A built app as `make web` lays it out: hashed assets, a .gz written once beside the big one."""
    root = tmp_path_factory.mktemp("dist")
    (root / "assets").mkdir()
    (root / "index.html").write_bytes(INDEX)
    script = b"".join(b"export function f%d(x) { return x * %d + Math.sqrt(x); }\n" % (i, i) for i in range(2000))
    (root / ASSET).write_bytes(script)
    (root / (ASSET + ".gz")).write_bytes(gzip.compress(script, 9))
    (root / SMALL).write_bytes(b"body{margin:0}")
    return root


def make_client(settings, tmp_path_factory, dist: Path, **overrides):
    from fastapi.testclient import TestClient

    from services.gateway.app import create_app

    app = create_app(make_gateway_settings(settings, tmp_path_factory, **overrides), web_dist=dist)

    @app.post("/api/test-crash", include_in_schema=False)  # after the SPA's GET catch-all: POST reaches it
    async def crash():
        raise RuntimeError("boom")

    return app, TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(settings, tmp_path_factory, dist) -> Iterator:
    _, c = make_client(settings, tmp_path_factory, dist)
    with c:
        yield c


def csp(response) -> dict[str, list[str]]:
    out = {}
    for directive in response.headers["content-security-policy"].split(";"):
        name, *values = directive.split()
        out[name] = values
    return out


def assert_hardened(response) -> None:
    h = response.headers
    assert h["x-content-type-options"] == "nosniff"
    assert h["referrer-policy"] == "same-origin"
    assert h["x-frame-options"] == "DENY"
    assert csp(response)["frame-ancestors"] == ["'none'"]
    assert "strict-transport-security" not in h  # local http: the test settings' cookies are not secure


def raw_get(client, path: str, accept_encoding: str | None, **headers) -> tuple:
    """The response and its body as they went over the wire (httpx would decode gzip); no Accept-Encoding at all
    when `accept_encoding` is None (httpx sends one by default)."""
    request = client.build_request("GET", path, headers=headers)
    if accept_encoding is None:
        del request.headers["accept-encoding"]
    else:
        request.headers["accept-encoding"] = accept_encoding
    r = client.send(request, stream=True)
    try:
        return r, b"".join(r.iter_raw())
    finally:
        r.close()


def test_index_html_gets_the_strict_csp(client):
    for path in ("/", "/admin/versions/0a1b2c"):  # the file and the SPA fallback
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert_hardened(r)
        assert r.headers["content-security-policy"] == WEB_CSP
        policy = csp(r)
        assert policy["default-src"] == ["'self'"] and policy["script-src"] == ["'self'"]
        assert policy["object-src"] == ["'none'"] and policy["base-uri"] == ["'self'"]
        assert policy["form-action"] == ["'self'"]
        assert not any("unsafe" in v for values in policy.values() for v in values)
        assert "camera=()" in r.headers["permissions-policy"]
        assert r.headers["cache-control"] == "no-cache" and r.headers["vary"] == "Accept-Encoding"
    docs = client.get("/docs")  # FastAPI's Swagger UI: CDN scripts and an inline start-up, but never framed
    assert docs.status_code == 200 and docs.headers["content-security-policy"] == DOCS_CSP
    assert csp(docs)["frame-ancestors"] == ["'none'"] and docs.headers["x-frame-options"] == "DENY"


def test_api_json_and_errors_keep_their_shapes_and_get_the_headers(client):
    ok = client.get("/health")
    assert ok.status_code == 200 and ok.json() == {"status": "ok"}
    assert_hardened(ok)
    assert ok.headers["content-security-policy"] == API_CSP and "permissions-policy" not in ok.headers

    for r, status, code in [
        (client.get("/api/no-such-endpoint"), 404, "not_found"),  # the SPA route's JSON 404
        (client.post("/v1/chat/completions", json={"model": "m", "messages": []}), 401, None),  # the OpenAI API: no key
        (client.post("/api/test-crash"), 500, "internal_error"),  # unhandled: Starlette's outermost handler
    ]:
        assert r.status_code == status, r.text
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and (code is None or error["code"] == code)
        assert_hardened(r)
        assert r.headers["content-security-policy"] == API_CSP


def test_a_precompressed_asset_goes_out_gzip_encoded_as_the_exact_bytes(client, dist):
    original, encoded = (dist / ASSET).read_bytes(), (dist / (ASSET + ".gz")).read_bytes()
    for accept in ("gzip", "br;q=1.0, gzip;q=0.8, *;q=0.1", "*", "deflate, gzip"):
        r, body = raw_get(client, "/" + ASSET, accept)
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip", accept
        assert body == encoded and gzip.decompress(body) == original
        assert int(r.headers["content-length"]) == len(encoded)
        assert r.headers["content-type"] == "text/javascript; charset=utf-8"
        assert r.headers["vary"] == "Accept-Encoding"
        assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
        assert_hardened(r)
        assert r.headers["content-security-policy"] == API_CSP  # a script, not a document


def test_identity_when_the_client_does_not_accept_gzip(client, dist):
    original = (dist / ASSET).read_bytes()
    for accept in (None, "", "identity", "gzip;q=0", "br", "*;q=0, identity", "gzip;q=0.5, identity"):
        r, body = raw_get(client, "/" + ASSET, accept)
        assert r.status_code == 200 and "content-encoding" not in r.headers, accept
        assert body == original and int(r.headers["content-length"]) == len(original)
        assert r.headers["vary"] == "Accept-Encoding"
    # A file the build left uncompressed is sent as it is, whatever the client accepts.
    r, body = raw_get(client, "/" + SMALL, "gzip, br")
    assert "content-encoding" not in r.headers and body == (dist / SMALL).read_bytes()
    assert r.headers["vary"] == "Accept-Encoding" and r.headers["content-type"].startswith("text/css")


def test_each_encoding_revalidates_with_its_own_etag(client):
    plain, _ = raw_get(client, "/" + ASSET, "identity")
    zipped, _ = raw_get(client, "/" + ASSET, "gzip")
    assert plain.headers["etag"] != zipped.headers["etag"]
    r, body = raw_get(client, "/" + ASSET, "gzip", **{"if-none-match": zipped.headers["etag"]})
    assert r.status_code == 304 and body == b""
    assert r.headers["etag"] == zipped.headers["etag"] and r.headers["vary"] == "Accept-Encoding"
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    # The identity representation's tag does not validate the gzip one.
    r, body = raw_get(client, "/" + ASSET, "gzip", **{"if-none-match": plain.headers["etag"]})
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip" and body
    index = client.get("/")
    again = client.get("/", headers={"if-none-match": f'W/{index.headers["etag"]}, "other"'})
    assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"
    # A browser merges a 304's headers into the page it cached: no CSP that would replace the page's own.
    assert "content-security-policy" not in again.headers and again.headers["x-frame-options"] == "DENY"


def test_hsts_only_when_cookies_are_secure(settings, tmp_path_factory, dist):
    _, secure = make_client(settings, tmp_path_factory, dist, cookie_secure=True)
    with secure:
        for path in ("/", "/health", "/api/no-such-endpoint"):
            assert secure.get(path).headers["strict-transport-security"] == HSTS
