"""Iteration-level continuous batching: which sequences run this step and how many tokens each.

Every step spends a token budget: running decodes first (so a long prompt never stalls them), then
partially prefilled prompts and new admissions, class by class, interleaved in tenant-fair order
(fair_queue.py: weighted fair queuing on tokens). Admission needs a seat and free KV blocks; a request may
take them from a running sequence of a lower class, or -- when its tenant is under its fair share of the
batch -- of the tenant furthest over its share; when a running sequence cannot grow, the victim is chosen
the same way. A preempted sequence is swapped out to the host tier or freed and later recomputed,
whichever the cost model (preemption.py) says is cheaper; a swapped-out sequence is copied back when
re-admitted and goes on where it was. A request whose prompt equals a running one's forks it (forks.py)
instead of computing the prompt again. The scheduler never touches tensors: its output is a `StepPlan`,
whose block copies the model runner executes before the forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.engine.class_yield import class_budget_cap, computes_interactive_prompt, lower_class_rows
from services.engine.config import SchedulerConfig
from services.engine.fair_queue import Admission, Tenants, WaitQueue
from services.engine.forks import WAIT, PromptGroups
from services.engine.kv.copies import BlockCopy, CopyKind
from services.engine.kv.manager import KVCacheManager, PrefixHit
from services.engine.preemption import PreemptKind
from services.engine.sequence import Priority, Sequence, Status
from services.engine.step_time import StepCostModel, StepTimeBound


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache when the step starts
    num_new_tokens: int
    block_table: tuple[int, ...]
    lora_slot: int  # -1 = base model
    # Speculative tokens computed after the sequence's last token (counted in num_new_tokens), verified by
    # sampling each of their positions (spec/verify.py).
    draft: tuple[int, ...] = ()
    # True when this step computes the sequence's last known token, so a new one is sampled. Fixed when the
    # step is planned: with async scheduling (overlap.py) the sequence grows before this step is post-processed.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", self.start + self.num_new_tokens - len(self.draft) == self.seq.num_tokens)


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    fair_preempted: int = 0  # of `preempted`: seats or blocks taken for a tenant under its fair share
    swapped_out: list[Sequence] = field(default_factory=list)  # those of `preempted` swapped, not freed
    # Run by the model runner before the forward, in this order (kv/copies.py says why one list).
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Tokens of `scheduled`, kept as rows are added and dropped (add / drop): the scheduler asks for it several
    # times per sequence it plans, and summing the list each time made planning quadratic in the batch (8,600
    # generator steps a step at 64 rows, ~14% of the step; 16x that at 256).
    _tokens: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._tokens = sum(s.num_new_tokens for s in self.scheduled)

    def copies_of(self, kind: CopyKind) -> list[tuple[int, int]]:
        """(src, dst) of one kind: vLLM's blocks_to_swap_out / blocks_to_swap_in / blocks_to_copy."""
        return [(c.src, c.dst) for c in self.block_copies if c.kind is kind]

    def add(self, s: ScheduledSeq) -> None:
        self.scheduled.append(s)
        self._tokens += s.num_new_tokens

    def drop(self, seq: Sequence) -> None:
        """Remove `seq`'s rows (it was preempted after being scheduled)."""
        self.drop_rows([s for s in self.scheduled if s.seq is seq])

    def drop_rows(self, rows: list[ScheduledSeq]) -> None:
        """Remove these rows, in one pass over the plan."""
        gone = {id(s) for s in rows}
        self.scheduled[:] = [s for s in self.scheduled if id(s) not in gone]
        self._tokens -= sum(s.num_new_tokens for s in rows)

    @property
    def num_batched_tokens(self) -> int:
        return self._tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdapterSlots(Protocol):
    """What the scheduler needs from the adapter manager (device slots for LoRA weights)."""

    def is_host_resident(self, content_id: str) -> bool:
        """The adapter is loaded in host memory (so only a free slot is missing)."""

    def slot_of(self, content_id: str) -> int | None:
        """The device slot holding the adapter now (pinned or idle), or None."""

    def acquire(self, seq: Sequence) -> int | None:
        """Pin the sequence's adapter into a device slot and return it, or None if it cannot be now."""

    def release(self, seq: Sequence) -> None:
        """Unpin the sequence's adapter (the sequence left the running set)."""


