"""The gateway's side of the internal engine stream: open it on the best engine, parse NDJSON lines into
deltas; close = abort upstream.

Retries follow whose fault a failure was. Before anything was sent (connection refused) or when the
engine says it cannot serve (`x-mplex-fault: engine`: dead, draining, overloaded), the next engine is
tried. A request the engine refused or failed on its own account is passed to the client as it is. A
request sent and then lost (the engine died or hung up while holding it) is not sent anywhere else: it
may be what killed the engine, and another engine must not be offered the same poison.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import aiohttp
import orjson

from services.common.openai_protocol import Delta, Usage
from services.common.streaming import DirectBody
from services.common.engine_wire import (COALESCE_HEADER, GENERATE_PATH, STREAMS_MAX_OPEN_BYTES, WIRE_HEADER, WIRE_VERSION,
                                         GenerateRequest, StreamItem, open_command)
from services.common.wire import CLAMPED_HEADER, FAULT_ENGINE, FAULT_HEADER, EngineFailed, EngineUnavailable
from services.gateway.engine_streams import EngineStream, NotSent, Refused, StreamsPool, StreamsUnsupported
from services.gateway.router import EngineInfo, Router

log = logging.getLogger("mplex.gateway.upstream")


class NoEngineAvailable(EngineUnavailable):
    """No engine serving this model could take the request. When every engine refused it as overloaded,
    the code says so and `retry_after` is the soonest any of them expected to have room."""

    def __init__(self, message: str, code: str = "no_engine_available", retry_after: int | None = None):
        super().__init__(message, code=code, retry_after=retry_after)


class EngineLost(EngineUnavailable):
    """The engine took the request, then failed or vanished (before or during its stream). Not retried."""

    status = 502

    def __init__(self, message: str):
        super().__init__(message, code="engine_failed")


class UpstreamRefused(Exception):
    """The engine refused or failed the request on its own account: passed to the client, never retried."""

    def __init__(self, status: int, body: dict[str, Any]):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(err.get("message", "refused by the engine"))
        self.status, self.body = status, body


@dataclass(slots=True)
class StreamResult:
    """What one choice's stream ended with (filled as the stream is consumed)."""

    engine_id: str = ""  # the engine that streamed it (set once it produced a first token)
    tried_engine_id: str = ""  # the engine it was lost in before a first token (for the ledger)
    usage: Usage = field(default_factory=Usage)
    compute_seconds: float = 0.0
    finish_reason: str | None = None
    delivered_tokens: int = 0  # received from the engine
    sent_tokens: int = 0  # handed to the client's connection (what a hung-up stream is billed for)
    first_token_at: float | None = None
    attempts: int = 0
    clamped_max_tokens: str | None = None  # the engine's CLAMPED_HEADER: overload clamped its max_tokens


