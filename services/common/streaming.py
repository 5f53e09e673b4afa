"""Client hang-ups, for both services: a streaming response that always closes its body iterator (so a
generator's `finally` runs at once), and a non-streaming generation cancelled when its client leaves.

Starlette cancels a stream when the client hangs up; if the generator was suspended at `yield` (the
usual place: waiting for `send`), it is left un-closed until garbage collection. Our generators
abort engine sequences and settle quotas and usage in `finally`, so that must happen now, not later.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.requests import Request
from starlette.responses import StreamingResponse

log = logging.getLogger("mplex.streaming")


async def unless_disconnected(request: Request, coro):
    """Run a non-streaming generation; if the client hangs up, cancel it (which aborts it upstream) and
    raise CancelledError. The hang-up is awaited, not polled: a poll every 100 ms per request waiting for its
    answer cost the gateway more CPU at saturation than relaying the engine's tokens did."""
    task = asyncio.ensure_future(coro)
    hangup = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        if not hangup.done():
            hangup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hangup
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise asyncio.CancelledError("client disconnected")


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: the next ASGI message is the disconnect)."""
    await _hangup(request.receive)


# A ConnectionWriter, put in the scope by our HTTP protocol (services.common.http_limits.HeadLimitedHttpTools).
DIRECT_WRITE = "mplex.direct_write"


class ConnectionWriter:
    """Writes a streamed response's body chunks to the connection synchronously, as the server's `send` would
    (chunked encoding), when it can do so at once: the response has started and is not complete, the client is
    there and the connection's buffer is not over its high-water mark. Otherwise `writable()` is False and the
    chunk takes the ASGI path (which waits for the buffer to drain). Reads uvicorn's request cycle (the version
    in requirements.lock); tests/gateway/test_direct_body.py checks the bytes on the wire."""

    __slots__ = ("cycle",)

    def __init__(self, cycle):
        self.cycle = cycle

    def writable(self) -> bool:
        c = self.cycle
        return (c.response_started and not c.response_complete and not c.disconnected and c.chunked_encoding is True
                and not c.flow.write_paused and not c.transport.is_closing())

    def write(self, body: bytes) -> None:
        self.cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))


class DirectBody:
    """The fast path of a streamed response whose chunks come from another task's dispatch (the gateway's engine
    streams socket: one frame a step for hundreds of streams). Waking the response's task for every token, to
    pull one chunk through its generators and the server's `send`, cost more of the gateway's CPU than the
    token's JSON and the socket write together. Instead, while that task is waiting for its next item, the
    dispatcher hands the item to `offer`: the body's renderer (set by stream_sse) writes its chunk straight to the
    connection. Anything the fast path cannot take -- the connection not writable, the last item, an error, a
    line it does not read -- goes the usual way, in order: the task is woken and finds it. Three layers each set
    their part: ClosingStreamingResponse the `writer`, stream_sse the `render`er, the producer calls `offer`."""

    __slots__ = ("writer", "render")

    def __init__(self):
        self.writer: ConnectionWriter | None = None
        self.render = None  # Delta -> bytes | None (the SSE chunk; None: nothing to send yet)

    def ready(self) -> bool:
        """Whether `offer` would take an item now."""
        return self.render is not None and self.writer is not None and self.writer.writable()

    def offer(self, delta) -> None:
        """Send one item's chunk (only after `ready()`); raises (having sent nothing) if the item cannot be rendered."""
        chunk = self.render(delta)
        if chunk is not None:
            self.writer.write(chunk)


class Handoff:
    """A stream's items on their way to the one task that consumes them, with the fast path past that task: while
    the consumer waits with nothing queued, `put` offers an item to `sink` first (item -> bool: True if it sent
    the item itself -- a DirectBody's offer --, False to leave it to the consumer). Items keep their order: one is
    offered only when none is queued before it, and the consumer is the only other way out. A sink that raises is
    dropped for this stream only (logged); the item and the ones after it go to the consumer."""

    __slots__ = ("_queue", "_waiting", "sink", "name")

    def __init__(self, sink=None, name: str = ""):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._waiting = False
        self.sink = sink
        self.name = name  # for the log

    def put(self, item, offer: bool = True) -> None:
        """Queue `item` for the consumer, or with `offer` hand it to the sink if the consumer waits on nothing."""
        if offer and self.sink is not None and self._waiting and self._queue.empty():
            try:
                if self.sink(item):
                    return  # sent: the consumer sleeps on
            except Exception:  # noqa: BLE001 -- a fault of this stream's fast path must not reach the others
                log.exception("%s: the fast path failed; the stream goes on without it", self.name)
                self.sink = None
        self._queue.put_nowait(item)

    async def get(self):
        self._waiting = True
        try:
            return await self._queue.get()
        finally:
            self._waiting = False


