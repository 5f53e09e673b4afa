"""Wire types shared by the gateway and the engine: sampling parameters, priorities, adapter identity.

Kept free of torch so the gateway can validate requests exactly as the engine will.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


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


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: chosen token's logprob plus top-n alternatives
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k!r}", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens must be between 0 and max_tokens", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", "top_logprobs")
        if len(self.stop) > 8 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be up to 8 non-empty strings", "stop")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequest("seed must fit in 64 bits", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """Which adapter a request runs under: identified by the sha256 of its weights, never by name."""

    content_id: str
    name: str = ""
    path: str | None = None


