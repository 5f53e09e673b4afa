"""Preemption by swap or by recompute, chosen by measured cost.

A preempted sequence either has its KV copied to the host tier and back (swap: bytes over the
measured copy bandwidth, both ways) or is computed again (recompute: its computed tokens at the
measured prefill cost per token). The engine feeds both running estimates from what it observes every
step; the scheduler asks `choose` when it preempts. Recompute is the fallback: without a host tier,
without room in it, or when it is cheaper.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.kv.manager import SwapEstimate


class PreemptKind(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(slots=True)
class RunningMean:
    """An exponentially weighted ratio sum(w * num) / sum(w * den): each observation counts by its size,
    older ones fade by `decay` per observation."""

    decay: float = 0.9
    num: float = 0.0
    den: float = 0.0

    def observe(self, num: float, den: float) -> None:
        self.num = self.num * self.decay + num
        self.den = self.den * self.decay + den

    @property
    def value(self) -> float | None:
        return self.num / self.den if self.den > 0 else None


@dataclass(slots=True)
class Decision:
    kind: PreemptKind
    swap_seconds: float | None
    recompute_seconds: float | None


@dataclass(slots=True)
class PreemptionCostModel:
    block_bytes: int  # bytes of one block's KV state (every tensor of the runner's kv_block_tensors)
    mode: str = "auto"  # auto | swap | recompute (CacheConfig.preemption_mode)
    copy: RunningMean = field(default_factory=RunningMean)  # seconds per byte, host <-> device
    prefill: RunningMean = field(default_factory=RunningMean)  # seconds per token of prefill-bearing steps
    decisions: dict[PreemptKind, int] = field(default_factory=lambda: {k: 0 for k in PreemptKind})
    last: Decision | None = None

    # -- measurements --------------------------------------------------------------------------
    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.copy.observe(seconds, num_bytes)

    def observe_step(self, prefill_tokens: int, batched_tokens: int, seconds: float) -> None:
        """A step's wall time per token, from steps that computed prompt tokens: what recomputing costs.
        It includes the step's fixed cost and its decode rows, so it errs towards recompute looking
        dearer; recompute and swap costs are usually orders of magnitude apart."""
        if prefill_tokens > 0 and seconds > 0:
            self.prefill.observe(seconds, batched_tokens)

    @property
    def copy_bytes_per_second(self) -> float | None:
        v = self.copy.value
        return 1 / v if v else None

    @property
    def prefill_seconds_per_token(self) -> float | None:
        return self.prefill.value

    # -- the decision --------------------------------------------------------------------------
    def swap_seconds(self, est: SwapEstimate) -> float | None:
        per_byte = self.copy.value
        return None if per_byte is None else 2 * est.copy_blocks * self.block_bytes * per_byte

    def recompute_seconds(self, est: SwapEstimate) -> float | None:
        per_token = self.prefill.value
        return None if per_token is None else est.recompute_tokens * per_token

    def choose(self, est: SwapEstimate) -> PreemptKind:
        swap, recompute = self.swap_seconds(est), self.recompute_seconds(est)
        if not est.host_room or est.recompute_tokens == 0 or self.mode == "recompute":
            kind = PreemptKind.RECOMPUTE
        elif self.mode == "swap":
            kind = PreemptKind.SWAP
        elif swap is None:
            kind = PreemptKind.RECOMPUTE
        elif recompute is None:  # no prefill measured yet: a copy of a token's KV is far cheaper than its forward
            kind = PreemptKind.SWAP
        else:
            kind = PreemptKind.SWAP if swap < recompute else PreemptKind.RECOMPUTE
        self.decisions[kind] += 1
        self.last = Decision(kind, swap, recompute)
        return kind
