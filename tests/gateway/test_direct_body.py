"""A streamed response's fast path (services.common.streaming.DirectBody): chunks written synchronously to the
connection by another task while the response's own task waits, through our uvicorn protocol's ConnectionWriter.
On a real uvicorn server: the bytes on the wire are a valid chunked body, direct and ASGI chunks interleave in
order, a client that stops reading (the connection's buffer over its high-water mark) and a client that hangs up
turn the fast path off instead of being written to."""
from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from services.common.http_limits import http_protocol
from services.common.streaming import DIRECT_WRITE, ClosingStreamingResponse, ConnectionWriter, DirectBody, Handoff


class _Producer:
    """Feeds one response through a Handoff (as the engine front-end's dispatch feeds a request's stream): each item
    goes to the fast path when it is ready and the body is waiting with nothing queued, else to the body's task."""

    def __init__(self, direct: DirectBody):
        self.direct = direct
        self.items = Handoff(self._sink, "test response")
        self.direct_sent = self.queued = 0
        self.writers: list[ConnectionWriter] = []

    def _sink(self, chunk: bytes) -> bool:
        if not self.direct.ready():
            return False
        self.direct.offer(chunk)
        self.direct_sent += 1
        return True

    async def body(self):
        while (item := await self.items.get()) is not None:
            yield item

    def put(self, chunk: bytes, allow_direct: bool = True) -> None:
        if self.direct.writer is not None and self.direct.writer not in self.writers:
            self.writers.append(self.direct.writer)
        sent = self.direct_sent
        self.items.put(chunk, offer=allow_direct)
        self.queued += self.direct_sent == sent

    def end(self) -> None:
        self.items.put(None, offer=False)


def _serve(run):
    """Start uvicorn with our HTTP protocol on a free port, in this loop; `run(url, producers)` drives a client."""
    producers: list[_Producer] = []
    feeds: dict[str, asyncio.Task] = {}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        direct = DirectBody()
        direct.render = lambda chunk: chunk  # the items are the chunks
        p = _Producer(direct)
        producers.append(p)
        assert isinstance(scope.get(DIRECT_WRITE), ConnectionWriter)
        kind = scope["path"].strip("/")
        feeds[kind] = asyncio.create_task(FEEDS[kind](p))
        await ClosingStreamingResponse(p.body(), media_type="text/plain", direct=direct)(scope, receive, send)

    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http_protocol(32768),
                                               log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            await run(f"http://127.0.0.1:{port}", producers)
            await asyncio.gather(*feeds.values())
        finally:
            server.should_exit = True
            await serving

    asyncio.run(main())


async def _steps(p: _Producer) -> None:
    for i in range(200):
        p.put(b"%d\n" % i, allow_direct=i % 7 != 3)  # some through the queue while the fast path is open
        await asyncio.sleep(0.001 if i % 5 else 0)
    p.end()


async def _big(p: _Producer) -> None:
    """Chunks of 256 KiB to a client that does not read for a while: the connection's buffer fills."""
    for i in range(40):
        p.put(b"%06d" % i + b"x" * (256 * 1024 - 7) + b"\n")
        await asyncio.sleep(0.005)
    p.end()


async def _until_gone(p: _Producer) -> None:
    """Steps until the client has hung up: then the fast path must be closed (the response ended and took its writer
    away, or the writer says the connection is gone)."""
    for i in range(2000):
        writer = p.direct.writer
        if i > 5 and not p.direct.ready() and (writer is None or not writer.writable()):
            break
        p.put(b"%d\n" % i)
        await asyncio.sleep(0.002)
    else:
        raise AssertionError("the fast path never noticed the client hung up")
    p.end()


FEEDS = {"steps": _steps, "big": _big, "gone": _until_gone}


def test_direct_and_asgi_chunks_reach_the_client_in_order_as_valid_chunked_http():
    async def run(url, producers):
        async with httpx.AsyncClient() as c:
            r = await c.get(url + "/steps")
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        assert r.text.splitlines() == [str(i) for i in range(200)]
        p = producers[0]
        assert p.direct_sent > 100 and p.queued > 20, (p.direct_sent, p.queued)  # both paths were taken

    _serve(run)


def test_a_client_that_stops_reading_turns_the_fast_path_off_and_loses_nothing():
    async def run(url, producers):
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("GET", url + "/big") as r:
                await asyncio.sleep(1.0)  # not reading: the server's buffer passes its high-water mark
                data = b"".join([chunk async for chunk in r.aiter_bytes()])
        lines = data.split(b"\n")[:-1]
        assert [int(line[:6]) for line in lines] == list(range(40))
        assert all(len(line) == 256 * 1024 - 1 for line in lines)
        p = producers[0]
        assert p.queued > 0, "the buffer never filled: the test did not test the paused connection"

    _serve(run)


def test_a_client_that_hangs_up_is_not_written_to():
    async def run(url, producers):
        async with httpx.AsyncClient() as c:
            async with c.stream("GET", url + "/gone") as r:
                async for line in r.aiter_lines():
                    if line == "3":
                        break  # leaving the block closes the connection mid-stream
        for _ in range(500):
            if producers and producers[0].writers and not producers[0].writers[0].writable():
                return
            await asyncio.sleep(0.01)
        pytest.fail("the connection's writer still says writable after the client left")

    _serve(run)
