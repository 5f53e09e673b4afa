"""A request inside the engine: its sampling parameters, tokens, progress and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.common.wire import AdapterRef, InvalidRequest, Priority, SamplingParams
from services.engine.grammar import Matcher

__all__ = ["AdapterRef", "InvalidRequest", "Priority", "SamplingParams", "Sequence", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    priority: Priority = Priority.INTERACTIVE
    cache_salt: str = ""
    adapter: AdapterRef | None = None
    tenant: str = ""  # set by the gateway (never by a client): fair sharing and per-tenant metrics
    weight: float = 1.0  # the tenant's share weight, from its plan
    clamped_from: int | None = None  # max_tokens asked for, when overload clamped it (batch class)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = 0

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit tokens at first admission (reported as cached_tokens)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    compute_seconds: float = 0.0  # this request's share of the forward steps it took part in
    first_token_time: float | None = None
    last_token_time: float | None = None
    lora_slot: int = -1  # device slot of its adapter while running; -1 = base model
    slot_wait_steps: int = 0  # steps spent waiting for a device slot while its adapter was host-resident
    matcher: Matcher | None = None  # its grammar state when the output is constrained (params.guide)
    # Speculative decoding (spec/): this step's draft (set by the controller before scheduling), the
    # request's totals, and its per-token acceptance estimate as decayed (accepted, trials) sums.
    spec_draft: tuple[int, ...] = ()
    spec_drafter: str | None = None  # the drafter it uses (SpeculativeConfig.drafter_for; "" = none), once known
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_hits: float = 0.0
    spec_trials: float = 0.0
    spec_idle_steps: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def cache_extra(self) -> tuple:
        return (self.cache_salt, self.adapter.content_id if self.adapter else None)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (int(self.priority), self.arrival_order)