class PreemptionPolicy(Protocol):
    """Chooses how to preempt (preemption.PreemptionCostModel)."""

    def choose(self, est) -> PreemptKind: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, adapters: AdapterSlots | None = None,
                 *, preemption: PreemptionPolicy | None = None, share_prompts: bool = False):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.adapters = adapters
        self.preemption = preemption  # None: always recompute
        self.prompts = PromptGroups() if share_prompts else None
        self.num_forks = 0
        self.fork_tokens = 0  # prompt tokens forks shared instead of computing
        self.preemptions_by_kind = {k: 0 for k in PreemptKind}
        self.tenants = Tenants(fair=config.policy == "fair")
        self.waiting: dict[Priority, WaitQueue] = {p: WaitQueue(self.tenants) for p in Priority}
        self.running: list[Sequence] = []
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_finished = 0  # sequences that left the running batch (finished or aborted)
        self.blocked = False
        self.prefix_hit_tokens = 0  # every admission's hit, re-admissions after preemption included
        # The device slot being drained for a request that has waited too long for one (see _admit).
        self.draining_slot: int | None = None
        self.budget_cap: int | None = None  # the plan's token count the current class may fill to (class_yield.py)
        # The fitted step cost (step_time.py) both time caps read; None when neither is asked for.
        timed = config.max_step_s is not None or config.lower_class_prompt_s is not None
        self.step_cost: StepCostModel | None = StepCostModel() if timed else None
        # The plan's token count prompt work may fill to this step (step_time.py); None: the token budget.
        self.step_bound = StepTimeBound(config.max_step_s, self.step_cost) if config.max_step_s is not None else None
        self.time_cap: int | None = None

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step's computed tokens and wall time teach the fitted step cost both time caps read (an idle or
        failed step teaches nothing)."""
        if self.step_cost is not None and tokens > 0 and seconds > 0:
            self.step_cost.observe(tokens, seconds)

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.num_tokens + seq.params.max_tokens - seq.num_output_tokens <= self.max_model_len
        self._arrivals += 1
        seq.arrival_order = self._arrivals
        seq.status = Status.WAITING
        self.tenants.arrived(seq)
        self.waiting[seq.priority].append(seq)
        if self.prompts is not None:
            self.prompts.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (completed or aborted) and free its KV blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release_adapter(seq)
            self.tenants.left(seq, was_running=True)
            self.num_finished += 1  # a seat freed: SLO admission's estimate of how fast seats free up
        elif seq.status is Status.WAITING:
            self.waiting[seq.priority].remove(seq)
            self.tenants.left(seq, was_running=False)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.request_id)
        if self.prompts is not None:
            self.prompts.remove(seq)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # Decodes first: a long prompt must never stall the sequences already streaming.
        decodes = sorted((s for s in self.running if s.num_tokens - s.num_computed_tokens == 1), key=lambda s: s.sort_key)
        for seq in decodes:
            if self._budget(plan) == 0:
                break
            if seq.status is Status.RUNNING:  # not preempted earlier in this loop
                self._run(seq, plan)
        prefills = sorted((s for s in self.running if s.num_tokens - s.num_computed_tokens > 1), key=lambda s: s.sort_key)
        if self.step_bound is not None:
            self.time_cap = plan.num_batched_tokens + self.step_bound.prompt_tokens(plan.num_batched_tokens)
        self._fill(plan, prefills, admit=not plan.preempted)
        self.time_cap = None
        lean = lower_class_rows(plan)  # a lean step for an interactive first token (class_yield.py)
        plan.drop_rows(lean)
        for s in lean:
            self.tenants.charge(s.seq, -s.num_new_tokens)  # not computed: its tenant's clock goes back
        # Rows of one adapter side by side: LoRA segments become contiguous ranges (no gather/scatter).
        plan.scheduled.sort(key=lambda s: s.lora_slot)
        assert plan.num_batched_tokens == sum(s.num_new_tokens for s in plan.scheduled), "plan rows changed behind add/drop"
        plan.block_copies = self.kv.take_copies()
        return plan

    def _budget(self, plan: StepPlan) -> int:
        cap = self.config.max_num_batched_tokens
        for c in (self.budget_cap, self.time_cap):
            if c is not None:
                cap = min(cap, c)
        return cap - plan.num_batched_tokens

    def _run(self, seq: Sequence, plan: StepPlan) -> None:
        """Schedule a running sequence's next tokens (a decode or a prefill chunk), preempting to make room."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, self._budget(plan))
        if not self.config.chunked_prefill and num_new < seq.num_tokens - seq.num_computed_tokens:
            return
        if draft := self._fit_draft(seq, num_new, plan):
            plan.add(self._scheduled(seq, 1 + len(draft), draft))
            return
        while seq.status is Status.RUNNING and not self.kv.allocate(seq, num_new):
            self._preempt(self._pick_victim(), plan)
        if seq.status is Status.RUNNING:
            plan.add(self._scheduled(seq, min(num_new, self._budget(plan))))

    def _fit_draft(self, seq: Sequence, num_new: int, plan: StepPlan) -> tuple[int, ...]:
        """The part of a decode's speculative draft (seq.spec_draft) that costs no one anything: budget this
        step has left, and KV blocks that still leave one free per running sequence -- a draft never
        preempts. Allocates its blocks; () when none of it fits."""
        draft = seq.spec_draft[: self._budget(plan) - 1]
        if not draft or num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            return ()
        if self.kv.blocks_needed(seq, 1 + len(draft)) + len(self.running) > self.kv.num_free_blocks:
            return ()
        return draft if self.kv.allocate(seq, 1 + len(draft)) else ()

    def _fill(self, plan: StepPlan, prefills: list[Sequence], admit: bool) -> None:
        """The budget left after decodes, class by class: the running sequences' prefill chunks and new
        admissions, interleaved in tenant-fair order (the tenant whose clock is furthest behind goes next),
        so that one tenant's hundred long prompts do not hold another tenant's first token for many steps."""
        self.blocked = False  # set when a request that could run waits for seats or KV blocks
        if self.draining_slot is not None and not any(s.lora_slot == self.draining_slot for s in self.running):
            self.draining_slot = None  # drained: it is idle now, and the oldest waiting requests get it first
        for priority in Priority:
            if priority is not Priority.INTERACTIVE and computes_interactive_prompt(plan):
                break  # a lean step for an interactive first token; lower classes go next step (class_yield.py)
            self.budget_cap = class_budget_cap(plan, priority, self.config, self.step_cost)
            pending: dict[str, list[Sequence]] = {}
            for seq in prefills:
                if seq.priority == priority:
                    pending.setdefault(self.tenants.key(seq), []).append(seq)
            for q in pending.values():
                q.reverse()  # pop() from the end = oldest first
            walk = self.waiting[priority].admission() if admit and not self.blocked else None
            while self._budget(plan) > 0:
                candidate = walk.peek() if walk is not None else None
                states = self.tenants.states
                tenant = min((k for k, q in pending.items() if q), key=lambda k: states[k].vtime, default=None)
                if tenant is not None and (candidate is None or
                                           states[tenant].vtime <= states[self.tenants.key(candidate)].vtime):
                    seq = pending[tenant].pop()
                    if seq.status is Status.RUNNING:
                        self._run(seq, plan)
                    continue
                if candidate is None:
                    break
                if not self._try_admit(candidate, walk, plan):
                    self.blocked = True  # lower classes admit nothing while a higher class waits on seats or KV
                    walk = None
            if walk is not None and len(self.running) >= self.config.max_num_seqs and walk.peek() is not None:
                self.blocked = True
        self.budget_cap = None

    def _try_admit(self, seq: Sequence, walk: Admission, plan: StepPlan) -> bool:
        """Admit `seq` (the walk's candidate) with its first prefill chunk, or skip it for this pass (its
        adapter cannot be resident now). False: it waits for seats or KV blocks nobody may give up for it."""
        # Anti-starvation without stalling the batch: once a request has waited lora_starvation_steps for a
        # slot (its adapter loaded), one pinned slot -- the one whose sequences should finish first -- takes
        # no new sequences until it is idle; everyone else keeps batching. The drained slot frees in at most
        # its sequences' remaining max_tokens, and the queue is scanned oldest first, so the older waiting
        # requests get it before any newer one.
        source = self._fork_source(seq)
        if source is WAIT:  # an identical prompt is being computed: fork it once it is, not now
            walk.skip(seq)
            return True
        if len(self.running) >= self.config.max_num_seqs:
            victim = self._victim_for(seq)
            if victim is None:
                return False
            self._preempt(victim, plan, walk, fair=victim.priority == seq.priority)
            return True
        slot = -1
        # The slot first: with more distinct adapters queued than slots, most of the queue is skipped here
        # every step, and that must stay cheap (no prefix lookup).
        if seq.adapter is not None and self.adapters is not None:
            resident = self.adapters.slot_of(seq.adapter.content_id)
            draining = resident is not None and resident == self.draining_slot
            acquired = None if draining else self.adapters.acquire(seq)
            if acquired is None:  # its adapter cannot be resident now: let others through
                if resident is None and self.adapters.is_host_resident(seq.adapter.content_id):
                    seq.slot_wait_steps += 1
                    if seq.slot_wait_steps >= self.config.lora_starvation_steps and self.draining_slot is None:
                        self.draining_slot = self._slot_to_drain()
                walk.skip(seq)
                return True
            slot = acquired
        hit = self._kv_start(seq, source)
        remaining = seq.num_tokens - hit.num_tokens
        num_new = min(remaining, self._budget(plan))
        if not self.config.chunked_prefill and num_new < remaining:
            if slot >= 0:
                self.adapters.release(seq)
            return False
        if not self.kv.allocate(seq, num_new, hit):
            if slot >= 0:
                self.adapters.release(seq)
            victim = self._victim_for(seq) if self.running else None
            if victim is None:
                return False
            # Blocks for a higher class, or for a tenant under its share: recompute the victim later.
            self._preempt(victim, plan, walk, fair=victim.priority == seq.priority)
            return True
        walk.take(seq)
        seq.lora_slot = slot
        seq.slot_wait_steps = 0
        seq.num_computed_tokens = hit.num_tokens
        self._count_start(seq, hit, source)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.tenants.admitted(seq)
        plan.add(self._scheduled(seq, num_new))
        return True

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """A running sequence whose seat and blocks `seq` may take: the latest arrival of a lower class; else,
        when `seq`'s tenant is under its fair share of the batch, the latest arrival (same class) of the
        tenant furthest over its share -- one that keeps at least its share after losing it, so two
        tenants never take seats back and forth."""
        lower = [s for s in self.running if s.priority > seq.priority]
        if lower:
            return max(lower, key=lambda s: s.sort_key)
        if not self.tenants.fair:
            return None
        cap = self.config.max_num_seqs
        mine = self.tenants.state(seq)
        if mine.running + 1 > self.tenants.share(seq, cap):
            return None
        ratios = self.tenants.over_share(cap)
        key = self.tenants.key(seq)
        candidates = [s for s in self.running if s.priority == seq.priority and self.tenants.key(s) != key]
        best = None
        for s in candidates:
            st = self.tenants.state(s)
            if st.running < self.tenants.share(s, cap) + 1:
                continue  # it would fall under its own share
            rank = (ratios.get(self.tenants.key(s), 0.0), s.sort_key)
            if best is None or rank > best[0]:
                best = (rank, s)
        return best[1] if best else None

    def _slot_to_drain(self) -> int | None:
        """The pinned slot expected to free first: the least, over slots, of the most tokens any of its
        running sequences may still generate."""
        longest: dict[int, int] = {}
        for s in self.running:
            if s.lora_slot >= 0:
                left = s.params.max_tokens - s.num_output_tokens
                longest[s.lora_slot] = max(longest.get(s.lora_slot, 0), left)
        return min(longest, key=longest.__getitem__) if longest else None

    def _scheduled(self, seq: Sequence, num_new: int, draft: tuple[int, ...] = ()) -> ScheduledSeq:
        self.tenants.charge(seq, num_new)  # the tenant's virtual clock: tokens computed for it / weight
        return ScheduledSeq(
            seq=seq,
            start=seq.num_computed_tokens,
            num_new_tokens=num_new,
            block_table=tuple(self.kv.block_table(seq.request_id)),
            lora_slot=seq.lora_slot,
            draft=draft,
        )

    def _pick_victim(self) -> Sequence:
        """The running sequence to preempt when one cannot grow: the lowest class; inside it, the tenant
        furthest over its fair share (all alike under FCFS); its latest arrival."""
        worst = max(s.priority for s in self.running)
        ratios = self.tenants.over_share(self.config.max_num_seqs) if self.tenants.fair else {}
        return max((s for s in self.running if s.priority == worst),
                   key=lambda s: (ratios.get(self.tenants.key(s), 0.0), s.arrival_order))

    def _preempt(self, seq: Sequence, plan: StepPlan, walk: Admission | None = None, fair: bool = False) -> None:
        """Take a running sequence off the device: its KV is swapped out to the host tier or freed for
        recompute (`_preemption_kind`); it goes back to the front of its tenant's queue in its class.
        `walk`: the admission pass in progress, which must not take it back at once."""
        self.running.remove(seq)
        self.tenants.preempted(seq)
        self._release_adapter(seq)
        kind = self._preemption_kind(seq)
        if kind is PreemptKind.SWAP:
            self.kv.swap_out(seq)  # reads num_computed_tokens: before it is reset
            plan.swapped_out.append(seq)
        else:
            self.kv.free(seq.request_id)
        self.preemptions_by_kind[kind] += 1
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0  # a swapped-out sequence's tokens are the KV manager's (kv.restore)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[seq.priority].appendleft(seq)
        if walk is not None and walk.queue is self.waiting[seq.priority]:
            walk.skip(seq)
        plan.preempted.append(seq)
        plan.fair_preempted += fair
        plan.drop(seq)

    def _preemption_kind(self, seq: Sequence) -> PreemptKind:
        if self.preemption is None or self.kv.host is None or seq.num_computed_tokens == 0:
            return PreemptKind.RECOMPUTE
        return self.preemption.choose(self.kv.swap_estimate(seq))

    # -- where an admitted sequence's KV comes from ----------------------------------------------
    def _fork_source(self, seq: Sequence) -> Sequence | object | None:
        """A running sequence with the same prompt to fork, WAIT while one is computing it, or None."""
        if self.prompts is None or self.kv.is_swapped(seq.request_id):
            return None
        return self.prompts.source(seq)

    def _kv_start(self, seq: Sequence, source: Sequence | None) -> PrefixHit:
        """A fork of `source`'s prompt, a swapped-out sequence's blocks back from the host tier, or the
        prefix cache's longest hit."""
        if source is not None:
            return self.kv.fork(source, seq.num_prompt_tokens - 1)
        if self.kv.is_swapped(seq.request_id):
            return self.kv.restore(seq)
        return self.kv.match_prefix(seq)

    def _count_start(self, seq: Sequence, hit: PrefixHit, source: Sequence | None) -> None:
        if hit.kind == "swap":
            return  # its own KV coming back: neither a prefix hit nor cached tokens
        if hit.kind == "fork":
            self.num_forks += 1
            self.fork_tokens += hit.num_tokens
            # cached_tokens is billed at the cached price, and the gateway bills an n > 1 request's prompt
            # once, from whichever choice it sees first: a fork reports what its source got from the prefix
            # cache, so the bill does not depend on which choice computed the prompt.
            cached = source.num_cached_tokens or 0
        else:
            self.prefix_hit_tokens += hit.num_tokens
            cached = hit.num_tokens
        if seq.num_cached_tokens is None:  # at its first admission
            seq.num_cached_tokens = cached

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.release(seq)
        seq.lora_slot = -1
