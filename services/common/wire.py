"""Wire types shared by the gateway and the engine: sampling parameters, priorities, adapter identity,
the limits every request is held to, and how a failure says whose fault it was.

Kept free of torch so the gateway can validate requests exactly as the engine will. `SamplingParams`
cannot hold a value the engine's tensors, numpy or C kernels cannot take: every field is type- and
range-checked when it is built, whoever builds it (the gateway's OpenAI parser, the engine's own API,
the internal stream request, offline use).
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

# -- limits every side enforces -----------------------------------------------------------------------
MAX_INT32 = 2**31 - 1  # token counts and ids cross into int32/int64 tensors and C kernels
MAX_N = 8  # choices per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions list
MAX_CHOICES = 64  # prompts x n: each is its own engine sequence (and concurrent-request unit)
MAX_STOP = 8
MAX_STOP_CHARS = 256  # each stop string is matched against every new token's text on the step loop
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform to float32 precision
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM): 1/t would overflow float32
SEED_MIN, SEED_END = -(2**63), 2**64  # signed or unsigned 64-bit seeds are both accepted
MAX_GUIDE_CHARS = 64 * 1024  # a structured-output spec's JSON text (structured.Guide owns what it holds)

# A failure's owner travels with it from the engine to the gateway (response header on errors, a field
# on an in-stream error line): only the engine's own faults are retried on another engine.
FAULT_HEADER = "x-mplex-fault"
FAULT_REQUEST = "request"  # this request's input or state: never retried anywhere
FAULT_ENGINE = "engine"  # the engine cannot serve now (dead, draining, overloaded): another may
# Under sustained overload an engine clamps batch-class max_tokens; the new limit travels in this header
# (engine -> gateway -> client).
CLAMPED_HEADER = "x-mplex-max-tokens-clamped"


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error shape)."""

    fault = FAULT_REQUEST

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    @property
    def error_type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


class RequestFailed(InvalidRequest):
    """The engine failed while serving this request (an error it could pin on the request, not a
    refusal): that client gets a 500, its resources are released, and it is not retried elsewhere."""

    def __init__(self, message: str, code: str = "request_failed"):
        super().__init__(message, None, code, status=500)


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (step loop dead, draining, overloaded): another engine may."""

    fault = FAULT_ENGINE
    status = 503

    def __init__(self, message: str, code: str = "engine_unavailable", retry_after: int | None = None):
        super().__init__(message)
        self.message, self.code, self.retry_after = message, code, retry_after


class EngineFailed(EngineUnavailable):
    """The engine died with this request in its hands (its core process crashed mid-step): as a connection the
    engine dropped, never retried on another engine -- the request may be what killed it."""

    status = 502
    CODE = "engine_failed"

    def __init__(self, message: str):
        super().__init__(message, code=self.CODE)


class Priority(enum.IntEnum):
    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str | int | None) -> "Priority":
        if value is None:
            return cls.INTERACTIVE
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return cls(value)
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise InvalidRequest("priority must be 'interactive' or 'batch'", "priority")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_text(value: Any, param: str) -> None:
    """Refuse strings that are not valid Unicode (lone surrogates from JSON `\\ud800` escapes): they cannot
    be tokenized, encoded as UTF-8 or logged. Walks lists and dicts; `param` names the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{param} is not valid Unicode (lone surrogate at character {exc.start})", param) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, param)
            check_text(v, f"{param}.{k}" if isinstance(k, str) and k.isidentifier() else param)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{param}[{i}]")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None  # signed or unsigned 64-bit; `seed64` is what the sampler uses
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: chosen token's logprob plus top-n alternatives
    skip_special_tokens: bool = True
    # What the output is constrained to: a structured.Guide's canonical JSON text (the engine parses and
    # compiles it, refusing what it cannot enforce); None: free text.
    guide: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        temperature = _float(self.temperature, "temperature")
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature!r}", "temperature")
        top_p = _float(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        object.__setattr__(self, "temperature", 0.0 if temperature < GREEDY_BELOW else temperature)
        object.__setattr__(self, "top_p", top_p)
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise InvalidRequest(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed < SEED_END):
            raise InvalidRequest("seed must be an integer that fits in 64 bits", "seed")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens must be between 0 and max_tokens", "min_tokens")
        if (not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP
                or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)):
            raise InvalidRequest(f"stop must be up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
        check_text(self.stop, "stop")
        if (not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or any(not is_int(t) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids)):
            raise InvalidRequest(f"stop_token_ids must be up to {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
        if self.guide is not None and (not isinstance(self.guide, str) or not 0 < len(self.guide) <= MAX_GUIDE_CHARS):
            raise InvalidRequest(f"guide must be a JSON text of at most {MAX_GUIDE_CHARS} characters", "guide")
        if self.guide is not None and self.min_tokens:  # banning eos could leave a grammar no legal token
            raise InvalidRequest("min_tokens cannot be combined with response_format or a forced tool call",
                                 "min_tokens")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean", name)

    @classmethod
    def from_wire(cls, d: Any) -> SamplingParams:
        """From its JSON object (the engine's internal request): unknown fields are refused, not dropped, and
        __post_init__ checks every value, so a JSON value of the wrong type is named like any other."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise InvalidRequest("sampling must be an object", "sampling")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown sampling fields: {sorted(map(str, unknown))}", "sampling")
        kw = dict(d)
        for key in ("stop", "stop_token_ids"):
            if key in kw:
                if kw[key] is not None and not isinstance(kw[key], list):
                    raise InvalidRequest(f"sampling.{key} must be a list", f"sampling.{key}")
                kw[key] = tuple(kw[key] or ())
        return cls(**kw)

    def to_wire(self) -> dict[str, Any]:
        """Its JSON object: the fields that differ from the defaults (the receiver fills in the rest)."""
        return {f.name: list(v) if isinstance(v, tuple) else v for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) != f.default}

    def check_for_model(self, vocab_size: int) -> None:
        """The checks that need the model: token ids inside its vocabulary, top_k no wider than it."""
        if self.top_k > vocab_size:
            raise InvalidRequest(f"top_k must be at most the vocabulary size ({vocab_size}), got {self.top_k}", "top_k")
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seed64(self) -> int | None:
        """The seed as a signed 64-bit integer (unsigned seeds wrap), the sampler's int64 domain."""
        if self.seed is None:
            return None
        return self.seed - 2**64 if self.seed >= 2**63 else self.seed

    def with_seed_offset(self, k: int) -> "SamplingParams":
        """The params of choice `k` of a request: its own seed (seed + k, wrapped into 64 bits)."""
        if k == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=(self.seed + k) % 2**64)


def _float(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {v!r}", name)
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        raise InvalidRequest(f"{name} must be a finite number", name) from None
    if not math.isfinite(f):
        raise InvalidRequest(f"{name} must be a finite number, got {v!r}", name)
    return f


def check_prompt_ids(ids: Any, vocab_size: int, param: str = "prompt") -> None:
    """Token-id prompts: a non-empty list of integers in [0, vocab)."""
    if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
        raise InvalidRequest("token prompts must be non-empty lists of integers", param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param)


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """Which adapter a request runs under: identified by the sha256 of its weights, never by name."""

    content_id: str
    name: str = ""
    path: str | None = None
