"""Serves the built web app: hashed assets cached for a year, index.html revalidated, SPA fallback."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from services.common.openai_protocol import error_body

_API_PREFIXES = ("/v1/", "/api/", "/internal/", "/metrics", "/health", "/ready")


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
            cache = "public, max-age=31536000, immutable" if immutable else "no-cache"
            return FileResponse(target, headers={"cache-control": cache})
        return FileResponse(index, headers={"cache-control": "no-cache"})
