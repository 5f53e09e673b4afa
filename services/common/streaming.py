"""Client hang-ups, for both services: a streaming response that always closes its body iterator (so a
generator's `finally` runs at once), and a non-streaming generation cancelled when its client leaves.

Starlette cancels a stream when the client hangs up; if the generator was suspended at `yield` (the
usual place: waiting for `send`), it is left un-closed until garbage collection. Our generators
abort engine sequences and settle quotas and usage in `finally`, so that must happen now, not later.
"""
from __future__ import annotations

import asyncio
import contextlib

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

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
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
    _body_send = None

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._body_send or send  # see install_body_send
        async for chunk in self.body_iterator:
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        self._body_send = scope.get(BODY_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
