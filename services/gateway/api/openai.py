"""The OpenAI-compatible API: auth -> resolve model -> reserve quota -> route -> stream -> settle + meter."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import ORJSONResponse
from starlette.background import BackgroundTask

from services.common.errors import (
    ApiError,
    BadGatewayError,
    InsufficientQuotaError,
    InternalServerError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
)
from services.common.ids import new_request_id
from services.common.json_route import JsonBodyRoute
from services.common.keys import SCOPE_INFERENCE
from services.common.logging import bind
from services.common.engine_wire import AdapterSpec, GenerateRequest
from services.common.streaming import ClosingStreamingResponse, DirectBody, unless_disconnected
from services.common.openai_protocol import ChatCompletionRequest, CompletionRequest, Usage
from services.common.openai_serving import OpenAIPlan, collect, merge, plan_request_async, stream_sse
from services.common.wire import CLAMPED_HEADER, EngineUnavailable, InvalidRequest
from services.gateway.metering import UsageRecord
from services.gateway.quotas import QuotaExceeded, QuotaUnavailable, Reservation
from services.gateway.resolve import ResolvedModel
from services.gateway.upstream import EngineLost, NoEngineAvailable, StreamResult, UpstreamRefused, open_choice

log = logging.getLogger("mplex.gateway")
router = APIRouter()
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@router.get("/v1/models")
async def list_models(request: Request):
    gw = request.app.state.gw
    principal = await gw.key_auth.authenticate(request.headers.get("authorization"))
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "multiplex"} for name in gw.resolver.bases]
    for name, created in await asyncio.to_thread(gw.resolver.list_ready, principal.tenant_id):
        data.append({"id": name, "object": "model", "created": created, "owned_by": principal.tenant_slug,
                     "parent": gw.resolver.default_base.name})
    return {"object": "list", "data": data}


# The two generation endpoints: FastAPI's body parsing without its per-request dependency solving (json_route.py).
generation = APIRouter(route_class=JsonBodyRoute)


@generation.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    return await _generate("chat", req, request)


@generation.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    return await _generate("completion", req, request)


_SETTLING: set[asyncio.Task] = set()  # Call.finalize's money paths in flight


@dataclasses.dataclass
class Call:
    """One request's bookkeeping, finalized exactly once whatever way it ends. The batch runner
    (services.batch) drives the same object for each line, with no live reservation."""

    gw: Any
    principal: Any
    resolved: ResolvedModel
    plan: OpenAIPlan
    reservation: Reservation | None
    request_id: str
    client_request_id: str | None
    accepted_at: datetime
    t0: float
    results: list[StreamResult]
    done: bool = False
    delivered: bool = False  # the whole response was handed to the client's connection
    service_tier: str = "default"

    def usage(self, server_failed: bool = False) -> Usage:
        """OpenAI semantics: each distinct prompt counts once (once an engine has processed it), every
        choice's output counts. A response the client did not receive whole -- it hung up, or the stream
        failed -- is billed for the completion tokens handed to its connection, no more; one that failed
        on our side (`server_failed`: a 5xx) before handing over any token is not billed at all."""
        u = Usage()
        seen: set[int] = set()
        free = server_failed and not self.delivered and not any(r.sent_tokens for r in self.results)
        for job, r in zip(self.plan.jobs, self.results):
            prompt_key = id(job.prompt_ids)
            if not free and prompt_key not in seen and (r.usage.prompt_tokens or r.engine_id):
                seen.add(prompt_key)
                u.prompt_tokens += len(job.prompt_ids)
                u.cached_tokens += r.usage.cached_tokens
            u.completion_tokens += r.usage.completion_tokens if self.delivered else r.sent_tokens
            u.draft_tokens += r.usage.draft_tokens
            u.accepted_draft_tokens += r.usage.accepted_draft_tokens
        return u

    def sent(self, choice: int, tokens: int) -> None:
        self.results[choice].sent_tokens += tokens

    def first_token_s(self) -> float | None:
        firsts = [r.first_token_at for r in self.results if r.first_token_at is not None]
        return (min(firsts) - self.t0) if firsts else None

    def usage_record(self, u: Usage, status: str, http_status: int, error_code: str | None) -> UsageRecord:
        """The ledger row of this request as it ended (now)."""
        end, ttft = time.monotonic(), self.first_token_s()
        return UsageRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            api_key_id=self.principal.key_id,
            model=self.resolved.requested,
            base_model=self.resolved.base.name,
            adapter_version_id=self.resolved.adapter.version_id if self.resolved.adapter else None,
            prompt_tokens=u.prompt_tokens,
            cached_tokens=min(u.cached_tokens, u.prompt_tokens),
            completion_tokens=u.completion_tokens,
            status=status,
            http_status=http_status,
            created_at=self.accepted_at,
            error_code=error_code,
            client_request_id=self.client_request_id,
            first_token_ms=int(ttft * 1000) if ttft is not None else None,
            finished_ms=int((end - self.t0) * 1000),
            # The engine that served it -- or, for a request lost inside one, the engine that had it.
            engine_id=next((r.engine_id or r.tried_engine_id for r in self.results if r.engine_id or r.tried_engine_id), None),
            compute_us=int(sum(r.compute_seconds for r in self.results) * 1e6),
            service_tier=self.service_tier,
        )

    async def finalize(self, status: str, http_status: int, error_code: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        # The money path runs in a task of its own that a cancellation of this one does not reach: a streamed
        # response's task is cancelled when its client hangs up, and a client that has read `[DONE]` hangs up
        # while this settles the quota and writes the ledger row (tests/gateway/test_spec_usage.py lost that row).
        task = asyncio.ensure_future(self._settle_and_meter(status, http_status, error_code))
        _SETTLING.add(task)  # held until done: a task only the loop refers to may be collected mid-way
        task.add_done_callback(_SETTLING.discard)
        await asyncio.shield(task)

    async def _settle_and_meter(self, status: str, http_status: int, error_code: str | None) -> None:
        gw = self.gw
        u = self.usage(server_failed=http_status >= 500)
        if self.reservation is not None:
            await gw.quotas.settle(self.reservation, u.prompt_tokens + u.completion_tokens)
        rec = self.usage_record(u, status, http_status, error_code)
        ttft = self.first_token_s()
        tpot = ((rec.finished_ms / 1000 - ttft) / (u.completion_tokens - 1)) if ttft is not None and u.completion_tokens > 1 else None
        via = await gw.meter.record(rec)
        m = gw.metrics
        m.prompt_tokens.inc(u.prompt_tokens)
        m.cached_tokens.inc(rec.cached_tokens)
        m.completion_tokens.inc(u.completion_tokens)
        if status == "ok":
            m.observe_generation(ttft, tpot)
        if gw.pricer is not None:
            m.billed.inc(gw.pricer.price_record(rec))
        log.info(
            "request finished",
            extra={"request_id": self.request_id, "client_request_id": self.client_request_id,
                   "tenant": self.principal.tenant, "model": self.resolved.requested, "status": status,
                   "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                   "engine_id": rec.engine_id, "ledger": via},
        )


async def _generate(kind: str, req: ChatCompletionRequest | CompletionRequest, request: Request):
    gw = request.app.state.gw
    t0 = time.monotonic()
    accepted_at = datetime.now(timezone.utc)
    principal = await gw.key_auth.authenticate(request.headers.get("authorization"))
    if SCOPE_INFERENCE not in principal.scopes:
        raise PermissionDeniedError("This API key may not run inference.", code="missing_scope")
    resolved = await gw.resolver.resolve(principal.tenant_id, req.model)
    builder = gw.resolver.builders[resolved.base.name]
    try:
        plan = await plan_request_async(kind, req, builder, resolved.base.max_model_len)
    except InvalidRequest as exc:
        raise ApiError.from_invalid_request(exc) from None
    request_id = new_request_id()
    client_id = request.headers.get("x-client-request-id") or request.headers.get("x-request-id")
    client_id = client_id if client_id and _CLIENT_ID.match(client_id) else None
    bind(request_id=request_id, client_request_id=client_id, tenant=principal.tenant)
    engines = await gw.registry.engines(resolved.base.name)
    # Every engine refused this tenant's class as overloaded a moment ago (Router.refused): the request is refused
    # below like any other that no engine took, but without a quota reservation (two Redis round trips) or an
    # engine exchange -- under overload these refusals come in floods and each must be quick and cheap.
    held = gw.router.held_everywhere([e.id for e in engines], principal.tenant, req.priority_class.name.lower())
    reservation = None if held is not None else await _reserve(gw, principal, plan, request_id)
    call = Call(gw, principal, resolved, plan, reservation, request_id, client_id, accepted_at, t0,
                 [StreamResult() for _ in plan.jobs])
    headers = {"x-request-id": request_id, **(reservation.headers if reservation is not None else {})}
    try:
        if held is not None:
            raise NoEngineAvailable("every engine serving this model refused this tenant's requests as overloaded "
                                    "just now", code="engine_overloaded", retry_after=held)
        direct = DirectBody() if req.stream else None
        items = merge(await open_streams(call, req, engines, direct))
        first = await anext(items)  # failures before any token become HTTP errors (after retries elsewhere)
        clamped = next((r.clamped_max_tokens for r in call.results if r.clamped_max_tokens), None)
        if clamped:  # the engine clamped this batch-class request's max_tokens under overload
            headers[CLAMPED_HEADER] = clamped
    except BaseException as exc:
        status, http_status, code = failure(exc)
        err = as_api_error(exc, gw)
        if isinstance(exc, NoEngineAvailable) and isinstance(err, ApiError):
            # Refused before any engine took it: nothing ran, nothing is billed. The client gets its 503 and
            # Retry-After now; the reservation is released and the (zero-token) ledger row written right
            # after the response is sent -- not first, where a refusal waited on a Postgres commit.
            err.background = BackgroundTask(call.finalize, status, http_status, code)
            raise err from None
        await call.finalize(status, http_status, code)
        raise err from None
    response_id = _response_id(kind, request_id)
    if req.stream:
        return ClosingStreamingResponse(_sse_body(call, response_id, req.model, _prepend(first, items), direct),
                                         media_type="text/event-stream", headers=headers, direct=direct)
    try:
        body, _ = await unless_disconnected(request, collect(plan, response_id, req.model, _prepend(first, items)))
    except BaseException as exc:
        status, http_status, code = failure(exc)
        await call.finalize(status, http_status, code)
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise as_api_error(exc, gw) from None
    call.delivered = True
    body["usage"] = call.usage().to_dict()
    # Settle and meter after the response is on the wire: the client does not wait for Postgres.
    return ORJSONResponse(body, headers=headers, background=BackgroundTask(call.finalize, "ok", 200))


async def _reserve(gw, principal, plan: OpenAIPlan, request_id: str) -> Reservation:
    """Hold the request's worst-case tokens and one concurrency slot per choice, or refuse it (429/503)."""
    try:
        return await gw.quotas.reserve(request_id, principal.quota_scopes(), plan.worst_case_tokens,
                                       concurrency=len(plan.jobs))  # one engine sequence per choice
    except QuotaExceeded as exc:
        gw.metrics.quota_rejections.labels(reason=exc.window).inc()
        if exc.is_budget:
            raise InsufficientQuotaError(
                "You exceeded your monthly token budget; raise the budget or wait for the next month.",
                headers=exc.headers) from None
        raise RateLimitError(exc.message, code="rate_limit_exceeded", headers=exc.headers) from None
    except QuotaUnavailable as exc:
        gw.metrics.quota_rejections.labels(reason="quota_store_down").inc()
        raise ServiceUnavailableError(f"Quota service unavailable ({exc}); requests are refused until it returns.",
                                      code="quota_unavailable") from None


