"""Async scheduling: step N+1's CPU work (scheduling, block tables, LoRA plan, input tensors, sampling batch) is
done while step N's forward runs on a worker thread, and step N's output processing runs while step N+1's does.

How (vLLM v1's async scheduling, SGLang's overlap scheduler, reshaped for this engine):

* When a step is launched, every sequence that samples in it gets a *placeholder* token appended and its
  computed-token count advanced, so the scheduler plans the next step as if the token were known: a decode of
  one token at the next position. The next step's input ids hold a hole at that row, filled from the sampled
  tokens the moment the forward ends (`_Flight.holes`), before the next forward is launched.
* Landing a step: its placeholders are removed and its tokens appended by the engine's own post-processing
  (`LLMEngine._postprocess`), so stop rules, accounting and outputs are the synchronous path's. A sequence
  that finished on that token (EOS, stop ids, an abort meanwhile) already has a row in the next step: the row
  is computed and its token discarded (it writes only KV the sequence no longer owns, before any later owner's
  forward). A sequence whose length ends it gets no placeholder, so no wasted row.
* A sequence preempted by the next step's scheduling while its step was in flight keeps what the scheduler
  gave it (recompute from zero, or the KV manager's swapped count -- whose blocks the step's forward had
  filled before the swap copy runs); it only gets its token.
* Steps with a grammar-constrained sequence are not overlapped (the next mask needs this step's token): the
  flight is landed first and the step runs synchronously.

Outputs are token-identical to the synchronous loop: the same plans in the same order, the same inputs; only
the moment the CPU work happens moves. KV ordering holds because forwards run one at a time on one thread, and
block copies (swaps, copy-on-write) run between two forwards, after the earlier one ended.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.engine.model_runner import PreparedStep
from services.engine.sampler import SamplerOutput
from services.engine.scheduler import StepPlan
from services.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from services.engine.engine import LLMEngine, RequestOutput

PLACEHOLDER = -1  # a token id no vocabulary has: reading it as input is a bug the hole patch would hide


@dataclass(slots=True)
class _Flight:
    """A launched step: its plan, the forward's future, and what its launch changed in sequence state."""

    plan: StepPlan
    future: Future
    # Each scheduled sequence's preemption count at launch: one that differs on landing was preempted meanwhile.
    launched: dict[Sequence, int] = field(default_factory=dict)
    # seq -> (index of its placeholder in token_ids, its row in this step's sampled output)
    pending: dict[Sequence, tuple[int, int]] = field(default_factory=dict)
    sampled: SamplerOutput | None = None  # set on landing
    elapsed: float = 0.0  # the forward's wall time


@dataclass(slots=True)
class StepTimes:
    """Where the step loop's time went (seconds), for the overlap benchmark's breakdown."""

    cpu: float = 0.0  # scheduling, inputs, landing: the step thread's own work
    wait: float = 0.0  # the step thread blocked on a forward
    forward: float = 0.0  # the worker's forward + sampling


