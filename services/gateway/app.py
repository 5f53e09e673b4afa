"""The gateway's FastAPI app: wiring only (routers, error shapes, health, metrics, the web app)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.billing.pricing import Pricer
from services.common.errors import ApiError
from services.common.gc_tuning import freeze_startup_heap
from services.common.http_limits import RequestLimits
from services.common.logging import FASTAPI_TELEMETRY
from services.common.openai_protocol import error_body, validation_error_body
from services.common.settings import Settings
from services.common.streaming import install_body_send
from services.common.wire import InvalidRequest
from services.gateway.api import (
    adapters,
    admin,
    admin_engines,
    auth,
    batches,
    finance,
    openai,
    playground,
    tenant,
    tenant_batches,
    tenant_usage,
)
from services.gateway.security import install_security_headers
from services.gateway.state import Gateway, build_gateway, warm_redis_pool
from services.gateway.static import mount_web

log = logging.getLogger("mplex.gateway")
WEB_DIST = Path(__file__).resolve().parents[2] / "web" / "dist"
# Adapter and batch file uploads stream their bodies under their own (larger) limits.
UPLOAD_PATHS = (r"/api/tenant/adapters", r"/api/admin/tenants/[^/]+/adapters", r"/v1/files")


class _MetricsMiddleware:
    """Counts requests by route template and status, and times them to the last byte (pure ASGI:
    Starlette's BaseHTTPMiddleware costs a task and a queue per request)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            if path not in ("/metrics", "/health", "/ready") and "app" in scope:
                scope["app"].state.gw.metrics.observe_request(path, status[0], time.perf_counter() - t0)


def create_app(settings: Settings, *, gateway: Gateway | None = None, web_dist: Path | None = WEB_DIST) -> FastAPI:
    """The gateway's app: wiring only. `gateway`: ready-made state (tests); otherwise built at startup."""
    app = FastAPI(title="Multiplex gateway", lifespan=_lifespan(settings, gateway), version="1",
                  telemetry=FASTAPI_TELEMETRY)
    _install_error_handlers(app)
    app.add_middleware(_MetricsMiddleware)
    # Adapter uploads stream their bodies under the adapter pipeline's own (much larger) limits.
    app.add_middleware(RequestLimits, max_body_bytes=settings.max_request_bytes, max_header_bytes=settings.max_header_bytes,
                       streaming_paths=UPLOAD_PATHS)
    install_security_headers(app, hsts=settings.session_cookie_secure)
    install_body_send(app)  # last: outside every middleware
    app.include_router(openai.generation)  # first: the hot routes are matched before any other
    app.include_router(_probes)
    for module in (openai, batches, auth, tenant, tenant_batches, tenant_usage, playground, admin, admin_engines, finance, adapters):
        app.include_router(module.router)
    if web_dist is not None:
        mount_web(app, web_dist)
    return app


def _lifespan(settings: Settings, gateway: Gateway | None):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gw = gateway or _build(settings)
        gw.pricer = Pricer(gw.session_factory)
        app.state.gw = gw
        gw.meter.start()
        await warm_redis_pool(gw.redis)
        freeze_startup_heap()  # every full collection walked the start-up heap: 82-131 ms stalls (gc_tuning.py)
        yield
        await gw.aclose()

    return lifespan


def _build(settings: Settings) -> Gateway:
    from services.common.embedded import resolve_urls

    urls = resolve_urls(settings)
    model_dir = settings.base_model_dir
    if model_dir is None:
        from services.modelkit import ensure_demo

        model_dir = ensure_demo(settings.home, progress=False).base_dir
    return build_gateway(settings, database_url=urls.database_url, redis_url=urls.redis_url, base_model_dir=model_dir)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        # `background`: work the route left for after the response (a refused request's settle and ledger row).
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers,
                            background=exc.background)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest):
        err = ApiError.from_invalid_request(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return JSONResponse(validation_error_body(exc.errors()), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("The server had an error while processing your request.", "server_error", None, "internal_error"), 500)


_probes = APIRouter()


@_probes.get("/health", include_in_schema=False)
async def health():
    return {"status": "ok"}


@_probes.get("/ready", include_in_schema=False)
async def ready(request: Request):
    gw: Gateway = request.app.state.gw
    checks = {}
    try:
        await gw.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # reported, not raised: this endpoint's job is to say what is down
        checks["redis"] = f"down: {exc.__class__.__name__}"
    try:
        def ping() -> None:
            with gw.session_factory() as s:
                s.execute(text("SELECT 1"))

        await asyncio.to_thread(ping)
        checks["postgres"] = "ok"
    except Exception as exc:  # same: report which dependency is down
        checks["postgres"] = f"down: {exc.__class__.__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ok, "checks": checks}, 200 if ok else 503)


@_probes.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
