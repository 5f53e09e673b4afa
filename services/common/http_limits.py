"""Request size limits every HTTP service of ours applies before its app reads anything.

Two layers. The transport (`HeadLimitedHttpTools`, uvicorn's httptools protocol) stops reading a request
whose head -- request line and headers -- outgrows the limit and answers 431, so a 1 MB `Authorization`
header costs at most one socket read. The ASGI middleware (`RequestLimits`) answers 413 for a body over
the limit (at once when Content-Length says so, else as soon as the bytes read pass it) and 431 for
headers in servers without the transport layer; bodies under the limit are read whole and replayed to
the app, which would read them whole anyway (JSON). Routes that stream their own bodies under their own
limits (adapter uploads) are passed through untouched.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.common.openai_protocol import error_body
from services.common.streaming import DIRECT_WRITE, ConnectionWriter

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_HEADER_BYTES = 32 * 2**10


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    return status, orjson.dumps(error_body(message, "invalid_request_error", None, code))


def body_too_large(limit: int) -> tuple[int, bytes]:
    return _error(413, f"The request body is larger than this server accepts ({limit} bytes).", "request_too_large")


def headers_too_large(limit: int) -> tuple[int, bytes]:
    return _error(431, f"The request headers are larger than this server accepts ({limit} bytes).",
                  "request_headers_too_large")


class RequestLimits:
    """Pure ASGI middleware: 431 for oversized headers, 413 for oversized bodies, before the app runs."""

    def __init__(self, app, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, streaming_paths: Iterable[str] = ()):
        self.app = app
        self.max_body = max_body_bytes
        self.max_headers = max_header_bytes
        self.streaming = re.compile("|".join(f"(?:{p})" for p in streaming_paths)) if streaming_paths else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > self.max_headers:
            return await _respond(send, *headers_too_large(self.max_headers))
        if self.streaming is not None and self.streaming.fullmatch(scope["path"]):
            return await self.app(scope, receive, send)
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            if not length.isdigit():
                return await _respond(send, *_error(400, "Invalid Content-Length header.", "invalid_content_length"))
            return await _respond(send, *body_too_large(self.max_body))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await _respond(send, *body_too_large(self.max_body))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, for apps that watch for hang-ups

        await self.app(scope, replay, send)


async def _respond(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class HeadLimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing (431, then closing) a request whose head passes
    `max_head_bytes` before it completes: httptools itself buffers any head, however long. It also offers each
    request's streamed body a synchronous writer (services.common.streaming.DirectBody)."""

    max_head_bytes = DEFAULT_MAX_HEADER_BYTES

    def connection_made(self, transport) -> None:
        self._head_bytes = 0
        self._in_head = True
        super().connection_made(transport)

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # this request's cycle (not a WebSocket upgrade)
            self.scope[DIRECT_WRITE] = ConnectionWriter(cycle)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():  # all of this chunk was head
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                status, body = headers_too_large(self.max_head_bytes)
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
                self.transport.close()


def http_protocol(max_head_bytes: int) -> type[HeadLimitedHttpTools]:
    """The protocol class to pass to uvicorn (`http=`) for a given head limit."""
    return type("HeadLimitedHttpTools", (HeadLimitedHttpTools,), {"max_head_bytes": max_head_bytes})
