"""Serves the built web app: hashed assets cached for a year, index.html revalidated, SPA fallback.

Files are sent brotli- or gzip-encoded when the client accepts it and the build wrote a `.br` / `.gz` sibling
(web/vite.config.ts compresses once, at build time); otherwise as they are. Each encoding is its own file, so
Content-Length, ETag and Range come from FileResponse unchanged, and a matching If-None-Match gets a 304.
"""
from __future__ import annotations

import mimetypes
from email.utils import parsedate_to_datetime
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import Headers

from services.common.openai_protocol import error_body

_API_PREFIXES = ("/v1/", "/api/", "/internal/", "/metrics", "/health", "/ready")
IMMUTABLE = "public, max-age=31536000, immutable"
# Preference order on equal q-values: brotli is ~15% smaller than gzip on the bundle.
ENCODINGS = (("br", ".br"), ("gzip", ".gz"))


def mount_web(app: FastAPI, dist: Path) -> None:
    dist = dist.resolve()

    @app.get("/{path:path}", include_in_schema=False)
    async def web(path: str, request: Request) -> Response:
        if ("/" + path).startswith(_API_PREFIXES):
            return JSONResponse(error_body(f"Unknown endpoint /{path}", "invalid_request_error", None, "not_found"), 404)
        index = dist / "index.html"
        if not index.exists():
            return JSONResponse(error_body("The web app is not built (run `make web`).", "invalid_request_error", None, "not_found"), 404)
        target = (dist / path).resolve()
        if path and target.is_file() and target.is_relative_to(dist):
            immutable = target.is_relative_to(dist / "assets")
            return file_response(target, request.headers, IMMUTABLE if immutable else "no-cache")
        return file_response(index, request.headers, "no-cache")


def file_response(path: Path, request_headers: Headers, cache_control: str) -> Response:
    encoding, served = choose_encoding(path, request_headers.get("accept-encoding", ""))
    headers = {"cache-control": cache_control, "vary": "Accept-Encoding"}
    if encoding:
        headers["content-encoding"] = encoding
    media_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    response = FileResponse(served, headers=headers, media_type=media_type, stat_result=served.stat())
    if not_modified(response.headers, request_headers):
        keep = ("cache-control", "etag", "last-modified", "vary")
        return Response(status_code=304, headers={k: response.headers[k] for k in keep})
    return response


def choose_encoding(path: Path, accept_encoding: str) -> tuple[str | None, Path]:
    """The best encoding the client accepts (RFC 9110 q-values) that has a precompressed sibling of `path`."""
    q = accepted_codings(accept_encoding)
    identity_q = q.get("identity", q.get("*", 1.0))
    best: tuple[float, str | None, Path] = (identity_q, None, path)
    for coding, suffix in ENCODINGS:
        weight = q.get(coding, q.get("*", 0.0))
        if weight > best[0] or (weight > 0 and weight == best[0] and best[1] is None):
            variant = path.with_name(path.name + suffix)
            if variant.is_file():
                best = (weight, coding, variant)
    return best[1], best[2]


def accepted_codings(header: str) -> dict[str, float]:
    """`gzip;q=0.8, br, *;q=0` -> {"gzip": 0.8, "br": 1.0, "*": 0.0}; a malformed q counts as 0."""
    out: dict[str, float] = {}
    for item in header.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        if not coding:
            continue
        weight = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    weight = 0.0
        out[coding] = weight
    return out


def not_modified(response_headers: Headers, request_headers: Headers) -> bool:
    """RFC 9110 13.2.2: If-None-Match (weak comparison) wins; If-Modified-Since only without it."""
    if_none_match = request_headers.get("if-none-match")
    if if_none_match is not None:
        etag = response_headers["etag"].removeprefix("W/")
        tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
        return "*" in tags or etag in tags
    if_modified_since = request_headers.get("if-modified-since")
    if if_modified_since:
        try:
            return parsedate_to_datetime(response_headers["last-modified"]) <= parsedate_to_datetime(if_modified_since)
        except (TypeError, ValueError):
            return False
    return False