class OverlapStepper:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # One worker: forwards run in launch order, one at a time (the KV ordering rests on it).
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="engine-forward")
        self.flight: _Flight | None = None
        self.times = StepTimes()

    # -- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        e = self.engine
        t0 = time.perf_counter()
        failed = e._fail_adapter_loads()
        e._prefetch_adapters()
        if self.flight is not None and _guided(e):
            failed += self.drain()  # the next mask needs this step's tokens: no overlap for it
        plan = e.scheduler.schedule()
        e._account_plan(plan)
        prepared, refused = None, None
        if not plan.is_empty:
            try:
                prepared = e.runner.begin(plan, e.adapters)
            except Exception as exc:  # a value no tensor can hold: found out per sequence below, as in a forward
                refused = exc
        holes = _holes(plan)
        landing, self.flight = self.flight, None
        self.times.cpu += time.perf_counter() - t0
        outputs: list[RequestOutput] = []
        tokens: dict[Sequence, int] = {}
        if landing is not None:
            outputs, tokens = self._land(landing)
        t1 = time.perf_counter()
        if plan.block_copies:  # between two forwards: the landed one has written what they read
            e._copy_blocks(plan)
        flight = self._launch(plan, prepared, holes, tokens) if prepared is not None else None
        if landing is not None:
            outputs += self._postprocess(landing)  # while the next forward runs
        if flight is not None:
            self._mark(flight)
        elif refused is not None:  # the landed tokens are in place now: run this step one sequence at a time
            outputs += e._isolate(StepPlan([s for s in plan.scheduled if s.seq.status is Status.RUNNING]), refused)
        self.flight = flight
        e.last_plan_empty = landing is None and plan.is_empty
        e._update_gauges()
        self.times.cpu += time.perf_counter() - t1
        return failed + outputs

    def drain(self) -> list[RequestOutput]:
        """Land the step in flight (if any): afterwards the engine's state is the synchronous loop's."""
        flight, self.flight = self.flight, None
        if flight is None:
            return []
        outputs, _ = self._land(flight)
        return outputs + self._postprocess(flight)

    def abandon(self) -> None:
        """After an error outside any one request: wait for the forward, forget its step (the engine fails the
        running requests), and take its placeholders back so no sequence keeps a token that never came."""
        flight, self.flight = self.flight, None
        if flight is None:
            return
        try:
            flight.future.result()
        except Exception:
            pass  # its requests are failed by the caller (LLMEngine.recover)
        _take_placeholders(flight)

    # -- launching and landing -------------------------------------------------------------------------
    def _launch(self, plan: StepPlan, prepared: PreparedStep, holes: list[tuple[int, Sequence]],
                tokens: dict[Sequence, int]) -> _Flight:
        """Fill the plan's holes with the landed step's tokens and start its forward."""
        if holes:
            # 0 for a sequence that finished or failed on the landed step: its row's token is discarded.
            values = [tokens.get(seq, 0) for _, seq in holes]
            with torch.inference_mode():
                ids = prepared.inputs.input_ids
                ids[torch.tensor([r for r, _ in holes], dtype=torch.int64, device=ids.device)] = torch.tensor(
                    values, dtype=ids.dtype, device=ids.device)
        return _Flight(plan, self.worker.submit(self._forward, plan, prepared),
                       {s.seq: s.seq.num_preemptions for s in plan.scheduled})

    def _mark(self, flight: _Flight) -> None:
        """The launched step's progress, as the next schedule must see it: its tokens computed, and a
        placeholder for each token it samples -- once the landed step's own tokens are in place."""
        max_len = self.engine.max_model_len
        row = 0
        for s in flight.plan.scheduled:
            seq = s.seq
            if s.samples:
                row += 1
            if seq.status is not Status.RUNNING or flight.launched[seq] != seq.num_preemptions:
                continue  # finished, aborted or preempted by the landed step: its row is discarded
            seq.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples and not _ends_by_length(seq, max_len):
                flight.pending[seq] = (len(seq.token_ids), row - 1)
                seq.token_ids.append(PLACEHOLDER)

    def _forward(self, plan: StepPlan, prepared: PreparedStep) -> tuple[SamplerOutput | None, float]:
        t0 = time.perf_counter()
        if self.engine._failpoints:
            self.engine._hit_failpoints(plan)
        sampled = self.engine.runner.run(prepared)
        elapsed = time.perf_counter() - t0
        self.times.forward += elapsed
        return sampled, elapsed

    def _land(self, flight: _Flight) -> tuple[list[RequestOutput], dict[Sequence, int]]:
        """Wait for the flight's forward; its sampled token per pending sequence. A failed forward is isolated
        (LLMEngine._isolate re-runs its sequences one at a time) before anything else runs on the KV."""
        t0 = time.perf_counter()
        try:
            flight.sampled, flight.elapsed = flight.future.result()
        except Exception as exc:
            self.times.wait += time.perf_counter() - t0
            return self._isolate(flight, exc)
        self.times.wait += time.perf_counter() - t0
        rows = flight.sampled.token_ids if flight.sampled is not None else []
        return [], {seq: rows[row] for seq, (_, row) in flight.pending.items()}

    def _isolate(self, flight: _Flight, exc: Exception) -> tuple[list[RequestOutput], dict[Sequence, int]]:
        e = self.engine
        _take_placeholders(flight)
        keep = []
        for s in flight.plan.scheduled:
            if _in_place(s.seq, flight):
                s.seq.num_computed_tokens = s.start  # as when the step was planned: _isolate re-runs from there
                keep.append(s)
            elif s.seq.status is Status.WAITING and e.kv.is_swapped(s.seq.request_id):
                e.kv.free(s.seq.request_id)  # swapped out with KV this step never wrote: recompute it instead
        outputs = e._isolate(StepPlan(keep), exc) if keep else []
        tokens = {seq: seq.token_ids[i] for seq, (i, _) in flight.pending.items() if len(seq.token_ids) > i}
        flight.plan = StepPlan()  # post-processed already
        return outputs, tokens

    def _postprocess(self, flight: _Flight) -> list[RequestOutput]:
        """The landed step's post-processing: the synchronous path's, on the sequences as they are now."""
        e = self.engine
        plan = flight.plan
        if plan.is_empty:
            return []
        _take_placeholders(flight)
        moved = {s.seq for s in plan.scheduled if not _in_place(s.seq, flight)}
        prefill = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        e.preemption.observe_step(prefill, plan.num_batched_tokens, flight.elapsed)
        outputs = e._postprocess(plan, flight.sampled, flight.elapsed, moved)
        finished = e.scheduler.num_finished - e._finished_seen
        e._finished_seen = e.scheduler.num_finished
        e.load.observe(e.scheduler, flight.elapsed, finished)
        return outputs


def _holes(plan: StepPlan) -> list[tuple[int, Sequence]]:
    """(row, sequence) of the plan's input rows that are a pending token: always a sequence's last one."""
    holes = []
    row = 0
    for s in plan.scheduled:
        row += s.num_new_tokens
        if s.seq.token_ids[s.start + s.num_new_tokens - 1] == PLACEHOLDER:
            holes.append((row - 1, s.seq))
    return holes


def _take_placeholders(flight: _Flight) -> None:
    for seq, (i, _) in flight.pending.items():
        if len(seq.token_ids) > i and seq.token_ids[i] == PLACEHOLDER:
            del seq.token_ids[i]


def _in_place(seq: Sequence, flight: _Flight) -> bool:
    """The sequence is running as when its step was launched (not finished, aborted or preempted since)."""
    return seq.status is Status.RUNNING and flight.launched.get(seq) == seq.num_preemptions


def _ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """The token this step samples reaches max_tokens or the context: it will be the sequence's last."""
    return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_model_len


def _guided(engine: LLMEngine) -> bool:
    return any(seq.matcher is not None for seq in engine.scheduler.running)