async def open_streams(call: Call, req, engines: list | None = None, direct: DirectBody | None = None
                       ) -> list[AsyncIterator]:
    """One engine stream per choice, each trying the engines in the router's order for this request. `direct`: the
    streamed response's fast path (one choice only)."""
    gw, plan, principal = call.gw, call.plan, call.principal
    if engines is None:
        engines = await gw.registry.engines(call.resolved.base.name)
    if not engines:
        raise NoEngineAvailable(f"no engine is serving {call.resolved.base.name}")
    adapter = call.resolved.adapter
    affinity = adapter.content_sha256.encode() if adapter else (principal.cache_salt + repr(plan.jobs[0].prompt_ids[:32])).encode()
    order = gw.router.order(engines, affinity, adapter.content_sha256 if adapter else None)
    streams = []
    first_of_prompt: set[int] = set()
    for job, result in zip(plan.jobs, call.results):
        counts_prompt = id(job.prompt_ids) not in first_of_prompt
        first_of_prompt.add(id(job.prompt_ids))
        rid = call.request_id if len(plan.jobs) == 1 else f"{call.request_id}.{job.index}"
        wire = _wire_request(gw, principal, req, job, adapter, rid, call.client_request_id)
        streams.append(_choice(gw, order, wire, job.index, result, counts_prompt, coalesce=not req.stream,
                               direct=direct if len(plan.jobs) == 1 else None))
    return streams


