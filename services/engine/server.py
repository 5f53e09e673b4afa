"""The engine's HTTP server: the internal token stream for the gateway, OpenAI endpoints, health, metrics."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from services.common.http_limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, RequestLimits
from services.common.internal_auth import InternalAuthMiddleware
from services.common.lora_format import AdapterFormatError, content_id as adapter_content_id
from services.common.streaming import ClosingStreamingResponse
from services.common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    Usage,
    error_body,
    error_of,
    validation_error_body,
)
from services.common.openai_serving import ChoiceStream, collect, merge, plan_request_async, stream_sse
from services.common.wire import CLAMPED_HEADER, FAULT_ENGINE, FAULT_HEADER, FAULT_REQUEST, EngineUnavailable
from services.common.prompting import PromptBuilder
from services.engine.async_engine import AsyncEngine
from services.engine.engine import RequestOutput
from services.engine.lora.sources import AdapterSources
from services.engine.sequence import AdapterRef, InvalidRequest, Priority, SamplingParams

log = logging.getLogger("mplex.engine.server")


class AdapterSpec(BaseModel):
    content_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str = ""
    uri: str | None = None


class GenerateRequest(BaseModel):
    """Internal stream request from the gateway: already tokenized, already authorized."""

    request_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    priority: str | int | None = None
    cache_salt: str = Field(default="", max_length=256, pattern=r"^[\x21-\x7e]*$")
    adapter: AdapterSpec | None = None
    client_request_id: str | None = Field(default=None, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    # Who the request is for and its plan's share weight: set by the gateway from the authenticated key,
    # never by a client (this endpoint needs the platform credential). Fair sharing and per-tenant metrics.
    tenant: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9._:-]*$")
    weight: float = Field(default=1.0, gt=0, le=1000)


class LoadAdapterRequest(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")
    path: str = Field(min_length=1, description="local directory or storage URI holding the PEFT files")
    content_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


def _sampling_from(d: dict[str, Any]) -> SamplingParams:
    """The internal request's sampling object; SamplingParams checks every type and range itself."""
    allowed = set(SamplingParams.__dataclass_fields__)
    unknown = set(d) - allowed
    if unknown:
        raise InvalidRequest(f"unknown sampling fields: {sorted(unknown)}", "sampling")
    kw = dict(d)
    for key in ("stop", "stop_token_ids"):
        if key in kw:
            if kw[key] is not None and not isinstance(kw[key], list):
                raise InvalidRequest(f"sampling.{key} must be a list", f"sampling.{key}")
            kw[key] = tuple(kw[key] or ())
    return SamplingParams(**kw)


def _logprob_items(engine, out: RequestOutput) -> list[dict[str, Any]] | None:
    if out.logprobs is None:
        return None
    tok = engine.tokenizer
    return [
        {
            "token": tok.token_text(lp.token_id),
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "top": [{"token": tok.token_text(t), "token_id": t, "logprob": v} for t, v in lp.top],
        }
        for lp in out.logprobs
    ]


def _usage(out: RequestOutput) -> Usage:
    return Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


