"""The gateway's side of the streams socket (services.common.engine_wire, STREAMS_PATH): a few WebSockets per
engine, each carrying many of this process's requests, instead of one HTTP stream per request.

Relaying a streamed request over its own HTTP stream costs, per request and per step, a chunk the engine writes,
a socket read here, the HTTP client's chunk parsing and a task wake-up; with hundreds of streams at a step each
(a decode step is one token for every running sequence) that was most of the gateway's CPU. On the socket the
engine sends one frame per step with every stream's line; the reader below splits it and wakes each stream's
reader once. What a stream reads is the NDJSON lines GENERATE_PATH would have sent, so the relay above
(services.gateway.upstream) reads both transports alike.

Failure semantics are GENERATE_PATH's: an engine that cannot be reached -> the next engine; a refusal before the
first token -> what the HTTP error would have said; the socket lost with requests on it -> each of them lost
(never retried elsewhere). An engine without the socket (an older version mid-upgrade) is asked over HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import aiohttp

from services.common.frame_writer import FrameWriter
from services.common.engine_wire import (
    CLAMPED,
    END,
    REFUSED,
    STREAMS_MAX_FRAME,
    STREAMS_PATH,
    WIRE_HEADER,
    WIRE_VERSION,
    StreamRefusal,
    close_command,
)

log = logging.getLogger("mplex.gateway.engine_streams")
UNSUPPORTED_RECHECK_S = 60.0  # an engine that has no streams socket is asked again after this long
# Pinged this often; no pong within half of it and the socket is dropped (its streams lost): a host that vanished
# without a reset must not hold every request on it for the HTTP client's 600 s read timeout.
HEARTBEAT_S = 30.0


class StreamsUnsupported(Exception):
    """The engine answered the WebSocket handshake with an HTTP error: use GENERATE_PATH for it."""


class NotSent(ConnectionError):
    """The request was not handed to any socket (the one chosen closed meanwhile): nothing reached the engine."""


class Refused(Exception):
    """The engine did not take the request (its StreamRefusal): raised by the stream's first read."""

    def __init__(self, refusal: StreamRefusal):
        super().__init__(refusal.status)
        self.refusal = refusal


class EngineStream:
    """One request on a socket. `read()` returns the NDJSON lines that arrived since the last read (at least one;
    b"" once the engine ended the stream); the socket lost raises ConnectionResetError."""

    __slots__ = ("sid", "socket", "lines", "waiter", "refusal", "clamped", "ended", "lost", "sink")

    def __init__(self, sid: int, socket: _Socket):
        self.sid, self.socket = sid, socket
        self.lines: list[bytes] = []
        # Takes a line while the reader waits with nothing queued (its client's fast path, upstream._direct_step):
        # True if it took it, False to queue it as usual.
        self.sink = None
        self.waiter: asyncio.Future | None = None
        self.refusal: StreamRefusal | None = None
        self.clamped: str | None = None
        self.ended = self.lost = False

    def push(self, event: bytes) -> None:
        kind = event[:1]
        if kind == CLAMPED:
            self.clamped = event[1:].decode()
            return
        if kind == END:
            self.ended = True
        elif kind == REFUSED:
            self.refusal = StreamRefusal.model_validate_json(event[1:])
        else:
            if self.sink is not None and self.waiter is not None and not self.lines:
                try:
                    if self.sink(event):
                        return  # on its way to the client: the reader sleeps on
                except Exception:  # noqa: BLE001 -- a fault of this stream's fast path must not reach the socket's others
                    log.exception("stream %d: the fast path failed; the relay goes on without it", self.sid)
                    self.sink = None
            self.lines.append(event)
        self._wake()

    def fail(self) -> None:
        self.lost = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _arrived(self) -> bool:
        """Wait until a line is here (True), the stream ended (False), was refused or the socket lost (raised)."""
        while not self.lines:
            if self.refusal is not None:
                raise Refused(self.refusal)
            if self.ended:
                return False
            if self.lost:
                raise ConnectionResetError("the engine's streams socket was lost")
            self.waiter = self.socket.loop.create_future()  # the socket's loop: get_running_loop() costs a getpid
            try:
                await self.waiter
            finally:
                self.waiter = None
        return True

    async def read_first(self) -> bytes:
        """The first line alone, as an HTTP stream's first readline: the first token goes to the client at once,
        whatever arrived behind it follows as the next read."""
        return self.lines.pop(0) + b"\n" if await self._arrived() else b""

    async def read(self) -> bytes:
        if not await self._arrived():
            return b""
        lines, self.lines = self.lines, []
        return b"\n".join(lines) + b"\n"

    async def finish(self) -> None:
        """The answer is whole: nothing to read to its end (unlike an HTTP body), nothing to abort on close."""
        self.ended = True

    def close(self) -> None:
        """Done with it: a stream that has not ended is aborted on the engine (as closing an HTTP stream does)."""
        if self.socket.streams.pop(self.sid, None) is not None and not (self.ended or self.lost or self.refusal):
            self.socket.send(close_command(self.sid))


