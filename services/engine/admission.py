"""SLO-aware admission: refuse at arrival the work that cannot get its first token within its class's
budget, instead of letting it wait out its timeout in the queue.

The step loop publishes a `LoadSnapshot` after every step (one attribute store: the event loop reads it
without a lock, and a slightly stale view is fine for an estimate). A new request's time to first token is
estimated from it: no wait when a seat is free for it (or its tenant is under its fair share, so the
scheduler will make room by preemption); else the seats that must free up first -- the requests ahead of
it in fair order, and itself -- divided by the rate at which sequences have been leaving a saturated
batch (full, or with work waiting; trusted after RATE_TAU_S of such steps), plus its prefill steps. Over budget ->
`EngineUnavailable("engine_overloaded")` with a Retry-After of the excess: the gateway tries another
engine first, then tells the client.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from services.common.wire import EngineUnavailable, Priority
from services.engine.config import SchedulerConfig
from services.engine.fair_queue import FCFS_TENANT

# What a front-end needs of SchedulerConfig to run `check` as the core would (sent in EngineInfo.admission).
ADMISSION_FIELDS = ("policy", "max_num_seqs", "max_num_batched_tokens", "interactive_ttft_slo_s", "batch_ttft_slo_s",
                    "admission_headroom", "overload_window_s")
EWMA = 0.2  # weight of the newest step in the step-time estimate
RATE_TAU_S = 2.0  # time constant of the finish-rate estimate (and how long it is observed before it is trusted)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    at: float = 0.0
    step_s: float = 0.0  # running estimate of a step's wall time
    finish_rate: float | None = None  # sequences leaving the batch per second (None: not observed long enough)
    free_seats: int = 0
    running: dict[str, int] = field(default_factory=dict)  # tenant key -> running sequences
    weights: dict[str, float] = field(default_factory=dict)  # tenant key -> weight (tenants with work)
    waiting: dict[tuple[int, str], int] = field(default_factory=dict)  # (class, tenant key) -> waiting
    oldest: dict[tuple[int, str], float] = field(default_factory=dict)  # (class, tenant key) -> oldest arrival
    overloaded_until: float = 0.0


class LoadTracker:
    """Keeps the running estimates on the step-loop thread and publishes a snapshot after each step."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.snapshot = LoadSnapshot(free_seats=config.max_num_seqs)
        self._step_s = 0.0
        self._finish_rate = 0.0
        self._observed_s = 0.0  # wall time of the saturated steps folded into the finish rate
        self._overloaded_until = 0.0

    @classmethod
    def for_frontend(cls, fields: dict) -> "LoadTracker":
        """A tracker on a front-end: no steps of its own, its snapshot replaced by each `Load` from the core."""
        return cls(SchedulerConfig(**{k: fields[k] for k in ADMISSION_FIELDS}))

    def admission_fields(self) -> dict:
        return {k: getattr(self.config, k) for k in ADMISSION_FIELDS}

    def overloaded(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self._overloaded_until

    def mark_overloaded(self, now: float) -> None:
        self._overloaded_until = max(self._overloaded_until, now + self.config.overload_window_s)

    def observe(self, scheduler, step_s: float, finished: int) -> None:
        """After a step: fold in its wall time and the sequences that left the batch, and publish what
        admission needs. The finish rate is how fast seats free up when the batch is full."""
        now = time.monotonic()
        self._step_s = step_s if not self._step_s else (1 - EWMA) * self._step_s + EWMA * step_s
        tenants = scheduler.tenants
        waiting: dict[tuple[int, str], int] = {}
        oldest: dict[tuple[int, str], float] = {}
        for prio, queue in scheduler.waiting.items():
            for key in queue.tenant_keys():
                waiting[(int(prio), key)] = queue.count(key)
                oldest[(int(prio), key)] = queue.oldest_arrival(key)
        # Only a saturated step (the batch was full, or work waited) says how fast seats free up: with seats
        # to spare, finishes follow the arrivals -- a quiet spell's trickle would price the next burst's queue
        # as if seats freed that slowly, and shed it.
        saturated = bool(waiting) or scheduler.num_running + finished >= self.config.max_num_seqs
        if step_s > 0 and saturated:
            alpha = 1 - math.exp(-step_s / RATE_TAU_S)  # a time-based average: steps may take 2 ms or 200 ms
            self._finish_rate += alpha * (finished / step_s - self._finish_rate)
            self._observed_s += step_s
        if scheduler.blocked and any(c == int(Priority.INTERACTIVE) for c, _ in waiting):
            self.mark_overloaded(now)  # interactive work is waiting for seats or blocks
        self.snapshot = LoadSnapshot(
            at=now, step_s=self._step_s,
            finish_rate=self._finish_rate if self._observed_s >= RATE_TAU_S else None,
            free_seats=self.config.max_num_seqs - scheduler.num_running,
            running={k: s.running for k, s in tenants.states.items()},
            weights={k: s.weight for k, s in tenants.states.items()},
            waiting=waiting, oldest=oldest, overloaded_until=self._overloaded_until,
        )

    # -- on the event loop -------------------------------------------------------------------------
    def estimate_ttft(self, tenant: str, weight: float, priority: Priority, prompt_len: int) -> float | None:
        """Seconds until a request arriving now would get its first token; None when it cannot be told yet."""
        return self._estimate(tenant, weight, priority, prompt_len)[0]

    def _estimate(self, tenant: str, weight: float, priority: Priority, prompt_len: int) -> tuple[float | None, bool]:
        """(estimate_ttft, whether the request must wait for seats to free up)."""
        snap = self.snapshot
        fair = self.config.policy == "fair"
        key = tenant if fair else FCFS_TENANT
        prio = int(priority)
        prefill = snap.step_s * (1 + math.ceil(prompt_len / self.config.max_num_batched_tokens))
        ahead_all = sum(n for (c, _), n in snap.waiting.items() if c <= prio)
        if snap.free_seats > ahead_all:
            return prefill, False  # a seat is free for it
        if fair:
            weights = dict(snap.weights)
            weights.setdefault(key, weight)
            share = self.config.max_num_seqs * weights[key] / sum(weights.values())
            own = sum(n for (c, k), n in snap.waiting.items() if k == key and c <= prio)
            if snap.running.get(key, 0) + own + 1 <= share:
                return prefill, False  # under its fair share: the scheduler preempts an over-share tenant for it
            # Weighted fair queuing: its own backlog goes first, and about as much of every other tenant's
            # (scaled by weight) is served in between.
            ahead = sum(min(n, (own + 1) * weights.get(k, 1.0) / weights[key])
                        for (c, k), n in snap.waiting.items() if c <= prio and k != key) + own
        else:
            ahead = ahead_all
        seats_needed = ahead + 1 - snap.free_seats  # seats that must free up before it is seated
        if seats_needed <= 0:
            return prefill, False
        # It will wait at least as long as the requests queued before it (its own tenant's, or everyone's
        # under FCFS) have waited already: an observed lower bound that does not depend on the rate estimate.
        now = time.monotonic()
        waited = max((now - t for (c, k), t in snap.oldest.items() if c <= prio and (k == key or not fair)), default=0.0)
        if snap.finish_rate is None:
            return (waited + prefill if waited else None), True  # the rate is not observed long enough to tell
        if snap.finish_rate <= 0:
            return math.inf, True
        return max(seats_needed / snap.finish_rate, waited) + prefill, True

    def check(self, tenant: str, weight: float, priority: Priority, prompt_len: int, *, early: bool = False) -> None:
        """Raise EngineUnavailable (engine_overloaded, with Retry-After) if the request cannot meet its budget.

        `early` (a front-end, on the core's last Load): refuse only work that must wait for seats -- the
        overload case, where refusals come in floods and each should cost nothing. Whether a request with a
        seat free gets its first token in time rests on step times that a Load one step old may overstate
        (the first steps' one-time costs): the core decides those on its newest state."""
        budget = (self.config.interactive_ttft_slo_s if priority == Priority.INTERACTIVE
                  else self.config.batch_ttft_slo_s)
        if budget is None:
            return
        estimate, waits_for_seats = self._estimate(tenant, weight, priority, prompt_len)
        # The headroom covers the seat-wait estimate (a finish rate, noisy); a request with a seat free is
        # refused only if its prefill steps alone exceed the budget -- no engine would serve it sooner.
        limit = budget * self.config.admission_headroom if waits_for_seats else budget
        if estimate is None or estimate <= limit or (early and not waits_for_seats):
            return
        self.mark_overloaded(time.monotonic())
        wait = "no seat has freed up lately" if math.isinf(estimate) else f"the estimated wait is {estimate:.1f}s"
        raise EngineUnavailable(
            f"this engine is overloaded: {wait} for a first token, over the {priority.name.lower()} budget of "
            f"{budget:g}s; retry shortly or on another engine",
            code="engine_overloaded",
            retry_after=60 if math.isinf(estimate) else max(1, min(60, math.ceil(estimate - budget))),
        )
