"""A streaming response that always closes its body iterator, so a generator's `finally` runs at once.

Starlette cancels a stream when the client hangs up; if the generator was suspended at `yield` (the
usual place: waiting for `send`), it is left un-closed until garbage collection. Our generators
abort engine sequences and settle quotas and usage in `finally`, so that must happen now, not later.
"""
from __future__ import annotations

import anyio
from starlette.responses import StreamingResponse


class ClosingStreamingResponse(StreamingResponse):
    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