class _Socket:
    """One WebSocket to an engine: a reader task dispatching each frame's lines to their streams, a writer task
    sending the commands queued since its last frame as one frame."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, url: str):
        self.ws, self.url = ws, url
        self.loop = asyncio.get_running_loop()
        self.streams: dict[int, EngineStream] = {}
        self.ids = itertools.count()
        self.alive = True
        self.reader = asyncio.create_task(self._read())
        # Frames stay under half the engine's limit (one oversized line goes alone).
        self.writer = FrameWriter(ws.send_bytes, self._send_failed, STREAMS_MAX_FRAME // 2)

    def open(self, command) -> EngineStream:
        """`command(sid)`: the open command's bytes for the new stream's id."""
        if not self.alive:
            raise NotSent(f"the streams socket to {self.url} is closed")
        stream = EngineStream(next(self.ids), self)
        self.streams[stream.sid] = stream
        self.send(command(stream.sid))
        return stream

    def send(self, line: bytes) -> None:
        self.writer.put(line)

    async def _send_failed(self, exc: Exception) -> None:  # the socket is broken: the reader ends and fails its streams
        log.warning("streams socket to %s failed while sending (%s)", self.url, exc.__class__.__name__)
        await self.ws.close()

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    if msg.type is aiohttp.WSMsgType.TEXT:
                        log.warning("streams socket to %s sent text; closing it", self.url)
                    break
                self._dispatch(msg.data)
        except Exception as exc:  # noqa: BLE001 -- whatever broke the socket, its streams are lost (below)
            log.warning("streams socket to %s failed (%s)", self.url, exc.__class__.__name__)
        finally:
            self.alive = False
            self.writer.cancel()
            for stream in self.streams.values():
                stream.fail()
            self.streams.clear()
            with contextlib.suppress(Exception):
                await self.ws.close()

    def _dispatch(self, frame: bytes) -> None:
        streams = self.streams
        for line in frame.split(b"\n"):
            if not line:
                continue
            space = line.find(b" ")
            stream = streams.get(int(line[:space]))  # a malformed line raises: the socket is dropped (see _read)
            if stream is not None:  # None: closed here already (its client hung up)
                stream.push(line[space + 1:])

    async def aclose(self) -> None:
        await self.ws.close()
        self.reader.cancel()
        self.writer.cancel()
        await asyncio.gather(self.reader, self.writer.task, return_exceptions=True)


class StreamsPool:
    """This process's streams sockets: up to `per_engine` per engine URL, opened on first use, requests spread over
    them in turn; a lost socket is replaced on the next request."""

    def __init__(self, http: aiohttp.ClientSession, per_engine: int):
        self.http, self.per_engine = http, per_engine
        self._sockets: dict[str, list[_Socket]] = {}
        self._turn = itertools.count()
        self._connecting: dict[tuple[str, int], asyncio.Task] = {}
        self._unsupported: dict[str, float] = {}

    def usable(self, url: str) -> bool:
        until = self._unsupported.get(url)
        return self.per_engine > 0 and (until is None or time.monotonic() >= until)

    async def open(self, url: str, command) -> EngineStream:
        """A new stream on one of `url`'s sockets. Raises aiohttp's connection errors when the engine cannot be
        reached and StreamsUnsupported when it has no streams socket."""
        sockets = self._sockets.setdefault(url, [])
        sockets[:] = [s for s in sockets if s.alive]
        slot = next(self._turn) % self.per_engine
        if slot < len(sockets):
            return sockets[slot].open(command)
        socket = await self._connect(url, len(sockets))
        return socket.open(command)

    async def _connect(self, url: str, index: int) -> _Socket:
        key = (url, index)
        task = self._connecting.get(key)
        if task is None:  # one handshake per socket however many requests wait for it
            task = asyncio.ensure_future(self._handshake(url))
            self._connecting[key] = task
            task.add_done_callback(lambda _: self._connecting.pop(key, None))
        return await asyncio.shield(task)

    async def _handshake(self, url: str) -> _Socket:
        try:
            ws = await self.http.ws_connect(url + STREAMS_PATH, headers={WIRE_HEADER: str(WIRE_VERSION)},
                                            autoping=True, heartbeat=HEARTBEAT_S, max_msg_size=0,
                                            compress=0)
        except aiohttp.WSServerHandshakeError as exc:
            self._unsupported[url] = time.monotonic() + UNSUPPORTED_RECHECK_S
            raise StreamsUnsupported(f"{url} has no streams socket ({exc.status})") from None
        self._unsupported.pop(url, None)
        socket = _Socket(ws, url)
        self._sockets.setdefault(url, []).append(socket)
        return socket

    async def aclose(self) -> None:
        for task in list(self._connecting.values()):
            task.cancel()
        sockets = [s for group in self._sockets.values() for s in group]
        self._sockets.clear()
        await asyncio.gather(*(s.aclose() for s in sockets), return_exceptions=True)
