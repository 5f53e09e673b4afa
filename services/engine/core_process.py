"""The engine core process: scheduler, KV, adapters, model, sampler -- nothing else. It talks to its front-end
processes over one ZMQ ROUTER socket (services.engine.core_protocol): requests in as token ids, one
`StepOutputs` per step per front-end out.

Between steps it takes every message that has arrived (never blocking while there is work); when idle it
sleeps in `poll`. Requests are owned by the front-end that sent them: a front-end that says `Hello` again (it
was restarted) has its old requests aborted, so a dead front-end costs the core nothing but their KV blocks
until then -- and never the core itself.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import zmq

from services.engine.core_ops import BLOCKING_OPS, OPS, engine_info
from services.engine.core_protocol import (
    Abort,
    Add,
    Call,
    CallReply,
    CoreDead,
    Delta,
    ErrorInfo,
    LOAD_INTERVAL_S,
    Hello,
    Load,
    Ready,
    Shed,
    StepOutputs,
    decode_to_core,
    encode,
)
from services.engine.engine import LLMEngine, RequestOutput
from services.common.wire import EngineUnavailable
from services.engine.sequence import AdapterRef, InvalidRequest, Priority, SamplingParams

log = logging.getLogger("mplex.engine.core")

_REPLIES = "inproc://core-replies"  # blocking ops' replies, back onto the loop thread (sockets are not shared)


class EngineCore:
    def __init__(self, engine: LLMEngine, address: str):
        self.engine = engine
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a step's outputs; a dead peer's are dropped by ROUTER
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted front-end takes its identity over at once
        self.sock.bind(address)
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.bind(_REPLIES)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.replies, zmq.POLLIN)
        self.owner: dict[str, bytes] = {}  # request id -> the front-end (ZMQ identity) that sent it
        self.frontends: set[bytes] = set()
        self.info = engine_info(engine)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="core-op")
        self._load_sent_at = 0.0
        self._local = threading.local()
        self.stop = False

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        try:
            while not self.stop:
                busy = engine.has_unfinished()
                timeout = (50 if engine.last_plan_empty else 0) if busy else 1000
                self._receive(timeout)
                if not engine.has_unfinished():
                    continue
                try:
                    outputs = engine.step()
                except Exception as exc:  # not pinned on one request: fail the running ones, check, go on
                    outputs = engine.recover(exc)  # raises if the state is inconsistent: then the core stops
                if outputs:
                    self._send_outputs(outputs)
                self._publish_load(force=not engine.has_unfinished())
        except BaseException as exc:
            log.exception("engine core stopped: its state could not be trusted")
            for fe in self.frontends:
                self.sock.send_multipart([fe, encode(CoreDead(repr(exc)))])
            raise
        finally:
            if engine.adapters is not None:
                engine.adapters.shutdown()
            if engine.tp is not None:
                engine.tp.close()
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _receive(self, timeout_ms: int) -> None:
        """Take every message waiting (waiting at most `timeout_ms` for the first)."""
        events = dict(self.poller.poll(timeout_ms))
        while events:
            if self.replies in events:
                while self.replies.poll(0):
                    fe, data = self.replies.recv_multipart()
                    self.sock.send_multipart([fe, data])
            if self.sock in events:
                for _ in range(4096):
                    try:
                        fe, data = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(fe, data)
            events = dict(self.poller.poll(0))

    def _handle(self, fe: bytes, data: bytes) -> None:
        try:
            msg = decode_to_core(data)
        except Exception as exc:  # a malformed message is that front-end's bug, never the core's end
            log.error("undecodable message from front-end %r: %r", fe, exc)
            return
        if isinstance(msg, Add):
            self._add(fe, msg)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                if self.owner.get(rid) == fe:
                    del self.owner[rid]
                    self.engine.abort_request(rid, "stop" if msg.reason == "stop" else "abort")
        elif isinstance(msg, Call):
            self._call(fe, msg)
        elif isinstance(msg, Hello):
            self._hello(fe)
        elif isinstance(msg, Shed):
            self._count_shed(Priority(msg.priority))

    def _hello(self, fe: bytes) -> None:
        stale = [rid for rid, owner in self.owner.items() if owner == fe]
        if stale:
            log.warning("front-end %r restarted: aborting its %d requests", fe, len(stale))
        for rid in stale:
            del self.owner[rid]
            self.engine.abort_request(rid)
        self.frontends.add(fe)
        self.sock.send_multipart([fe, encode(Ready(self.info))])
        self.sock.send_multipart([fe, encode(Load.of(self.engine.load.snapshot))])

    def _publish_load(self, force: bool = False) -> None:
        """Every front-end gets the admission snapshot after a step, at most every LOAD_INTERVAL_S: what it
        refuses on at once (one small message; steps under load take longer than the interval anyway).
        `force` after the last step before idling: no step follows to correct a skipped one, and a front-end
        must not keep refusing on a busy view of an idle core."""
        now = time.monotonic()
        if not force and now - self._load_sent_at < LOAD_INTERVAL_S:
            return
        self._load_sent_at = now
        data = encode(Load.of(self.engine.load.snapshot))
        for fe in self.frontends:
            self.sock.send_multipart([fe, data])

    def _count_shed(self, priority: Priority) -> None:
        engine = self.engine
        engine.metrics.shed.labels(model=engine.config.model_name, priority=priority.name.lower()).inc()
        engine.load.mark_overloaded(time.monotonic())

    def _add(self, fe: bytes, msg: Add) -> None:
        engine = self.engine
        try:
            if engine.draining:  # whichever front-end was told to drain: none admits any more
                raise EngineUnavailable("this engine is draining; retry on another engine", code="engine_draining")
            if msg.request_id in self.owner:
                raise InvalidRequest(f"request id {msg.request_id!r} is already in flight", "request_id", status=409)
            params = SamplingParams.from_wire(msg.sampling)
            priority = Priority(msg.priority)
            adapter = AdapterRef(*msg.adapter) if msg.adapter else None
            engine.validate(msg.prompt_token_ids, params)
            try:  # the front-end checked on the last Load; this is the check on the newest state
                engine.load.check(msg.tenant, msg.weight, priority, len(msg.prompt_token_ids))
            except Exception:
                engine.metrics.shed.labels(model=engine.config.model_name, priority=priority.name.lower()).inc()
                raise
            engine.add_request(msg.request_id, msg.prompt_token_ids, params, priority=priority,
                               cache_salt=msg.cache_salt, adapter=adapter, tenant=msg.tenant, weight=msg.weight)
        except Exception as exc:  # refused: tell that request only
            delta = Delta(msg.request_id, [], "error", error=ErrorInfo.of(exc))
            self.sock.send_multipart([fe, encode(StepOutputs([delta]))])
            return
        self.owner[msg.request_id] = fe

    def _call(self, fe: bytes, msg: Call) -> None:
        fn = OPS.get(msg.op)
        if fn is None:
            self.sock.send_multipart([fe, encode(CallReply(msg.call_id, None, ErrorInfo(False, f"no op {msg.op!r}")))])
        elif msg.op in BLOCKING_OPS:
            self.pool.submit(self._call_off_loop, fe, msg, fn)
        else:
            self.sock.send_multipart([fe, encode(_reply(msg, fn, self.engine))])

    def _call_off_loop(self, fe: bytes, msg: Call, fn) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.connect(_REPLIES)
        push.send_multipart([fe, encode(_reply(msg, fn, self.engine))])
        self.engine.wake.set()

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """One message per front-end for the whole step."""
        by_fe: dict[bytes, list[Delta]] = defaultdict(list)
        owner = self.owner
        for out in outputs:
            fe = owner.get(out.request_id)
            if fe is None:
                continue  # aborted meanwhile
            if out.finished:
                del owner[out.request_id]
            by_fe[fe].append(_delta(out))
        for fe, deltas in by_fe.items():
            self.sock.send_multipart([fe, encode(StepOutputs(deltas))])


def _delta(out: RequestOutput) -> Delta:
    lps = None
    if out.logprobs is not None:
        lps = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
    return Delta(out.request_id, out.new_token_ids, out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                 out.num_output_tokens, out.compute_seconds, lps,
                 ErrorInfo.of(out.error) if out.error is not None else None, out.clamped_from, out.num_draft_tokens,
                 out.num_accepted_tokens)


def _reply(msg: Call, fn, engine: LLMEngine) -> CallReply:
    try:
        return CallReply(msg.call_id, fn(engine, *msg.args))
    except Exception as exc:
        return CallReply(msg.call_id, None, ErrorInfo.of(exc))


def run_core(config, address: str, num_threads: int, log_level: str, nice: int = 0) -> None:
    """The core process's entry point (spawned by services.engine.launcher). `nice` > 0: the core runs at that
    niceness and SCHED_BATCH, set before torch starts its threads (they inherit it; cpu_priority.py)."""
    from services.common.cpu_priority import lower_cpu_priority, lower_group_priority
    from services.common.gc_tuning import freeze_startup_heap, service_process
    from services.common.logging import configure

    from services.engine.heap import keep_step_memory
    from services.engine.process_life import die_with_parent

    die_with_parent()
    service_process()
    configure("engine", log_level)
    keep_step_memory()  # before the model's first step: its tensors' pages are reused, not faulted in afresh
    if nice:
        lower_group_priority(nice, who="engine core")  # else, under autogroup, the niceness below orders nothing
        lower_cpu_priority(nice, batch_policy=True, who="engine core")
    import torch

    if num_threads > 0:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    core = EngineCore(LLMEngine(config, detokenize=False), address)
    if core.engine.tp is not None:  # a dead rank ends this process as a crash would: front-ends fail over
        core.engine.tp.exit_on_failure = True
    log.info("engine core ready in %.1f s: %d torch threads, pid %d", time.perf_counter() - t0,
             torch.get_num_threads(), os.getpid())
    freeze_startup_heap()  # the loaded engine's objects never become garbage: full collections skip them

    def _stop(*_):
        core.stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher decides
    try:
        core.run()
    except BaseException:
        os._exit(1)