def create_app(engine: AsyncEngine, *, engine_tokens: Sequence[str], registry_url: str | None = None,
               advertise_url: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> FastAPI:
    """`engine_tokens`: the accepted platform credentials (services.common.internal_auth), required on every
    endpoint but the probes."""
    core = engine.engine
    builder = PromptBuilder(core.config.model_dir)
    model_name = core.config.model_name
    adapters_by_name: dict[str, AdapterRef] = {}
    sources = AdapterSources.of(core.config.adapter_stores, core.adapters.cache_dir if core.adapters else None)

    stop_heartbeat = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        beat = None
        if registry_url and advertise_url:
            from services.engine.registry import heartbeat

            beat = asyncio.create_task(heartbeat(engine, registry_url, advertise_url, stop_heartbeat))
        yield
        stop_heartbeat.set()  # leave the registry first so the gateway stops routing here, then drain
        if beat is not None:
            await beat
        engine.shutdown()

    app = FastAPI(title="Multiplex engine", lifespan=lifespan)
    app.add_middleware(InternalAuthMiddleware, tokens=engine_tokens)
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes)
    app.state.engine = engine
    app.state.draining = False

    # Every error says whose fault it was (FAULT_HEADER): the gateway retries on another engine only
    # when this engine could not serve (EngineUnavailable), never a request that failed on its own.
    request_fault = {FAULT_HEADER: FAULT_REQUEST}

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest):
        return JSONResponse(error_of(exc), status_code=exc.status, headers=request_fault)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return JSONResponse(validation_error_body(exc.errors()), 400, headers=request_fault)

    @app.exception_handler(AdapterFormatError)
    async def _bad_adapter(_: Request, exc: AdapterFormatError):
        return JSONResponse(error_body(exc.message, "invalid_request_error", exc.field, exc.code), 400, headers=request_fault)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, exc: EngineUnavailable):
        headers = {FAULT_HEADER: FAULT_ENGINE}
        if exc.retry_after is not None:
            headers["retry-after"] = str(exc.retry_after)
        return JSONResponse(error_of(exc), exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Raised while handling this one request (the step loop has its own isolation): its fault.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"the engine failed while handling this request ({type(exc).__name__})",
                                       "server_error", None, "request_failed"), 500, headers=request_fault)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "dead"}, 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not engine.alive or app.state.draining:
            return JSONResponse({"ready": False, "draining": app.state.draining}, 503)
        return {"ready": True, "model": model_name}

    @app.post("/drain")
    async def drain():
        """Stop taking new requests (pod preStop): leave the registry; in-flight streams finish."""
        app.state.draining = True
        stop_heartbeat.set()
        return {"draining": True, "in_flight": engine.num_in_flight}

    def refuse_if_draining() -> None:
        if app.state.draining:
            raise EngineUnavailable("this engine is draining; retry on another engine", code="engine_draining")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = [{"id": model_name, "object": "model", "created": 0, "owned_by": "multiplex"}]
        data += [{"id": n, "object": "model", "created": 0, "owned_by": "multiplex", "parent": model_name, "root": r.content_id}
                 for n, r in sorted(adapters_by_name.items())]
        return {"object": "list", "data": data}

    @app.post("/internal/v1/adapters")
    async def load_adapter(req: LoadAdapterRequest):
        """Load (validate + host-cache) an adapter and make it servable by name on this engine."""
        if core.adapters is None:
            raise InvalidRequest("this engine serves no adapters", "name", status=404)
        path = sources.confine(req.path, "path")  # a resolved local path, or a URL in the object store
        cid = req.content_id
        if cid is None:
            if "://" in path:
                raise InvalidRequest("content_id is required for remote adapter URIs", "content_id")
            cid = await asyncio.to_thread(adapter_content_id, path)
        ref = AdapterRef(cid, req.name, path)
        weights = await asyncio.to_thread(core.adapters.load_sync, ref)
        adapters_by_name[req.name] = ref
        return {"name": req.name, "content_id": cid, "rank": weights.max_rank,
                "target_modules": weights.target_modules, "bytes": weights.nbytes}

    @app.get("/internal/v1/adapters")
    async def list_adapters():
        def view(e):
            a = e.adapters
            slots = a.slot_owners() if a else []
            return {"host": [w.content_id for w in (a.resident() if a else [])], "slots": slots}

        state = await engine.call(view)
        return {
            "data": [{"name": n, "content_id": r.content_id, "host_resident": r.content_id in state["host"],
                      "slot": state["slots"].index(r.content_id) if r.content_id in state["slots"] else None}
                     for n, r in sorted(adapters_by_name.items())],
            "slots_total": len(state["slots"]),
        }

    @app.delete("/internal/v1/adapters/{name}")
    async def unload_adapter(name: str):
        ref = adapters_by_name.get(name)
        if ref is None:
            raise InvalidRequest(f"adapter {name!r} is not loaded", "name", "not_found", status=404)
        await engine.call(lambda e: e.adapters.unload(ref.content_id))
        adapters_by_name.pop(name, None)
        return {"name": name, "unloaded": True}

    def choice_stream(rid: str, index: int, prompt: list[int], params: SamplingParams, priority: Priority,
                      salt: str, adapter: AdapterRef | None) -> ChoiceStream:
        async def gen():
            async for out in engine.generate(rid, prompt, params, priority=priority, cache_salt=salt, adapter=adapter):
                delta = Delta(index, out.new_text, out.new_token_ids, _logprob_items(core, out), out.finish_reason)
                yield delta, (_usage(out) if out.finished else None)

        return gen()

    async def openai(kind: str, req: ChatCompletionRequest | CompletionRequest, request: Request):
        refuse_if_draining()
        adapter = adapters_by_name.get(req.model)
        if req.model != model_name and adapter is None:
            raise InvalidRequest(f"The model `{req.model}` does not exist.", "model", "model_not_found", status=404)
        plan = await plan_request_async(kind, req, builder, core.max_model_len)
        for job in plan.jobs:
            core.validate(job.prompt_ids, job.params)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        priority = req.priority_class
        streams = [
            choice_stream(f"{rid}-{j.index}", j.index, j.prompt_ids, j.params, priority, "", adapter) for j in plan.jobs
        ]
        items = merge(streams)
        headers = {"x-request-id": rid}
        if req.stream:
            return ClosingStreamingResponse(stream_sse(plan, prefix + rid, model_name, items), media_type="text/event-stream", headers=headers)
        body, _ = await _unless_disconnected(request, collect(plan, prefix + rid, model_name, items))
        return JSONResponse(body, headers=headers)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await openai("completion", req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await openai("chat", req, request)

    @app.post("/internal/v1/generate")
    async def generate(req: GenerateRequest, request: Request):
        """NDJSON: one line per step, {"text","token_ids","logprobs","finish_reason"}; the last adds "usage"."""
        refuse_if_draining()
        params = _sampling_from(req.sampling)
        uri = sources.confine(req.adapter.uri, "adapter.uri") if req.adapter and req.adapter.uri else None
        adapter = AdapterRef(req.adapter.content_id, req.adapter.name, uri) if req.adapter else None
        core.validate(req.prompt_token_ids, params)
        outputs = engine.generate(
            req.request_id, req.prompt_token_ids, params,
            priority=Priority.parse(req.priority), cache_salt=req.cache_salt, adapter=adapter,
            tenant=req.tenant, weight=req.weight,
        )
        ids = {"request_id": req.request_id, "client_request_id": req.client_request_id}
        log.info("request accepted", extra={**ids, "prompt_tokens": len(req.prompt_token_ids),
                                            "adapter": req.adapter.name if req.adapter else None})
        first = await _first(outputs)  # errors before the first token become a proper HTTP error

        async def lines() -> AsyncIterator[bytes]:
            try:
                out = first
                while out is not None:
                    item: dict[str, Any] = {
                        "text": out.new_text,
                        "token_ids": out.new_token_ids,
                        "logprobs": _logprob_items(core, out),
                        "finish_reason": out.finish_reason,
                    }
                    if out.finished:
                        log.info("request finished", extra={**ids, "finish_reason": out.finish_reason,
                                                            "completion_tokens": out.num_output_tokens,
                                                            "cached_tokens": out.num_cached_tokens})
                        item["usage"] = {
                            "prompt_tokens": out.num_prompt_tokens,
                            "cached_tokens": out.num_cached_tokens,
                            "completion_tokens": out.num_output_tokens,
                            "compute_seconds": out.compute_seconds,
                            "engine_id": core.config.engine_id,
                        }
                    yield orjson.dumps(item) + b"\n"
                    try:
                        out = await anext(outputs, None)
                    except (InvalidRequest, EngineUnavailable) as exc:  # failed mid-stream: say so, then end
                        log.warning("request failed mid-stream", extra={**ids, "error": exc.message})
                        fault = FAULT_ENGINE if isinstance(exc, EngineUnavailable) else FAULT_REQUEST
                        yield orjson.dumps({**error_of(exc), "fault": fault}) + b"\n"
                        return
            finally:
                await outputs.aclose()

        headers = {"x-request-id": req.request_id}
        if first is not None and first.clamped_from is not None:
            headers[CLAMPED_HEADER] = str(core.config.scheduler.batch_max_tokens_under_overload)
        return ClosingStreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)

    return app


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None
    except BaseException:
        await outputs.aclose()
        raise


async def _unless_disconnected(request: Request, coro):
    """Run a non-streaming generation, cancelling it (and so aborting it) if the client hangs up. Checked
    every 0.1 s: a hung-up request stops costing batch seats and KV blocks within that."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise asyncio.CancelledError("client disconnected")
