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


class ClosingStreamingResponse(StreamingResponse):
    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
