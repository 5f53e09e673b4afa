"""Runs the engine's step loop on its own thread and streams each request's outputs to asyncio.

Requests and aborts cross into the loop thread through a command queue; each step's outputs cross
back in one `call_soon_threadsafe` per step (not per token), so the event loop stays responsive.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.streaming import Handoff
from services.common.wire import EngineUnavailable, InvalidRequest
from services.engine.core_ops import BLOCKING_OPS, OPS, engine_info
from services.engine.core_protocol import EngineInfo
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.sequence import AdapterRef, Priority, SamplingParams

log = logging.getLogger("mplex.engine")


class EngineDead(EngineUnavailable):
    """The step loop stopped; requests cannot be served here (another engine may)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: Priority
    cache_salt: str
    adapter: AdapterRef | None
    tenant: str
    weight: float


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: object  # callable(engine) -> result, run on the step-loop thread
    future: asyncio.Future


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_death=None):
        self.engine = engine
        self.on_death = on_death  # called (on the loop thread) if the step loop stops for good
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = engine.wake
        self._queues: dict[str, Handoff] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self._info: EngineInfo | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def open(self) -> None:
        self.start(asyncio.get_running_loop())

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            self._info = engine_info(self.engine)
        return self._info

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def op(self, name: str, *args):
        """Run a named operation (services.engine.core_ops): between steps on the loop thread, or -- for the
        blocking ones -- on a worker thread, as the core process does."""
        fn = OPS[name]
        if name in BLOCKING_OPS:
            return await asyncio.to_thread(fn, self.engine, *args)
        return await self.call(lambda e: fn(e, *args))

    # -- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: Priority = Priority.INTERACTIVE,
        cache_salt: str = "",
        adapter: AdapterRef | None = None,
        tenant: str = "",
        weight: float = 1.0,
        sink=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one output per step until the request finishes. Closing the iterator aborts it. Refuses at
        once (EngineUnavailable, engine_overloaded) a request that could not get its first token within its
        class's budget here. `sink` (output -> bool): a step's output that arrives while this waits with nothing
        queued -- never the last one, nor an error -- is offered to it first, and not yielded here if it took it
        (the client's fast path, as CoreClient.generate's)."""
        if not self.alive:
            raise EngineDead("the engine step loop is not running")
        self.engine.validate(prompt_token_ids, params)  # raise bad input here, before anything is queued
        try:
            self.engine.load.check(tenant, weight, priority, len(prompt_token_ids))
        except EngineUnavailable:
            self.engine.metrics.shed.labels(model=self.engine.config.model_name, priority=priority.name.lower()).inc()
            raise
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already in flight", "request_id", status=409)
        q = self._queues[request_id] = Handoff(sink, f"request {request_id}")
        self._send(_Add(request_id, list(prompt_token_ids), params, priority, cache_salt, adapter, tenant, weight))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, _Failure):
                    finished = True
                    raise item.error
                if item.error is not None:
                    finished = True
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def call(self, fn):
        """Run `fn(engine)` on the step-loop thread (which owns all engine state) and return its result."""
        if not self.alive:
            raise EngineDead("the engine step loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, fut))
        return await fut

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                try:
                    self._drain_commands()
                    if not engine.has_unfinished():
                        t0 = time.perf_counter()
                        self._wake.wait(timeout=1.0)
                        self._wake.clear()
                        engine.metrics.idle_seconds.inc(time.perf_counter() - t0)
                        continue
                    outputs = engine.step()
                except Exception as exc:  # not pinned on one request: fail the running ones, check, go on
                    outputs = engine.recover(exc)  # raises if the state is inconsistent: then the loop stops
                if outputs:
                    self._deliver(outputs)
                if engine.last_plan_empty:  # everything waits on an adapter load: sleep until one lands
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as exc:  # the loop must never die silently: fail every waiting request
            log.exception("engine step loop stopped: its state could not be trusted")
            self.error = exc
            self._fail_all(EngineDead(f"engine step loop stopped: {exc!r}"))
            if self.on_death is not None:
                self.on_death()
        finally:
            if engine.adapters is not None:
                engine.adapters.shutdown()

    def _drain_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                if cmd.request_id not in self._queues:
                    continue  # the client went away before the request was admitted
                try:
                    engine.add_request(
                        cmd.request_id, cmd.prompt, cmd.params,
                        priority=cmd.priority, cache_salt=cmd.cache_salt, adapter=cmd.adapter,
                        tenant=cmd.tenant, weight=cmd.weight,
                    )
                except Exception as exc:  # refused (e.g. an adapter that cannot load): tell that request only
                    self._deliver_one(cmd.request_id, _Failure(exc))
            elif isinstance(cmd, _Call):
                try:
                    result = cmd.fn(engine)
                except Exception as exc:  # handed back to the awaiting caller
                    self._loop.call_soon_threadsafe(_settle, cmd.future, None, exc)
                else:
                    self._loop.call_soon_threadsafe(_settle, cmd.future, result, None)
            else:
                engine.abort_request(cmd.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _deliver_one(self, request_id: str, item) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch_one, request_id, item)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put(out, offer=not out.finished and out.error is None)

    def _dispatch_one(self, request_id: str, item) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put(item, offer=False)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None:
            return

        def fail() -> None:
            for q in self._queues.values():
                q.put(_Failure(error), offer=False)

        self._loop.call_soon_threadsafe(fail)


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
