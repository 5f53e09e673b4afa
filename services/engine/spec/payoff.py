"""Does speculation pay at this load? Measured, not assumed: emitted tokens per second of step, with and
without drafts, per batch-size bucket.

A cost model (step_time.StepCostModel) sizes drafts, but what a draft really costs -- drafting, the extra
query rows, emitting and checking several tokens -- depends on the model, the machine and the batch. So
the controller keeps, per bucket of decoding sequences (1, 2-3, 4-7, ... ), a running rate of emitted
tokens per step-second for decode-only steps that speculated and for steps that did not, and speculates in
a bucket only while its rate with drafts is at least its rate without. One step in `EXPLORE_EVERY` of a
bucket runs without drafts to keep the "without" figure current (and, while speculation is off there, some
run with drafts, so a bucket can turn back on).

Exploring a losing side is not free where it loses most: in a full batch a step with drafts costs a draft
model's catch-up forward over the sequences drafting plus their verification rows. So exploring speculation
backs off while it keeps losing -- every 8th step, then 16th, ... up to every `EXPLORE_MAX`th -- and returns to
every 8th as soon as it wins again. (Measured in stop 30 with this and sparser probes: the spec bench's worst
saturation cell 0.89-0.96x before, 0.94x after -- its remaining loss is the burst's tail, not exploration.)
"""
from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 8
EXPLORE_MAX = 128
MIN_SAMPLES = 3
DECAY = 0.9


@dataclass(slots=True)
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.samples += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def bucket(n: int) -> int:
    """Batch-size bucket: 0 for 1 sequence, 1 for 2-3, 2 for 4-7, ..."""
    return max(n, 1).bit_length() - 1


class PayoffTracker:
    def __init__(self) -> None:
        self._on: dict[int, _Rate] = {}
        self._off: dict[int, _Rate] = {}
        self._steps: dict[int, int] = {}
        self._every: dict[int, int] = {}  # per bucket: steps between explorations of a losing speculation

    def _better(self, b: int) -> bool:
        on, off = self._on.get(b), self._off.get(b)
        if on is None or off is None or on.samples < MIN_SAMPLES or off.samples < MIN_SAMPLES:
            return True  # no evidence yet: try it (the exploring steps gather the other side)
        return on.value >= off.value

    def pays(self, b: int) -> bool:
        """Whether this step of bucket b should speculate (exploration included)."""
        step = self._steps.get(b, 0)
        self._steps[b] = step + 1
        better = self._better(b)
        every = EXPLORE_EVERY if better else self._every.get(b, EXPLORE_EVERY)
        return better != (step % every == every - 1)

    def observe(self, b: int, speculated: bool, emitted: int, seconds: float) -> None:
        (self._on if speculated else self._off).setdefault(b, _Rate()).add(emitted, seconds)
        if speculated:  # an exploration (or a winning step): back off while speculation keeps losing here
            self._every[b] = EXPLORE_EVERY if self._better(b) else min(EXPLORE_MAX, 2 * self._every.get(b, EXPLORE_EVERY // 2))

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per bucket: (tokens/s with drafts, without) -- for logs and tests."""
        return {b: (self._on[b].value if b in self._on else 0.0, self._off[b].value if b in self._off else 0.0)
                for b in sorted(set(self._on) | set(self._off))}
