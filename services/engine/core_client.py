"""A front-end process's handle on the engine core: the same surface as the in-process `AsyncEngine`
(generate, abort, op, validate, info, alive), over the ZMQ socket of services.engine.core_protocol.

The text side of a request lives here, off the core's critical path: incremental detokenization and stop
strings (`TextStream`). A stop string ends the request here at once and tells the core (`Abort`, reason
"stop"); tokens the core produced meanwhile are dropped. Each step's message from the core is dispatched to
the requests' queues in one pass.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from services.common.streaming import Handoff
from services.common.wire import EngineFailed, EngineUnavailable, InvalidRequest
from services.engine.admission import LoadTracker
from services.engine.async_engine import EngineDead
from services.engine.core_protocol import (
    Abort,
    Add,
    Call,
    CallReply,
    CoreDead,
    Delta,
    EngineInfo,
    Hello,
    Load,
    Ready,
    Shed,
    StepOutputs,
    decode_to_frontend,
    encode,
)
from services.engine.detokenizer import DecodeStream, StopMatcher, TokenizerInfo
from services.engine.engine import RequestOutput, TokenLogprob, validate_request
from services.engine.sequence import AdapterRef, Priority, SamplingParams

log = logging.getLogger("mplex.engine.frontend")


class TextStream:
    """One request's text: the same decisions, in the same order, as LLMEngine._append_token makes when it
    detokenizes itself (so the split path's text and finish reasons are the in-process ones)."""

    __slots__ = ("params", "decoder", "stops")

    def __init__(self, tokenizer: TokenizerInfo, params: SamplingParams):
        self.params = params
        self.decoder = DecodeStream(tokenizer, params.skip_special_tokens)
        self.stops = StopMatcher(params.stop)

    def push(self, token: int, core_reason: str | None, num_output_tokens: int) -> tuple[str, str | None]:
        past_min = num_output_tokens >= self.params.min_tokens
        if core_reason == "stop":  # EOS or a stop token id: its text is never shown
            text, stop_string = "", False
        else:
            text, stop_string = self.stops.push(self.decoder.push(token), check=past_min)
        reason = "stop" if stop_string else core_reason
        if reason is not None and not stop_string:  # release held-back text: nothing can complete a stop string
            tail, stop_string = self.stops.push(self.decoder.flush(), check=past_min)
            text += tail if stop_string else tail + self.stops.flush()
        return text, reason


class _Request:
    __slots__ = ("request_id", "items", "text", "done")

    def __init__(self, request_id: str, text: TextStream, sink=None):
        self.request_id = request_id  # the caller's id (the core knows this request by its own id, see generate)
        # Its outputs, and the client response's fast path past its consumer (server._direct_output).
        self.items = Handoff(sink, f"request {request_id}")
        self.text = text
        self.done = False


class CoreClient:
    def __init__(self, address: str, frontend_id: str):
        self.address = address
        self.identity = frontend_id.encode()
        self.info: EngineInfo | None = None
        self.tokenizer: TokenizerInfo | None = None
        self._requests: dict[str, _Request] = {}  # by the core's id of each request
        self._core_ids: dict[str, str] = {}  # the caller's request id -> the core's id, while in flight
        self._incarnations = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._pidfd: int | None = None
        self.error: BaseException | None = None
        self.admission: LoadTracker | None = None  # the core's last Load: refusals decided here, at once

    # -- lifecycle ------------------------------------------------------------------------------------
    async def open(self, timeout: float = 600.0) -> None:
        """Connect and wait for the core's `Ready` (it may still be loading the model)."""
        ctx = zmq.asyncio.Context.instance()
        sock = self._sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.address)
        await sock.send(encode(Hello(self.identity.decode())))
        msg = None
        async with asyncio.timeout(timeout):
            while not isinstance(msg, Ready):  # what the core sent a previous front-end of this identity: stale
                msg = decode_to_frontend(await sock.recv())
        self.info = msg.info
        self.tokenizer = TokenizerInfo(msg.info.model_dir)
        if msg.info.admission is not None:
            self.admission = LoadTracker.for_frontend(msg.info.admission)
        self._watch_core(msg.info.core_pid)
        self._reader = asyncio.create_task(self._read(), name="core-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._sock is not None:
            self._sock.close()

    def _watch_core(self, pid: int) -> None:
        """A core that dies without a word (a crash in a native kernel) is seen at once: its pidfd turns readable."""
        try:
            self._pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return
        asyncio.get_running_loop().add_reader(self._pidfd, self._core_died, f"engine core (pid {pid}) exited")

    def _core_died(self, reason: str) -> None:
        if self.error is None:
            log.error("engine core is dead: %s", reason)
            self.error = EngineDead(f"engine core stopped: {reason}")
        lost = EngineFailed(f"the engine failed while serving this request: {reason}")
        for req in self._requests.values():  # in the core's hands when it died: not retried elsewhere
            if not req.done:
                req.done = True
                req.items.put(lost, offer=False)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(self.error)

    @property
    def alive(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        i = self.info
        validate_request(prompt_token_ids, params, vocab_size=i.vocab_size, max_model_len=i.max_model_len,
                         block_size=i.block_size, num_blocks=i.num_blocks)

    # -- requests -------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: Priority = Priority.INTERACTIVE, cache_salt: str = "",
                       adapter: AdapterRef | None = None, tenant: str = "",
                       weight: float = 1.0, sink=None) -> AsyncIterator[RequestOutput]:
        """One output per step until the request finishes; closing the iterator aborts it in the core. `sink`
        (RequestOutput -> bool): a step's output that arrives while this waits with nothing queued -- never the
        last one -- is offered to it first, and not yielded here if it took it (the client's fast path)."""
        if not self.alive:
            raise EngineDead("the engine core is not running")
        self.validate(prompt_token_ids, params)
        if request_id in self._core_ids:
            raise InvalidRequest(f"request id {request_id!r} is already in flight", "request_id", status=409)
        self._admit(tenant, weight, priority, len(prompt_token_ids))
        # The core knows each request by an id of this front-end's making: a request that ended here first (a stop
        # string) still runs in the core until the Abort arrives, and its outputs already on their way must not be
        # taken for a new request under the same caller id (nor the new one refused as its duplicate).
        core_id = f"{request_id}#{next(self._incarnations)}"
        self._core_ids[request_id] = core_id
        req = self._requests[core_id] = _Request(request_id, TextStream(self.tokenizer, params), sink)
        spec = (adapter.content_id, adapter.name, adapter.path) if adapter is not None else None
        self._send(Add(core_id, list(prompt_token_ids), params.to_wire(), int(priority), cache_salt, spec,
                       tenant, weight))
        try:
            while True:
                item = await req.items.get()
                if isinstance(item, BaseException):
                    req.done = True
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._requests.pop(core_id, None)
            self._core_ids.pop(request_id, None)
            if not req.done and self.error is None:
                self._send(Abort([core_id]))

    def _admit(self, tenant: str, weight: float, priority: Priority, prompt_len: int) -> None:
        """Refuse (EngineUnavailable, engine_overloaded) what the core's last Load says must wait for seats past
        its TTFT budget: at once, without the round trip through the step loop; the core is told, to count it.
        Anything else goes to the core, which checks again on its newest state."""
        if self.admission is None:
            return
        try:
            self.admission.check(tenant, weight, priority, prompt_len, early=True)
        except EngineUnavailable:
            self._send(Shed(int(priority)))
            raise

    def abort(self, request_id: str) -> None:
        core_id = self._core_ids.get(request_id)
        if core_id is not None:
            self._send(Abort([core_id]))

    async def op(self, name: str, *args):
        """Run a named core operation (services.engine.core_ops) and return its result."""
        if not self.alive:
            raise EngineDead("the engine core is not running")
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(Call(call_id, name, list(args)))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg) -> None:
        if self._sock.closed:
            return  # closing down: the core drops this front-end's requests when it says Hello again
        self._sock.send(encode(msg))  # never blocks (no high-water mark): queued by ZMQ's I/O thread

    # -- the reader -----------------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            await self._read_loop()
        except zmq.ZMQError as exc:  # the socket is gone: nothing more can come from the core
            self._core_died(f"the core socket failed: {exc}")

    async def _read_loop(self) -> None:
        sock = self._sock
        while True:
            msg = decode_to_frontend(await sock.recv())
            if isinstance(msg, StepOutputs):
                self._dispatch(msg.deltas)
            elif isinstance(msg, CallReply):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    if msg.error is not None:
                        fut.set_exception(msg.error.to_exception())
                    else:
                        fut.set_result(msg.result)
            elif isinstance(msg, Load):
                if self.admission is not None:
                    self.admission.snapshot = msg.snapshot()
            elif isinstance(msg, CoreDead):
                self._core_died(msg.reason)

    def _dispatch(self, deltas: list[Delta]) -> None:
        stops: list[str] = []
        for d in deltas:
            req = self._requests.get(d.request_id)
            if req is None or req.done:
                continue
            if d.error is not None:
                req.done = True
                req.items.put(d.error.to_exception(), offer=False)
                continue
            out = self._output(req, d)
            if out.finished:
                req.done = True
                if d.finish_reason is None:  # a stop string, seen here first: the core is still generating
                    stops.append(d.request_id)
            req.items.put(out, offer=not out.finished)  # the last output always reaches the consumer
        if stops:
            self._send(Abort(stops, "stop"))

    def _output(self, req: _Request, d: Delta) -> RequestOutput:
        # One token a step, or several when a speculative draft was accepted: each is pushed with its own
        # output count and the core's reason only on the last, and a stop string ends the delta at its token
        # (the tokens after it are never shown nor counted, as in-process).
        text, reason = "", d.finish_reason
        tokens = d.token_ids
        last = len(tokens) - 1
        for j, token in enumerate(tokens):
            piece, reason = req.text.push(token, d.finish_reason if j == last else None,
                                          d.num_output_tokens - (last - j))
            text += piece
            if reason is not None:
                tokens = tokens[: j + 1]
                break
        dropped = len(d.token_ids) - len(tokens)
        lps = None
        if d.logprobs is not None:
            lps = [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in d.logprobs[: len(tokens)]]
        return RequestOutput(req.request_id, tokens, text, reason is not None, reason, d.num_prompt_tokens,
                             d.num_cached_tokens, d.num_output_tokens - dropped, d.compute_seconds, lps,
                             clamped_from=d.clamped_from, num_draft_tokens=d.num_draft_tokens,
                             num_accepted_tokens=d.num_accepted_tokens)
