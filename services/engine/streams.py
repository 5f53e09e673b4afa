"""The engine's side of the streams socket (services.common.engine_wire, STREAMS_PATH): one WebSocket from a
gateway process carrying many internal-stream requests at once.

Each request runs as it does on GENERATE_PATH (`EngineServer.start`, `EngineServer.stream_lines`: the same checks, the
same lines, the same coalescing) in a task of its own; what they produce goes into one outbox that is flushed as
one frame when the event loop has run every task a step woke -- one frame and one write per step for all of them,
where GENERATE_PATH costs a response body chunk, a pass through the ASGI stack and a socket write per request per
step. A request fails alone: a refusal or failure is that stream's event, and the socket carries on. `close`
(the gateway's client hung up) cancels the task, which aborts the sequence as a dropped HTTP stream does; the
socket closing cancels every request on it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import orjson
from starlette.websockets import WebSocket

from services.common.engine_wire import (
    CLAMPED,
    END,
    REFUSED,
    STREAMS_MAX_FRAME,
    STREAMS_MAX_OPEN_BYTES,
    WIRE_HEADER,
    GenerateRequest,
    StreamRefusal,
    check_wire_version,
    stream_line,
)
from services.common.frame_writer import FrameWriter
from services.common.wire import FAULT_HEADER, EngineUnavailable, InvalidRequest

from services.engine.http_errors import error_parts

log = logging.getLogger("mplex.engine.streams")


async def serve_streams(server: Any, websocket: WebSocket) -> None:
    """`server`: the app's EngineServer (its `start` and `stream_lines`)."""
    try:
        check_wire_version(websocket.headers.get(WIRE_HEADER))
    except EngineUnavailable:
        await websocket.close(code=1008)  # the gateway falls back to GENERATE_PATH, which says why
        return
    await websocket.accept()

    async def send(frame: bytes) -> None:
        await websocket.send({"type": "websocket.send", "bytes": frame})

    async def gone(exc: Exception) -> None:  # the gateway went away: the reader sees it and cancels everything
        log.info("streams socket closed while sending (%s)", exc.__class__.__name__)

    out = FrameWriter(send, gone, STREAMS_MAX_FRAME // 2)
    tasks: dict[int, asyncio.Task] = {}
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            data = message.get("bytes") or (message.get("text") or "").encode()
            for line in data.splitlines():
                if line.strip():
                    _command(server, line, tasks, out)
    except ValueError as exc:  # a line that is no command: not the gateway's protocol, this socket is dropped
        log.warning("streams socket dropped: %s", exc)
        with contextlib.suppress(Exception):
            await websocket.close(code=1008)
    finally:
        for task in tasks.values():
            task.cancel()  # the gateway is gone: every request on this socket is aborted
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await out.aclose()


def _command(server: Any, line: bytes, tasks: dict[int, asyncio.Task], out: FrameWriter) -> None:
    try:
        cmd = _loads(line)
        sid = cmd.get("open", cmd.get("close")) if isinstance(cmd, dict) else None
    except (ValueError, RecursionError):  # no JSON, or nested past the parsers' depth
        sid = None
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        raise ValueError("a streams command without a stream id")  # not the gateway's protocol: drop the socket
    if "close" in cmd:
        task = tasks.get(sid)
        if task is not None:
            task.cancel()
        return
    if sid in tasks:
        out.put(_refusal(sid, InvalidRequest(f"stream {sid} is already open on this socket", "open")))
        return
    if len(line) > STREAMS_MAX_OPEN_BYTES:
        out.put(_refusal(sid, InvalidRequest("the request is too large for the streams socket", "request", status=413)))
        return
    task = asyncio.create_task(_serve(server, sid, cmd.get("request"), cmd.get("coalesce") is True, out))
    tasks[sid] = task
    task.add_done_callback(lambda _: tasks.pop(sid, None))


async def _serve(server: Any, sid: int, body, coalesce: bool, out: FrameWriter) -> None:
    try:
        req = GenerateRequest.model_validate(body)
        first, outputs, ids, clamped = await server.start(req)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 -- refused or failed before its first token: this stream's answer
        if not isinstance(exc, InvalidRequest | EngineUnavailable):
            log.warning("streams request %d failed before its first token", sid, exc_info=True)
        out.put(_refusal(sid, exc))
        return
    if clamped is not None:
        out.put(stream_line(sid, CLAMPED + clamped.encode() + b"\n"))
    lines = server.stream_lines(first, outputs, ids, coalesce)
    try:
        async for item in lines:
            out.put(stream_line(sid, item))
    finally:
        await lines.aclose()  # cancelled (closed by the gateway): aborts the sequence now
    out.put(stream_line(sid, END + b"\n"))


def _loads(line: bytes):
    """A command line. What the HTTP endpoint's parser reads (NaN, lone surrogates escaped) this reads too, so the
    request's own checks answer for it: only a line that is no JSON at all breaks the socket."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def _refusal(sid: int, exc: Exception) -> bytes:
    status, headers, body = error_parts(exc)
    retry = headers.get("retry-after")
    refusal = StreamRefusal(status=status, fault=headers.get(FAULT_HEADER), retry_after=int(retry) if retry else None,
                            body=body)
    return stream_line(sid, REFUSED + refusal.model_dump_json().encode() + b"\n")
