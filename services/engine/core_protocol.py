"""The engine core <-> front-end protocol, one owner for both sides: msgspec structs over one ZMQ
ROUTER (core) / DEALER (front-end) socket pair.

Token ids cross, never text: the front-end tokenizes, detokenizes and matches stop strings. The core sends
each front-end one `StepOutputs` per step (all of that front-end's requests' deltas of the step), never one
message per token. Aborts cross as soon as a client goes away. The core trusts what a front-end sends no
more than the HTTP server trusted its callers: `SamplingParams.from_wire` re-checks every value.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from services.common.wire import EngineUnavailable, InvalidRequest


class EngineInfo(msgspec.Struct, frozen=True):
    """What a front-end needs to know about the core it talks to (sent once, in reply to `Hello`)."""

    model_name: str
    model_dir: str
    engine_id: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    lora_enabled: bool
    adapter_cache_dir: str | None
    adapter_stores: tuple[str, ...]
    clamp_tokens: int | None  # batch_max_tokens_under_overload
    core_pid: int
    # The SchedulerConfig fields SLO admission reads (admission.ADMISSION_FIELDS): a front-end refuses
    # over-budget work itself on the core's last `Load`, as the core would.
    admission: dict[str, Any] | None = None


# -- front-end -> core ------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A front-end (re)connected: the core forgets every request it held for this identity before."""

    frontend: str


class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_wire()
    priority: int
    cache_salt: str = ""
    adapter: tuple[str, str, str | None] | None = None  # (content_id, name, path or URI)
    tenant: str = ""
    weight: float = 1.0


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests now. `reason` "stop": the front-end matched a stop string (counted as a stop)."""

    request_ids: list[str]
    reason: str = "abort"


class Call(msgspec.Struct, tag="call", array_like=True):
    """Run a named core operation (services.engine.core_ops.OPS) and reply with `CallReply`."""

    call_id: int
    op: str
    args: list[Any] = []


class Shed(msgspec.Struct, tag="shed", array_like=True):
    """A front-end refused a request on the core's last `Load` (engine_overloaded) without sending it: the
    core counts it as its own refusals (the shed metric, the overload window that clamps batch work)."""

    priority: int


ToCore = Union[Hello, Add, Abort, Call, Shed]


# -- core -> front-end ------------------------------------------------------------------------------------
class ErrorInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """An InvalidRequest or EngineUnavailable, as it crosses (the front-end raises the same exception)."""

    engine_fault: bool
    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    retry_after: int | None = None

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        if isinstance(exc, EngineUnavailable):
            return cls(True, exc.message, None, exc.code, exc.status, exc.retry_after)
        if isinstance(exc, InvalidRequest):
            return cls(False, exc.message, exc.param, exc.code, exc.status)
        return cls(False, f"the engine failed while serving this request ({type(exc).__name__})", None,
                   "request_failed", 500)

    def to_exception(self) -> InvalidRequest | EngineUnavailable:
        if self.engine_fault:
            return EngineUnavailable(self.message, code=self.code or "engine_unavailable", retry_after=self.retry_after)
        return InvalidRequest(self.message, self.param, self.code, self.status)


class Delta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's tokens of one step, and its running totals."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    compute_seconds: float = 0.0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # (token, logprob, top)
    error: ErrorInfo | None = None
    clamped_from: int | None = None
    num_draft_tokens: int = 0  # speculative decoding: running totals, drafted and accepted
    num_accepted_tokens: int = 0


class StepOutputs(msgspec.Struct, tag="out", array_like=True):
    deltas: list[Delta]


class CallReply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class Load(msgspec.Struct, tag="load", array_like=True):
    """The core's admission snapshot (admission.LoadSnapshot), sent to every front-end after steps (at most
    every LOAD_INTERVAL_S) and on Hello, so that a front-end refuses work that cannot meet its TTFT budget at
    once -- without a round trip through the step loop, which under load is where refusals waited."""

    at: float  # time.monotonic() of the core (one clock for every process on the host)
    step_s: float
    finish_rate: float | None
    free_seats: int
    running: dict[str, int]
    weights: dict[str, float]
    waiting: list[tuple[int, str, int, float]]  # (class, tenant key, waiting, oldest arrival)
    overloaded_until: float

    @classmethod
    def of(cls, snap) -> "Load":
        return cls(snap.at, snap.step_s, snap.finish_rate, snap.free_seats, snap.running, snap.weights,
                   [(c, k, n, snap.oldest[(c, k)]) for (c, k), n in snap.waiting.items()], snap.overloaded_until)

    def snapshot(self):
        from services.engine.admission import LoadSnapshot

        return LoadSnapshot(at=self.at, step_s=self.step_s, finish_rate=self.finish_rate, free_seats=self.free_seats,
                            running=self.running, weights=self.weights,
                            waiting={(c, k): n for c, k, n, _ in self.waiting},
                            oldest={(c, k): t for c, k, _, t in self.waiting}, overloaded_until=self.overloaded_until)


LOAD_INTERVAL_S = 0.01


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The core's step loop stopped (its state could not be trusted); the process exits next."""

    reason: str


ToFrontend = Union[StepOutputs, CallReply, Ready, CoreDead, Load]

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_frontend = msgspec.msgpack.Decoder(ToFrontend)


def encode(msg: ToCore | ToFrontend) -> bytes:
    return _encoder.encode(msg)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_to_frontend(data: bytes) -> ToFrontend:
    return _to_frontend.decode(data)
