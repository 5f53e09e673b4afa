"""How many batch lines may be in flight now: additive increase while the engines are idle enough, halving
as soon as other load shows in their registry figures (requests queued beyond this batch's own, KV use,
sequences running that are not this batch's).

The engines already schedule `batch`-class sequences behind interactive ones; the pacer keeps the batch from
occupying KV and step time that arriving interactive requests would need, so they see the fleet as if the
batch were not there, and hands the capacity back as the interactive load falls.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.common.engine_registry import EngineSnapshot


@dataclass(frozen=True, slots=True)
class PacingConfig:
    max_in_flight_per_engine: int = 8
    yield_kv_usage: float = 0.8  # an engine's KV use above this: yield
    yield_interactive_running: int = 4  # interactive sequences running across the fleet above this: yield

    def __post_init__(self) -> None:
        assert self.max_in_flight_per_engine >= 1 and 0 < self.yield_kv_usage <= 1 and self.yield_interactive_running >= 0

    @classmethod
    def from_settings(cls, settings) -> PacingConfig:
        return cls(settings.batch_max_in_flight_per_engine, settings.batch_yield_kv_usage,
                   settings.batch_yield_interactive_running)


@dataclass(frozen=True, slots=True)
class PaceDecision:
    limit: int  # batch lines that may be in flight
    yielding: bool  # interactive load is up: the batch is backing off
    reason: str


class Pacer:
    """AIMD on the batch's in-flight lines, judged from the engines' heartbeats."""

    def __init__(self, config: PacingConfig):
        self.config = config
        self.limit = 1
        self._seen: tuple | None = None  # the heartbeats the last decision was made on
        self._last = PaceDecision(1, False, "idle capacity")

    def decide(self, engines: list[EngineSnapshot], in_flight: int) -> PaceDecision:
        """`engines`: the live engines of the batch's base model; `in_flight`: this batch's lines running.
        One step of the AIMD per new heartbeat: the runner asks several times a second, the engines report
        once a second, and halving again on the same figures (or growing on them) would act on nothing new."""
        if not engines:
            self.limit, self._seen = 0, None
            return PaceDecision(0, True, "no engine serves the model")
        seen = tuple(sorted((e.id, e.ts) for e in engines))
        if seen == self._seen and all(e.ts is not None for e in engines):
            return self._last
        self._seen = seen
        self._last = self._step(engines, in_flight)
        return self._last

    def _step(self, engines: list[EngineSnapshot], in_flight: int) -> PaceDecision:
        cap = self.config.max_in_flight_per_engine * len(engines)
        running, waiting = sum(e.running for e in engines), sum(e.waiting for e in engines)
        # The engines count this batch's lines too, queued ones included (a step takes only so much batch
        # prompt work, so a few of ours often wait a step): what is beyond them is someone else's load.
        others = max(0, running + waiting - in_flight)
        reason = ""
        if waiting > in_flight:
            reason = "requests other than this batch's are queued on an engine"
        elif any(e.kv_usage > self.config.yield_kv_usage for e in engines):
            reason = "an engine's KV cache is nearly full"
        elif others > self.config.yield_interactive_running:
            reason = f"{others} other sequences in the engines"
        if reason:
            self.limit = self.limit // 2
        else:
            self.limit = min(cap, max(1, self.limit + 1))
        return PaceDecision(self.limit, bool(reason), reason or "idle capacity")
