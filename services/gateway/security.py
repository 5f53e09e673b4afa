"""Security headers on every gateway response: a strict CSP and no framing for the web app, nosniff and a
referrer policy everywhere, HSTS when the deployment is HTTPS-only. Pure ASGI: only the response start is
touched, so SSE bodies pass through unbuffered."""
from __future__ import annotations

from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The built app (web/dist) is one module script and one stylesheet from 'self'; Preact and Chart.js set styles
# through the CSSOM (element.style), which style-src does not govern, so no 'unsafe-inline' anywhere. The
# favicon is `data:,` (no request for /favicon.ico).
WEB_CSP = "; ".join((
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "font-src 'self'",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-src 'none'",
    "frame-ancestors 'none'",
))
# FastAPI's /docs and /redoc pages load Swagger UI / ReDoc from jsDelivr and start them with an inline script.
# They get their own policy (still never framed) rather than loosening the app's.
DOCS_CSP = "; ".join((
    "default-src 'self'",
    "script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net",
    "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net https://fonts.googleapis.com",
    "font-src 'self' https://fonts.gstatic.com",
    "img-src 'self' data: https://fastapi.tiangolo.com",
    "worker-src 'self' blob:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))
# JSON, SSE, CSV, metrics: nothing in them may load or run anything if a browser renders one.
API_CSP = "default-src 'none'; frame-ancestors 'none'"
# Features the app never uses, turned off for it and anything it could embed (only names Chromium knows:
# an unknown one is logged as a console error on every page).
PERMISSIONS_POLICY = ("accelerometer=(), camera=(), display-capture=(), geolocation=(), gyroscope=(), hid=(), "
                      "magnetometer=(), microphone=(), midi=(), payment=(), serial=(), usb=()")
HSTS = "max-age=31536000; includeSubDomains"


HeaderList = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class SecurityHeaders:
    """Which headers a response gets. `hsts`: the deployment is HTTPS-only (the settings' secure cookies);
    `docs_paths`: FastAPI's interactive docs, which get DOCS_CSP instead of WEB_CSP."""

    hsts: bool
    docs_paths: frozenset[str] = frozenset()
    _sets: dict[str, HeaderList] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        common: HeaderList = ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin"),
                           (b"x-frame-options", b"DENY"))
        if self.hsts:
            common += ((b"strict-transport-security", HSTS.encode()),)
        html: HeaderList = ((b"permissions-policy", PERMISSIONS_POLICY.encode()),)
        object.__setattr__(self, "_sets", {
            "not_modified": common,
            "other": common + ((b"content-security-policy", API_CSP.encode()),),
            "web": common + ((b"content-security-policy", WEB_CSP.encode()),) + html,
            "docs": common + ((b"content-security-policy", DOCS_CSP.encode()),) + html,
        })

    def for_response(self, path: str, status: int, content_type: bytes) -> HeaderList:
        if status == 304:
            # A cache merges a 304's headers into the response it stored: a CSP chosen here, with no body and
            # no Content-Type to go by, would replace the stored page's own.
            return self._sets["not_modified"]
        if not content_type.startswith(b"text/html"):
            return self._sets["other"]
        return self._sets["docs" if path in self.docs_paths else "web"]


class SecurityHeadersMiddleware:
    """Adds SecurityHeaders to each HTTP response start; a header the route set itself is left as it is."""

    def __init__(self, app: ASGIApp, headers: SecurityHeaders):
        self.app = app
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = list(message.get("headers", ()))
                present = {name.lower() for name, _ in raw}
                content_type = next((v for n, v in raw if n.lower() == b"content-type"), b"")
                ours = self.headers.for_response(scope["path"], message["status"], content_type)
                raw += [(name, value) for name, value in ours if name not in present]
                message = {**message, "headers": raw}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install_security_headers(app: Starlette, *, hsts: bool) -> None:
    """Wrap the app's whole middleware stack. `add_middleware` would sit inside Starlette's
    ServerErrorMiddleware, and the 500 it sends for an unhandled error would go out without the headers."""
    docs = frozenset(p for p in (getattr(app, "docs_url", None), getattr(app, "redoc_url", None)) if p)
    headers = SecurityHeaders(hsts=hsts, docs_paths=docs)
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: SecurityHeadersMiddleware(build(), headers)  # type: ignore[method-assign]
