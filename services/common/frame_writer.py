"""One writer for both ends of the engine streams socket (services.common.engine_wire, STREAMS_PATH): lines queued
while the event loop runs other tasks leave together as one frame.

`put` only queues and wakes the writer task; the writer runs after the tasks that were ready before it (on the
engine, every request a step woke; on the gateway, every request that opened or closed meanwhile), so a step's lines
cost one frame and one write, not one each. Frames stay under `max_frame` (a single longer line goes alone).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class FrameWriter:
    def __init__(self, send: Callable[[bytes], Awaitable[None]], on_error: Callable[[Exception], Awaitable[None]],
                 max_frame: int):
        """`send(frame)`: the socket's send; `on_error(exc)`: the send failed (the writer stops)."""
        self.send, self.on_error, self.max_frame = send, on_error, max_frame
        self.lines: list[bytes] = []
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    def put(self, line: bytes) -> None:
        self.lines.append(line)
        self.wake.set()

    async def _run(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                lines, self.lines = self.lines, []
                frame: list[bytes] = []
                size = 0
                for line in lines:
                    if frame and size + len(line) > self.max_frame:
                        await self.send(b"".join(frame))
                        frame, size = [], 0
                    frame.append(line)
                    size += len(line)
                if frame:
                    await self.send(b"".join(frame))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the socket is broken: its owner hears of it and ends
            await self.on_error(exc)

    def cancel(self) -> None:
        self.task.cancel()

    async def aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
