"""The engine's HTTP server: the internal token stream for the gateway, OpenAI endpoints, adapter loading,
health, metrics. `EngineServer` holds the state the endpoints share; `create_app` only wires it."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from pathlib import Path
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from services.common.engine_wire import (COALESCE_HEADER, GENERATE_PATH, STREAMS_PATH, WIRE_HEADER, GenerateRequest, StreamItem, StreamUsage,
                                        check_wire_version)
from services.common.gc_tuning import freeze_startup_heap
from services.common.http_limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, RequestLimits
from services.common.internal_auth import InternalAuthMiddleware
from services.common.json_route import JsonBodyRoute
from services.common.logging import FASTAPI_TELEMETRY
from services.common.lora_format import AdapterFormatError, content_id as adapter_content_id
from services.common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    Usage,
)
from services.common.openai_serving import ChoiceStream, collect, merge, plan_request_async, stream_sse
from services.common.prompting import PromptBuilder
from services.common.streaming import ClosingStreamingResponse, DirectBody, install_body_send, unless_disconnected
from services.common.wire import CLAMPED_HEADER, EngineUnavailable
from services.engine.async_engine import AsyncEngine
from services.engine.core_client import CoreClient
from services.engine.engine import RequestOutput
from services.engine.http_errors import error_parts
from services.engine.lora.sources import AdapterSources
from services.engine.sequence import AdapterRef, InvalidRequest, Priority, SamplingParams
from services.engine.streams import serve_streams

log = logging.getLogger("mplex.engine.server")


class LoadAdapterRequest(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")
    path: str = Field(min_length=1, description="local directory or storage URI holding the PEFT files")
    content_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


def create_app(engine: AsyncEngine | CoreClient, *, engine_tokens: Sequence[str], registry_url: str | None = None,
               advertise_url: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> FastAPI:
    """`engine_tokens`: the accepted platform credentials (services.common.internal_auth), required on every
    endpoint but /health."""
    server = EngineServer(engine, registry_url=registry_url, advertise_url=advertise_url)
    app = FastAPI(title="Multiplex engine", lifespan=server.lifespan, telemetry=FASTAPI_TELEMETRY)
    app.add_middleware(InternalAuthMiddleware, tokens=engine_tokens)
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes)
    app.state.engine = engine
    _install_error_handlers(app)
    for method, path, endpoint in (
        ("GET", "/health", server.health), ("GET", "/ready", server.ready), ("POST", "/drain", server.drain),
        ("GET", "/metrics", server.metrics), ("GET", "/v1/models", server.models),
        ("POST", "/internal/v1/adapters", server.load_adapter), ("GET", "/internal/v1/adapters", server.list_adapters),
        ("DELETE", "/internal/v1/adapters/{name}", server.unload_adapter),
    ):
        app.add_api_route(path, endpoint, methods=[method])
    # The OpenAI endpoints answer every request of a direct client: FastAPI's parsing and errors without its
    # per-request dependency solving (services.common.json_route). FastAPI.add_api_route takes no route class.
    for path, endpoint in (("/v1/completions", server.completions), ("/v1/chat/completions", server.chat)):
        app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=JsonBodyRoute)
    # The wire version is checked before the body is validated: a newer gateway's body may not parse here.
    app.add_api_route(GENERATE_PATH, server.generate, methods=["POST"], dependencies=[Depends(_wire_version)])

    async def streams(websocket: WebSocket) -> None:
        await serve_streams(server, websocket)

    app.add_api_websocket_route(STREAMS_PATH, streams)
    install_body_send(app)
    return app


async def _wire_version(request: Request) -> None:  # async: a sync dependency costs a thread-pool hop per request
    check_wire_version(request.headers.get(WIRE_HEADER))


def _install_error_handlers(app: FastAPI) -> None:
    async def _known(_: Request, exc: Exception):
        status, headers, body = error_parts(exc)
        return JSONResponse(body, status, headers=headers)

    for kind in (InvalidRequest, RequestValidationError, AdapterFormatError, EngineUnavailable):
        app.add_exception_handler(kind, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return await _known(request, exc)


class EngineServer:
    """What the endpoints share: the engine, its tokenizer, the adapters loaded by name, draining."""

    def __init__(self, engine: AsyncEngine | CoreClient, *, registry_url: str | None, advertise_url: str | None):
        self.engine = engine  # in-process (AsyncEngine) or the core in another process (CoreClient): one surface
        self.builder: PromptBuilder | None = None  # set when the engine is open (a core process says what it serves)
        self.model_name = ""
        self.adapters_by_name: dict[str, AdapterRef] = {}
        self.sources: AdapterSources | None = None
        self.registry_url, self.advertise_url = registry_url, advertise_url
        self.draining = False
        self.stop_heartbeat = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await self.engine.open()
        info = self.engine.info
        self.builder = PromptBuilder(Path(info.model_dir))
        self.model_name = info.model_name
        self.sources = AdapterSources.of(info.adapter_stores, Path(info.adapter_cache_dir) if info.adapter_cache_dir else None)
        beat = None
        if self.registry_url and self.advertise_url:
            from services.engine.registry import heartbeat

            beat = asyncio.create_task(heartbeat(self.engine, self.registry_url, self.advertise_url, self.stop_heartbeat))
        freeze_startup_heap()
        yield
        self.stop_heartbeat.set()  # leave the registry first so the gateway stops routing here, then drain
        if beat is not None:
            await beat
        await self.engine.close()

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise EngineUnavailable("this engine is draining; retry on another engine", code="engine_draining")

    # -- probes and operations --------------------------------------------------------------------------
    async def health(self):
        if not self.engine.alive:
            return JSONResponse({"status": "dead"}, 503)
        return {"status": "ok"}

    async def ready(self):
        if self.engine.alive and not self.draining and await self.engine.op("is_draining"):
            self.draining = True  # another front-end of this engine was told to drain
        if not self.engine.alive or self.draining:
            return JSONResponse({"ready": False, "draining": self.draining}, 503)
        return {"ready": True, "model": self.model_name}

    async def drain(self):
        """Stop taking new requests (pod preStop): on every front-end of this engine -- the drain is the core's,
        which refuses whatever any front-end sends from now on, and the front-end that heartbeats leaves the
        registry within a beat -- while in-flight streams finish."""
        self.draining = True
        self.stop_heartbeat.set()
        in_flight = await self.engine.op("drain")
        return {"draining": True, "in_flight": in_flight}

    async def metrics(self):
        return Response(await self.engine.op("metrics"), media_type=CONTENT_TYPE_LATEST)

    # -- adapters ---------------------------------------------------------------------------------------
    async def models(self):
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "multiplex"}]
        data += [{"id": n, "object": "model", "created": 0, "owned_by": "multiplex", "parent": self.model_name,
                  "root": r.content_id} for n, r in sorted(self.adapters_by_name.items())]
        return {"object": "list", "data": data}

    async def load_adapter(self, req: LoadAdapterRequest):
        """Load (validate + host-cache) an adapter and make it servable by name on this engine."""
        if not self.engine.info.lora_enabled:
            raise InvalidRequest("this engine serves no adapters", "name", status=404)
        path = self.sources.confine(req.path, "path")  # a resolved local path, or a URL in the object store
        cid = req.content_id
        if cid is None:
            if "://" in path:
                raise InvalidRequest("content_id is required for remote adapter URIs", "content_id")
            cid = await asyncio.to_thread(adapter_content_id, path)
        loaded = await self.engine.op("load_adapter", cid, req.name, path)
        self.adapters_by_name[req.name] = AdapterRef(cid, req.name, path)
        return {"name": req.name, "content_id": cid, **loaded}

    async def list_adapters(self):
        state = await self.engine.op("adapter_state")
        return {
            "data": [{"name": n, "content_id": r.content_id, "host_resident": r.content_id in state["host"],
                      "slot": state["slots"].index(r.content_id) if r.content_id in state["slots"] else None}
                     for n, r in sorted(self.adapters_by_name.items())],
            "slots_total": len(state["slots"]),
        }

    async def unload_adapter(self, name: str):
        ref = self.adapters_by_name.get(name)
        if ref is None:
            raise InvalidRequest(f"adapter {name!r} is not loaded", "name", "not_found", status=404)
        await self.engine.op("unload_adapter", ref.content_id)
        self.adapters_by_name.pop(name, None)
        return {"name": name, "unloaded": True}

    # -- the engine's own OpenAI endpoints --------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request):
        return await self._openai("completion", req, request)

    async def chat(self, req: ChatCompletionRequest, request: Request):
        return await self._openai("chat", req, request)

    async def _openai(self, kind: str, req: ChatCompletionRequest | CompletionRequest, request: Request):
        self.refuse_if_draining()
        adapter = self.adapters_by_name.get(req.model)
        if req.model != self.model_name and adapter is None:
            raise InvalidRequest(f"The model `{req.model}` does not exist.", "model", "model_not_found", status=404)
        plan = await plan_request_async(kind, req, self.builder, self.engine.info.max_model_len)
        for job in plan.jobs:
            self.engine.validate(job.prompt_ids, job.params)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        # A streamed reply's fast path (DirectBody): the core's step outputs go from the front-end's dispatch
        # straight to the connection while the response waits for them (one choice; stream_sse decides what it
        # renders there).
        direct = DirectBody() if req.stream and len(plan.jobs) == 1 else None
        streams = [self._choice(f"{rid}-{j.index}", j.index, j.prompt_ids, j.params, req.priority_class, adapter,
                                direct) for j in plan.jobs]
        items = merge(streams)
        headers = {"x-request-id": rid}
        if req.stream:
            return ClosingStreamingResponse(stream_sse(plan, response_id, self.model_name, items, direct=direct),
                                            media_type="text/event-stream", headers=headers, direct=direct)
        body, _ = await unless_disconnected(request, collect(plan, response_id, self.model_name, items))
        return JSONResponse(body, headers=headers)

    def _choice(self, rid: str, index: int, prompt: list[int], params: SamplingParams, priority: Priority,
                adapter: AdapterRef | None, direct: DirectBody | None = None) -> ChoiceStream:
        sink = functools.partial(_direct_output, direct, index) if direct is not None else None

        async def gen():
            async for out in self.engine.generate(rid, prompt, params, priority=priority, adapter=adapter, sink=sink):
                delta = Delta(index, out.new_text, out.new_token_ids, _logprob_items(self.engine.tokenizer, out), out.finish_reason)
                yield delta, (_usage(out) if out.finished else None)

        return gen()

    # -- the internal stream ----------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, request: Request):
        """NDJSON: one StreamItem per step (services.common.engine_wire); the last adds `usage`."""
        first, outputs, ids, clamped = await self.start(req)  # errors before the first token: a proper HTTP error
        headers = {"x-request-id": req.request_id}
        if clamped is not None:
            headers[CLAMPED_HEADER] = clamped
        coalesce = request.headers.get(COALESCE_HEADER) == "1"
        return ClosingStreamingResponse(self.stream_lines(first, outputs, ids, coalesce), media_type="application/x-ndjson",
                                        headers=headers)

    async def start(self, req: GenerateRequest) -> tuple[RequestOutput | None, AsyncIterator[RequestOutput], dict, str | None]:
        """Submit one internal-stream request and wait for its first output: (first, the rest, its ids for the log,
        CLAMPED_HEADER's value or None). Both transports (GENERATE_PATH, the streams socket) start requests here."""
        self.refuse_if_draining()
        uri = self.sources.confine(req.adapter.uri, "adapter.uri") if req.adapter and req.adapter.uri else None
        adapter = AdapterRef(req.adapter.content_id, req.adapter.name, uri) if req.adapter else None
        self.engine.validate(req.prompt_token_ids, req.sampling)
        outputs = self.engine.generate(
            req.request_id, req.prompt_token_ids, req.sampling,
            priority=Priority.parse(req.priority), cache_salt=req.cache_salt, adapter=adapter,
            tenant=req.tenant, weight=req.weight,
        )
        ids = {"request_id": req.request_id, "client_request_id": req.client_request_id}
        log.info("request accepted", extra={**ids, "prompt_tokens": len(req.prompt_token_ids),
                                            "adapter": req.adapter.name if req.adapter else None})
        first = await _first(outputs)
        clamped = str(self.engine.info.clamp_tokens) if first is not None and first.clamped_from is not None else None
        return first, outputs, ids, clamped

    async def stream_lines(self, first: RequestOutput | None, outputs: AsyncIterator[RequestOutput],
                     ids: dict[str, Any], coalesce: bool = False) -> AsyncIterator[bytes]:
        """One line per step; with `coalesce`, the first step's line and then one line for all the others (a
        caller that needs only the whole answer is spared a line, a JSON encode and a write per token)."""
        held: StreamItem | None = None
        try:
            out = first
            while out is not None:
                if (not coalesce or out is first) and not out.finished and out.logprobs is None:
                    yield StreamItem.step_line(out.new_text, out.new_token_ids)  # a plain step: no model to build
                else:
                    item = self._item(out, ids)
                    if not coalesce or out is first:
                        yield item.encode()
                    elif held is None:
                        held = item
                    else:
                        held.extend(item)
                try:
                    out = await anext(outputs, None)
                except (InvalidRequest, EngineUnavailable) as exc:  # failed mid-stream: say so, then end
                    log.warning("request failed mid-stream", extra={**ids, "error": exc.message})
                    if held is not None:
                        yield held.encode()
                    yield StreamItem.failure(exc).encode()
                    return
            if held is not None:
                yield held.encode()
        finally:
            await outputs.aclose()

    def _item(self, out: RequestOutput, ids: dict[str, Any]) -> StreamItem:
        usage = None
        if out.finished:
            log.info("request finished", extra={**ids, "finish_reason": out.finish_reason,
                                                "completion_tokens": out.num_output_tokens,
                                                "cached_tokens": out.num_cached_tokens})
            usage = StreamUsage(prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens,
                                completion_tokens=out.num_output_tokens, compute_seconds=out.compute_seconds,
                                engine_id=self.engine.info.engine_id, draft_tokens=out.num_draft_tokens,
                                accepted_draft_tokens=out.num_accepted_tokens)
        return StreamItem(text=out.new_text, token_ids=out.new_token_ids, logprobs=_logprob_items(self.engine.tokenizer, out),
                          finish_reason=out.finish_reason, usage=usage)


def _direct_output(direct: DirectBody, index: int, out: RequestOutput) -> bool:
    """A step's output on the fast path (generate's sink): sent to the client (True), or left for the stream's
    task (False) -- the connection not writable now, or no renderer (several choices, logprobs, tool calls:
    stream_sse sets none for those)."""
    if not direct.ready():
        return False
    direct.offer(Delta(index, out.new_text, out.new_token_ids, None, out.finish_reason))
    return True


def _logprob_items(tok, out: RequestOutput) -> list[dict[str, Any]] | None:
    if out.logprobs is None:
        return None
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
    return Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, out.num_draft_tokens,
                 out.num_accepted_tokens)


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None
    except BaseException:
        await outputs.aclose()
        raise