async def _sse_body(call: Call, response_id: str, model: str, items: AsyncIterator,
                    direct: DirectBody | None = None) -> AsyncIterator[bytes]:
    """The SSE stream; the request is settled and metered however it ends (done, failed, hung up)."""
    gw = call.gw
    outcome = ["cancelled", 499, "client_disconnected"]

    def failed(exc: BaseException) -> None:  # the stream ends with an error event
        gw.metrics.upstream_errors.labels(kind="stream").inc()
        outcome[:] = failure(exc)
        log.warning("stream %s failed: %s", call.request_id, exc)

    try:
        async for chunk in stream_sse(call.plan, response_id, model, items, on_sent=call.sent, on_error=failed,
                                      direct=direct):
            yield chunk
        if outcome[0] == "cancelled":
            call.delivered = True
            outcome[:] = ["ok", 200, None]
    finally:
        await call.finalize(*outcome)


def _wire_request(gw, principal, req, job, adapter, request_id: str, client_id: str | None) -> GenerateRequest:
    """One choice as the engine's GenerateRequest, from values the gateway already validated."""
    return GenerateRequest.model_construct(
        request_id=request_id,
        prompt_token_ids=job.prompt_ids,
        sampling=job.params,
        priority=req.priority_class.name.lower(),
        cache_salt=principal.cache_salt,
        # Fair sharing on the engines: who it is for and its plan's weight (never client-set).
        tenant=principal.tenant,
        weight=gw.settings.plan_weight(principal.plan),
        client_request_id=client_id,
        adapter=(AdapterSpec.model_construct(content_id=adapter.content_sha256, name=f"{adapter.name}@{adapter.version}",
                                             uri=adapter.storage_uri) if adapter else None),
    )