class _TryNext(Exception):
    """This engine could not take the request and nothing of it ran there: try the next one."""

    def __init__(self, message: str, counts_against_engine: bool, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.counts_against_engine = counts_against_engine
        self.code, self.retry_after = code, retry_after


# Before the response started: a refused connection never reached the engine; anything else (reset,
# disconnect, timeout) happened with the request in the engine's hands.
_NOT_SENT = (aiohttp.ClientConnectorError,)
_LOST = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


async def open_choice(
    client: aiohttp.ClientSession,
    router: Router,
    engines: list[EngineInfo],
    request: GenerateRequest,
    index: int,
    result: StreamResult,
    clock,
    coalesce: bool = False,
    streams: StreamsPool | None = None,
    direct: DirectBody | None = None,
) -> AsyncIterator[tuple[Delta, Usage | None]]:
    """Yields (delta, usage-on-last) for one choice. Closing the iterator closes the engine stream. `coalesce`:
    the caller needs only the whole answer (a non-streamed request): the engine sends the first step and then
    the rest in one line. `streams`: the engines' streams sockets (services.gateway.engine_streams), used where
    an engine has one; otherwise, and for a request too large for them, one HTTP stream (GENERATE_PATH).
    `direct`: the client response's fast path, fed from the socket's dispatch (see `_read_stream`)."""
    tries = _Attempts()
    body = request.encode()
    headers = {"content-type": "application/json", "x-request-id": request.request_id, WIRE_HEADER: str(WIRE_VERSION)}
    if coalesce:
        headers[COALESCE_HEADER] = "1"
    command = None  # a request too large for a socket's frames goes over HTTP, under the engine's body limit
    if streams is not None and len(body) < STREAMS_MAX_OPEN_BYTES - 64:
        command = functools.partial(open_command, request=body, coalesce=coalesce)  # command(stream id)
    for engine in engines:
        held = router.holding(engine.id, request.tenant, str(request.priority))
        if held is not None:  # it refused this tenant's class as overloaded a moment ago: not asked again yet
            tries.last_error = f"engine {engine.id} refused as overloaded just now"
            tries.overloaded.append(held)
            tries.held += 1
            continue
        if not router.admit(engine.id):
            tries.last_error = f"engine {engine.id} is failing (circuit open)"
            continue
        result.attempts += 1
        router.opened(engine.id)
        opened = await _try_engine(client, router, engine, body, headers, result, tries, request.tenant,
                                   str(request.priority), streams if command is not None else None, command)
        if opened is None:
            continue
        # Committed to this engine: from here on a failure ends the stream (it is never retried).
        resp, first = opened
        async for out in _read_stream(router, engine, resp, first, index, result, clock, direct):
            yield out
        return
    raise tries.exhausted(result.attempts)


@dataclass(slots=True)
class _Attempts:
    """Why the engines tried so far did not take the request."""

    last_error: str = "no engine serves this model"
    overloaded: list[int] = field(default_factory=list)  # Retry-After of each engine that refused as overloaded
    held: int = 0  # engines not asked: they refused this tenant's class as overloaded a moment ago

    def exhausted(self, attempts: int) -> NoEngineAvailable:
        if self.overloaded and len(self.overloaded) == attempts + self.held:
            return NoEngineAvailable(f"every engine serving this model is overloaded ({self.last_error})",
                                     code="engine_overloaded", retry_after=min(self.overloaded))
        return NoEngineAvailable(f"no engine could serve the request ({self.last_error})")


async def _try_engine(client, router: Router, engine: EngineInfo, body: bytes, headers: dict[str, str],
                      result: StreamResult, tries: _Attempts, tenant: str = "", priority: str = "",
                      streams: StreamsPool | None = None, command=None):
    """(body, first lines) once `engine` took the request; None when the next engine should be tried."""
    try:
        opened = None
        if streams is not None and streams.usable(engine.url):
            opened = await _open_socket(streams, engine, command)
        resp, first = opened or await _open(client, engine, body, headers)
    except _TryNext as exc:
        tries.last_error = str(exc)
        if exc.code == "engine_overloaded":
            tries.overloaded.append(exc.retry_after or 1)
            router.refused(engine.id, tenant, priority, exc.retry_after or 1)
        log.warning("engine %s could not take %s (%s); trying the next", engine.id, headers["x-request-id"], exc)
        if exc.counts_against_engine:
            router.failed(engine.id)
        else:
            router.succeeded(engine.id)  # it answered (draining, overloaded): alive
        router.closed(engine.id)
        return None
    except EngineLost:
        result.tried_engine_id = engine.id
        router.failed(engine.id)
        router.closed(engine.id)
        raise
    except UpstreamRefused:
        router.succeeded(engine.id)  # a well-formed refusal: the engine is up
        router.closed(engine.id)
        raise
    except BaseException:  # cancelled (the client hung up): says nothing about the engine
        router.end_probe(engine.id)
        router.closed(engine.id)
        raise
    router.succeeded(engine.id)  # it took the request and produced a token: up
    result.engine_id = engine.id
    result.clamped_max_tokens = resp.clamped
    return resp, first


async def _read_stream(router: Router, engine: EngineInfo, resp: _HttpBody | EngineStream, first: bytes, index: int,
                       result: StreamResult, clock, direct: DirectBody | None = None
                       ) -> AsyncIterator[tuple[Delta, Usage | None]]:
    """The engine's StreamItems as deltas, starting with the first line `_open` already read. The lines that have
    arrived by the time this reads again become one delta: a gateway keeping up sends every step on as it
    comes, one that lags behind its streams (hundreds of them, beside the engines on the same cores) sends each
    stream's backlog as one chunk -- one pass through the ASGI stack and one write, not one per step.

    With `direct` and a streams socket, a step's line that arrives while this waits is not queued for it: the
    socket's dispatch hands it to `_direct_step`, which sends it to the client at once (DirectBody)."""
    finished = False
    if direct is not None and isinstance(resp, EngineStream):
        resp.sink = functools.partial(_direct_step, direct, engine, index, result, clock)
    try:
        buf: bytes = first
        while buf:
            cut = buf.rfind(b"\n") + 1
            lines, buf = buf[:cut].split(b"\n"), buf[cut:]  # a partial last line waits for the rest
            pending: StreamItem | None = None
            for line in lines:
                line = line.strip()
                if not line:
                    continue
                item = _decode(engine, line)
                if item.error is not None:
                    if pending is not None:  # what came before the failure is the client's
                        yield _delta(pending, index), None
                    if item.fault == FAULT_ENGINE and item.error.code == EngineFailed.CODE:
                        router.failed(engine.id)
                        raise EngineLost(f"engine {engine.id} failed mid-stream")
                    item.raise_error()
                result.delivered_tokens += len(item.token_ids)
                if result.first_token_at is None and item.token_ids:
                    result.first_token_at = clock()
                if item.usage is not None:
                    u = item.usage
                    result.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.draft_tokens,
                                         u.accepted_draft_tokens)
                    result.compute_seconds = u.compute_seconds
                    result.finish_reason = item.finish_reason
                    finished = True
                if pending is None:
                    pending = item
                else:
                    pending.extend(item)
            if pending is not None:
                yield _delta(pending, index), result.usage if finished else None
            if finished:
                break
            try:
                more = await resp.read()  # whatever has arrived, at least one byte; b"" at the end
            except _LOST as exc:
                router.failed(engine.id)
                raise EngineLost(f"engine {engine.id} failed mid-stream ({exc.__class__.__name__})") from None
            if not more:
                break
            buf += more
        if not finished:
            router.failed(engine.id)
            raise EngineLost(f"engine {engine.id} ended the stream before the request finished")
    finally:
        if isinstance(resp, EngineStream):
            resp.sink = None
        try:
            if finished:
                await resp.finish()
        finally:
            resp.close()  # not finished: the engine aborts the request and frees the sequence's KV
            router.closed(engine.id)


