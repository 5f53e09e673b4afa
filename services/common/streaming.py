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

DISCONNECT_POLL_S = 0.1  # a hung-up non-streaming request stops costing batch seats and KV blocks within this


async def unless_disconnected(request: Request, coro):
    """Run a non-streaming generation; if the client hangs up, cancel it (which aborts it upstream) and
    raise CancelledError."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise asyncio.CancelledError("client disconnected")


class ClosingStreamingResponse(StreamingResponse):
    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