# The server's own `send`, put in the scope by `install_body_send` (outside every middleware).
BODY_SEND = "mplex.body_send"


def install_body_send(app) -> None:
    """Make the server's `send` reachable from a streamed response's body chunks. A streamed reply of N steps sends
    N+2 messages, and each passed through every middleware's send wrapper (seven in the gateway: errors, exceptions,
    routing, metrics, security headers...), which only look at the response start: at hundreds of streams a step
    that was a fifth of the gateway's CPU. ClosingStreamingResponse sends the start and the last message through
    the stack and its body chunks straight to the server. Installed last, it wraps the whole stack; a middleware
    that rewrites response bodies (compression) must not be added to an app that has it."""
    build = app.build_middleware_stack

    def build_with_body_send():
        inner = build()

        async def body_send(scope, receive, send):
            if scope["type"] == "http":
                scope[BODY_SEND] = send
            await inner(scope, receive, send)

        return body_send

    app.build_middleware_stack = build_with_body_send


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its body iterator at once however it ends, and stops streaming when the
    client hangs up -- with one asyncio task listening for the hang-up instead of Starlette's anyio task group.
    Starlette (under an ASGI server older than spec 2.4, as uvicorn is) runs each streamed response in an anyio
    task group: a second task, a cancel scope and its bookkeeping, each asking asyncio for the current task (and
    CPython 3.11 making a getpid system call for each): 6-7% of the busy event loop of the engine's front-end and
    of the gateway while they streamed bursts of 256 requests (py-spy). The hang-up cancels the streaming task
    once; a hang-up that comes while the body's own `finally` runs (a client that stops at `[DONE]` hangs up
    there) interrupts that `finally`'s awaits, so what must complete runs shielded (the gateway's Call.finalize)."""

    _body_send = None

    def __init__(self, content, *args, direct: DirectBody | None = None, **kwargs):
        super().__init__(content, *args, **kwargs)
        self.direct = direct

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send or send  # see install_body_send
        async for chunk in self.body_iterator:
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        self._body_send = scope.get(BODY_SEND)
        if self.direct is not None:
            self.direct.writer = scope.get(DIRECT_WRITE)
        try:
            if scope["type"] != "http":
                await super().__call__(scope, receive, send)
                return
            await self._stream_until_hangup(receive, send)
            if self.background is not None:
                await self.background()
        finally:
            if self.direct is not None:
                self.direct.writer = self.direct.render = None
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()

    async def _stream_until_hangup(self, receive, send) -> None:
        """Stream the body; if the client hangs up first, cancel the streaming (this task) and return quietly --
        what Starlette's task group did. A cancellation from anywhere else still propagates."""
        task = asyncio.current_task()
        state = {"streaming": True, "hung_up": False}

        def on_hangup(listener: asyncio.Future) -> None:
            if state["streaming"] and not listener.cancelled() and listener.exception() is None:
                state["hung_up"] = True
                task.cancel()

        listener = asyncio.ensure_future(_hangup(receive))
        listener.add_done_callback(on_hangup)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if state["hung_up"] and task.uncancel() == 0:
                return  # our own cancellation: the client left, the response ends here
            raise
        finally:
            state["streaming"] = False  # a hang-up noticed from now on cancels nothing
            if not listener.done():
                listener.cancel()


async def _hangup(receive) -> None:
    """Returns when the ASGI server reports the client gone (or, for a streamed response, the response complete:
    uvicorn says `http.disconnect` then too, which comes after the streaming has ended)."""
    while (await receive())["type"] != "http.disconnect":
        pass