def _direct_step(direct: DirectBody, engine: EngineInfo, index: int, result: StreamResult, clock, line: bytes) -> bool:
    """A step's line on the fast path: sent to the client (True), or left for the relay above (False) -- the client's
    connection not writable now, or anything but a step's tokens (the last line, an error, logprobs, a line that
    does not parse: the relay says what is wrong with it)."""
    if not direct.ready():
        return False
    step = StreamItem.step_of(line)
    if step is None:
        return False
    text, token_ids = step
    direct.offer(Delta(index, text, token_ids, None, None))
    result.delivered_tokens += len(token_ids)
    if result.first_token_at is None and token_ids:
        result.first_token_at = clock()
    return True


def _delta(item: StreamItem, index: int) -> Delta:
    return Delta(index, item.text, item.token_ids, item.logprobs, item.finish_reason)


def _decode(engine: EngineInfo, line: bytes) -> StreamItem:
    try:
        return StreamItem.decode(line)
    except ValueError:
        raise EngineLost(f"engine {engine.id} sent a line that is not a stream item") from None


async def _open(client: aiohttp.ClientSession, engine: EngineInfo, body: bytes, headers: dict[str, str]):
    """POST the request and read the first line (the engine answers only once it has a first token)."""
    try:
        resp = await client.post(f"{engine.url}{GENERATE_PATH}", data=body, headers=headers)
    except _NOT_SENT as exc:
        raise _TryNext(f"engine {engine.id} unreachable ({exc.__class__.__name__})", True) from None
    except _LOST as exc:
        raise EngineLost(f"engine {engine.id} failed while taking the request ({exc.__class__.__name__})") from None
    try:
        if resp.status >= 400:
            raw = await resp.read()
            try:
                err = orjson.loads(raw)
            except orjson.JSONDecodeError:
                err = {"error": {"message": raw[:200].decode(errors="replace")}}
            retry = resp.headers.get("retry-after")
            _refused(engine, resp.status, resp.headers.get(FAULT_HEADER), int(retry) if retry and retry.isdigit() else None,
                     err)
        first = await resp.content.readline()
    except _LOST as exc:
        resp.close()
        raise EngineLost(f"engine {engine.id} failed before the first token ({exc.__class__.__name__})") from None
    except BaseException:
        resp.close()
        raise
    if not first:
        resp.close()
        raise EngineLost(f"engine {engine.id} closed the stream before the first token")
    return _HttpBody(resp), first