def _choice(gw, order, wire: GenerateRequest, index: int, result: StreamResult, counts_prompt: bool,
            coalesce: bool = False, direct: DirectBody | None = None):
    stream = open_choice(gw.http, gw.router, order, wire, index, result, time.monotonic, coalesce, gw.streams, direct)
    if counts_prompt:
        return stream  # as it is: a wrapper would cost a hop per step per stream

    async def gen():
        try:
            async for delta, usage in stream:
                if usage is not None:  # a prompt counts once, however many choices it has
                    usage = Usage(0, usage.completion_tokens, 0, usage.draft_tokens, usage.accepted_draft_tokens)
                yield delta, usage
        finally:
            await stream.aclose()

    return gen()


class _prepend:  # noqa: N801 -- used as the generator function it replaced
    """`first`, then what `items` yields: the first item was read to turn early failures into HTTP errors. Not a
    generator: after the first item each step is `items`' own __anext__, without a frame of its own."""

    __slots__ = ("first", "items")

    def __init__(self, first, items: AsyncIterator):
        self.first, self.items = first, items

    def __aiter__(self):
        return self

    def __anext__(self):
        first = self.first
        if first is None:
            return self.items.__anext__()
        self.first = None
        return _ready(first)

    async def aclose(self) -> None:
        await self.items.aclose()


async def _ready(value):
    return value


def _response_id(kind: str, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def failure(exc: BaseException) -> list:
    """(ledger status, HTTP status, error code) of a request that ended with `exc`."""
    if isinstance(exc, asyncio.CancelledError):
        return ["cancelled", 499, "client_disconnected"]
    if isinstance(exc, UpstreamRefused):
        return ["error", exc.status, (exc.body.get("error") or {}).get("code")]
    if isinstance(exc, InvalidRequest):
        return ["error", exc.status, exc.code]
    if isinstance(exc, EngineUnavailable):
        return ["error", exc.status, exc.code]
    return ["error", 500, exc.__class__.__name__]


def as_api_error(exc: BaseException, gw) -> BaseException:
    if isinstance(exc, UpstreamRefused):
        err = exc.body.get("error") or {}
        gw.metrics.upstream_errors.labels(kind="refused").inc()
        message, code = err.get("message", str(exc)), err.get("code")
        if exc.status >= 500:  # the engine failed this request on its own account: not retried elsewhere
            return InternalServerError(message, code=code or "request_failed")
        return ApiError.from_invalid_request(InvalidRequest(message, err.get("param"), code, exc.status))
    if isinstance(exc, NoEngineAvailable):
        retry = {"retry-after": str(exc.retry_after or 1)}
        if exc.code == "engine_overloaded":  # refused up front by every engine: it would have missed its SLO
            gw.metrics.upstream_errors.labels(kind="overloaded").inc()
            return ServiceUnavailableError(
                f"The engines serving this model are overloaded; retry after {retry['retry-after']}s. ({exc.message})",
                code="engine_overloaded", headers=retry)
        gw.metrics.upstream_errors.labels(kind="connect").inc()
        return ServiceUnavailableError(f"No engine could serve the request right now: {exc}", code="no_engine_available",
                                       headers=retry)
    if isinstance(exc, EngineLost):
        gw.metrics.upstream_errors.labels(kind="stream").inc()
        return BadGatewayError(exc.message, code=exc.code)
    if isinstance(exc, EngineUnavailable):  # an engine fault reported inside the stream
        gw.metrics.upstream_errors.labels(kind="stream").inc()
        return ServiceUnavailableError(exc.message, code=exc.code, headers={"retry-after": "1"})
    return exc
