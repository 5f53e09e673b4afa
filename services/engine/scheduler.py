"""Iteration-level continuous batching: which sequences run this step and how many tokens each.

Every step spends a token budget: running decodes first (so a long prompt never stalls them), then
partially prefilled prompts, then new admissions by priority class and arrival. Admission needs free
KV blocks; when a running sequence cannot grow, the lowest-priority, latest-arrived sequence is
preempted: swapped out to the host tier or freed and later recomputed, whichever the cost model
(preemption.py) says is cheaper. A swapped-out sequence is copied back when re-admitted and goes on
where it was. A request whose prompt equals a running one's forks it (forks.py) instead of computing
the prompt again. The scheduler never touches tensors: its output is a `StepPlan`, whose block copies
the model runner executes before the forward.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.config import SchedulerConfig
from services.engine.forks import WAIT, PromptGroups
from services.engine.kv.copies import BlockCopy, CopyKind
from services.engine.kv.manager import KVCacheManager, PrefixHit
from services.engine.preemption import PreemptKind
from services.engine.sequence import Priority, Sequence, Status


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache when the step starts
    num_new_tokens: int
    block_table: tuple[int, ...]
    lora_slot: int  # -1 = base model

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so a new one is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)  # those of `preempted` swapped, not freed
    # Run by the model runner before the forward, in this order (kv/copies.py says why one list).
    block_copies: list[BlockCopy] = field(default_factory=list)

    def copies_of(self, kind: CopyKind) -> list[tuple[int, int]]:
        """(src, dst) of one kind: vLLM's blocks_to_swap_out / blocks_to_swap_in / blocks_to_copy."""
        return [(c.src, c.dst) for c in self.block_copies if c.kind is kind]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

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
        self.waiting: dict[Priority, deque[Sequence]] = {p: deque() for p in Priority}
        self.running: list[Sequence] = []
        self._arrivals = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # every admission's hit, re-admissions after preemption included
        # The device slot being drained for a request that has waited too long for one (see _admit).
        self.draining_slot: int | None = None

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.num_tokens + seq.params.max_tokens - seq.num_output_tokens <= self.max_model_len
        self._arrivals += 1
        seq.arrival_order = self._arrivals
        seq.status = Status.WAITING
        self.waiting[seq.priority].append(seq)
        if self.prompts is not None:
            self.prompts.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (completed or aborted) and free its KV blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release_adapter(seq)
        elif seq.status is Status.WAITING:
            self.waiting[seq.priority].remove(seq)
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
        budget = self.config.max_num_batched_tokens

        # Decodes before partial prefills: a long prompt must never stall the sequences already streaming.
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.sort_key))
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.config.chunked_prefill and num_new < seq.num_tokens - seq.num_computed_tokens:
                continue
            while seq.status is Status.RUNNING and not self.kv.allocate(seq, num_new):
                self._preempt(self._pick_victim(), plan)
                budget = self.config.max_num_batched_tokens - plan.num_batched_tokens
            if seq.status is not Status.RUNNING:
                continue
            plan.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

        if not plan.preempted:
            self._admit(plan)
        # Rows of one adapter side by side: LoRA segments become contiguous ranges (no gather/scatter).
        plan.scheduled.sort(key=lambda s: s.lora_slot)
        plan.block_copies = self.kv.take_copies()
        return plan

    def _admit(self, plan: StepPlan) -> None:
        budget = self.config.max_num_batched_tokens - plan.num_batched_tokens
        if self.draining_slot is not None and not any(s.lora_slot == self.draining_slot for s in self.running):
            self.draining_slot = None  # drained: it is idle now, and the oldest waiting requests get it first
        # Anti-starvation without stalling the batch: once a request has waited lora_starvation_steps for a
        # slot (its adapter loaded), one pinned slot -- the one whose sequences should finish first -- takes
        # no new sequences until it is idle; everyone else keeps batching. The drained slot frees in at most
        # its sequences' remaining max_tokens, and the queue is scanned oldest first, so the older waiting
        # requests get it before any newer one.
        for priority in Priority:
            queue = self.waiting[priority]
            skipped: list[Sequence] = []
            blocked = False
            while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = queue[0]
                source = self._fork_source(seq)
                if source is WAIT:  # an identical prompt is being computed: fork it once it is, not now
                    skipped.append(queue.popleft())
                    continue
                slot = -1
                # The slot first: with more distinct adapters queued than slots, most of the queue is
                # skipped here every step, and that must stay cheap (no prefix lookup).
                if seq.adapter is not None and self.adapters is not None:
                    resident = self.adapters.slot_of(seq.adapter.content_id)
                    draining = resident is not None and resident == self.draining_slot
                    acquired = None if draining else self.adapters.acquire(seq)
                    if acquired is None:  # its adapter cannot be resident now: let others through
                        if resident is None and self.adapters.is_host_resident(seq.adapter.content_id):
                            seq.slot_wait_steps += 1
                            if seq.slot_wait_steps >= self.config.lora_starvation_steps and self.draining_slot is None:
                                self.draining_slot = self._slot_to_drain()
                        skipped.append(queue.popleft())
                        continue
                    slot = acquired
                hit = self._kv_start(seq, source)
                remaining = seq.num_tokens - hit.num_tokens
                num_new = min(remaining, budget)
                if not self.config.chunked_prefill and num_new < remaining:
                    if slot >= 0:
                        self.adapters.release(seq)
                    blocked = True
                    break
                if not self.kv.allocate(seq, num_new, hit):
                    victim = self._pick_victim() if self.running else None
                    if victim is not None and victim.priority > seq.priority:
                        # A higher class waits on KV: recompute a lower-class sequence later instead.
                        if slot >= 0:
                            self.adapters.release(seq)
                        self._preempt(victim, plan)
                        budget = self.config.max_num_batched_tokens - plan.num_batched_tokens
                        continue
                    if slot >= 0:
                        self.adapters.release(seq)
                    blocked = True
                    break
                queue.popleft()
                seq.lora_slot = slot
                seq.slot_wait_steps = 0
                seq.num_computed_tokens = hit.num_tokens
                self._count_start(seq, hit, source)
                seq.status = Status.RUNNING
                self.running.append(seq)
                plan.scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
            queue.extendleft(reversed(skipped))
            if blocked or len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break  # lower classes wait while a higher class is blocked on KV or seats

    def _slot_to_drain(self) -> int | None:
        """The pinned slot expected to free first: the least, over slots, of the most tokens any of its
        running sequences may still generate."""
        longest: dict[int, int] = {}
        for s in self.running:
            if s.lora_slot >= 0:
                left = s.params.max_tokens - s.num_output_tokens
                longest[s.lora_slot] = max(longest.get(s.lora_slot, 0), left)
        return min(longest, key=longest.__getitem__) if longest else None

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(
            seq=seq,
            start=seq.num_computed_tokens,
            num_new_tokens=num_new,
            block_table=tuple(self.kv.block_table(seq.request_id)),
            lora_slot=seq.lora_slot,
        )

    def _pick_victim(self) -> Sequence:
        return max(self.running, key=lambda s: s.sort_key)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take a running sequence off the device: its KV is swapped out to the host tier or freed for
        recompute (`_preemption_kind`); it goes back to the front of its class."""
        self.running.remove(seq)
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
        plan.preempted.append(seq)
        plan.scheduled[:] = [s for s in plan.scheduled if s.seq is not seq]

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