def _refused(engine: EngineInfo, status: int, fault: str | None, retry_after: int | None, err) -> NoReturn:
    """Raise what an engine's refusal of a request (before its first token) means for the gateway."""
    code = (err.get("error") or {}).get("code") if isinstance(err, dict) else None
    if fault == FAULT_ENGINE and code == EngineFailed.CODE:  # it died holding the request: as a reset
        raise EngineLost(f"engine {engine.id} failed while holding the request")
    if fault == FAULT_ENGINE or (fault is None and status == 503):
        # A dead engine counts against its breaker; draining or overloaded ones are healthy.
        raise _TryNext(f"engine {engine.id} answered {status} ({code})", code in (None, "engine_unavailable"),
                       code, retry_after)
    raise UpstreamRefused(status, err if isinstance(err, dict) else {})


async def _open_socket(streams: StreamsPool, engine: EngineInfo, command) -> tuple[EngineStream, bytes] | None:
    """The request on one of the engine's streams sockets, and its first lines; None: the engine has none (ask it
    over HTTP)."""
    try:
        stream = await streams.open(engine.url, command)
    except StreamsUnsupported:
        return None
    except (*_NOT_SENT, NotSent) as exc:
        raise _TryNext(f"engine {engine.id} unreachable ({exc.__class__.__name__})", True) from None
    except _LOST as exc:  # the handshake failed midway: nothing was sent on it
        raise _TryNext(f"engine {engine.id} failed the streams handshake ({exc.__class__.__name__})", True) from None
    try:
        first = await stream.read_first()
    except BaseException as exc:
        stream.close()  # off the socket (a stream the engine still holds is aborted there)
        if isinstance(exc, Refused):
            r = exc.refusal
            _refused(engine, r.status, r.fault, r.retry_after, r.body)
        if isinstance(exc, _LOST):
            raise EngineLost(f"engine {engine.id} failed before the first token ({exc.__class__.__name__})") from None
        raise
    if not first:
        stream.close()
        raise EngineLost(f"engine {engine.id} ended the stream before the first token")
    return stream, first


class _HttpBody:
    """A GENERATE_PATH response read as an EngineStream is (services.gateway.engine_streams)."""

    __slots__ = ("resp", "clamped")

    def __init__(self, resp: aiohttp.ClientResponse):
        self.resp, self.clamped = resp, resp.headers.get(CLAMPED_HEADER)

    async def read(self) -> bytes:
        return await self.resp.content.readany()

    async def finish(self) -> None:
        """The answer is whole: read to the body's end so the connection goes back to the pool."""
        try:
            await self.resp.content.read()
        except _LOST:
            return  # that connection is not reused (close() below)
        self.resp.release()

    def close(self) -> None:
        self.resp.close()  # after release(): nothing; else the connection closes and the engine aborts
