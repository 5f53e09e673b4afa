"""How much to speculate: per sequence from its measured acceptance, for the batch from how full it is.

Before each step the controller sets `seq.spec_draft` on every running sequence (empty for most); the
scheduler fits those drafts into the step (scheduler._fit_draft), the forward verifies them, and the
engine reports back what was accepted (`observe`) and what the step cost (`observe_step`).

When a draft token pays: a step costs about `fixed + per_token * tokens` (fitted online, step_time.StepCostModel).
With n sequences decoding, an emitted token is worth the step's cost per sequence, fixed / n + per_token;
the j-th draft token of a sequence costs per_token plus its share of its drafter's measured time per drafted
position (a draft model's batched forward, shared by the m sequences using it; ~0 for prompt lookup) and is
emitted with probability rate ** j. So a draft is extended while rate ** j >= (per_token + draft / m) /
(fixed / n + per_token): deep drafts alone in the batch (the fixed cost dominates), shorter as n grows, none
once the bar passes every sequence's rate -- the busy case costs nothing. Besides: none while requests wait for admission (their prefills need the budget) and none
from `max_running` sequences on.
"""
from __future__ import annotations

import math
import time
from collections import deque

from services.engine.config import SpeculativeConfig, spec_key
from services.engine.sequence import Sequence
from services.engine.spec.drafter import Drafter
from services.engine.spec.payoff import PayoffTracker, bucket
from services.engine.step_time import StepCostModel

DECAY = 0.7  # weight of the past in a sequence's acceptance estimate (recent steps count most)
# A sequence whose estimate says "do not draft" still drafts one token every PROBE_EVERY steps -- more rarely in
# a fuller batch: every PROBE_EVERY * (n // PROBE_PER) steps with n sequences decoding, so that about one of them
# probes per step whatever the batch. A probe through a draft model costs that sequence's catch-up forward
# (priced like any first draft: `_worth_catching_up`).
PROBE_EVERY = 8
PROBE_PER = 8
LENGTHS_KEPT = 64  # a model's most recent finished output lengths, what a running sequence's horizon is read from


class SpecController:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None, *,
                 drafters: dict[str, Drafter] | None = None):
        """`drafters` by name (drafter.make_drafters), each sequence using the one its model/adapter is
        configured with (SpeculativeConfig.drafter_for); `drafter`, when set, drafts for every sequence
        (tests script one)."""
        self.config = config
        self.drafter = drafter
        self.drafters = drafters or {}
        self.cost = StepCostModel()
        self.payoff = PayoffTracker()
        self._draft_seconds = 0.0  # spent drafting for the step being proposed
        self._lengths: dict[str, deque[int]] = {}  # model / adapter key -> recent finished output lengths
        self._gains: dict[tuple, float] = {}  # this step's _expected_gain answers
        self._step: tuple[int, bool] | None = None  # (bucket, speculated) of the step being proposed

    def observe_step(self, tokens: int, seconds: float, emitted: int, decode_only: bool) -> None:
        """The step's computed tokens, wall time (drafting and output handling included) and emitted tokens.
        The step-cost model gets the time without drafting (a drafter's cost is kept apart, per drafter);
        the payoff tracker gets all of it."""
        self.cost.observe(tokens, seconds - self._draft_seconds)
        if self._step is not None and decode_only:
            self.payoff.observe(*self._step, emitted, seconds)
        self._step = None
        self._draft_seconds = 0.0

    def threshold(self, n: int, drafter: str | None = None, users: int = 1) -> float:
        """The acceptance probability a draft token needs to pay for itself with n sequences decoding: it
        costs a verification row and its share of the drafter's time per position (a draft model's batched
        forward, shared by the `users` sequences drafting with it; ~0 for prompt lookup), and when accepted
        saves an emitted token's share of a step."""
        if not self.config.adaptive_to_load:
            return self.config.accept_threshold
        fixed, per_token = self.cost.estimate()
        d = self.drafter or self.drafters.get(drafter)
        cost = per_token + (d.cost_per_position if d is not None else 0.0) / max(users, 1)
        return max(self.config.accept_threshold, cost / (fixed / n + per_token))

    def propose(self, running: list[Sequence], num_waiting: int, budget: int, max_model_len: int) -> int:
        """Set this step's draft of every running sequence; returns the number of draft tokens proposed."""
        cfg = self.config
        self._gains.clear()
        for seq in running:
            seq.spec_draft = ()
        n = len(running)
        if num_waiting or n >= cfg.max_running or n == 0:
            return 0
        threshold = self.threshold(n)
        b = bucket(n)
        if threshold >= 1.0 or (cfg.adaptive_to_load and not self.payoff.pays(b)):
            self._step = (b, False)
            return 0
        spare = budget - n  # tokens left beside one decode row per sequence
        asked: list[Sequence] = []
        ks: list[int] = []
        users: dict[str, int] = {}
        for seq in running:
            if seq.spec_drafter is None:
                seq.spec_drafter = cfg.drafter_for(spec_key(seq.adapter)) or ""
            users[seq.spec_drafter] = users.get(seq.spec_drafter, 0) + 1
        bars = {name: self.threshold(n, name, count) for name, count in users.items()}
        probe_every = PROBE_EVERY * max(1, n // PROBE_PER)
        fixed, per_token = self.cost.estimate()
        value = fixed / n + per_token  # what an emitted token saves
        for seq in running:
            k = self._k(seq, bars[seq.spec_drafter], max_model_len, probe_every)
            if k > 0 and not self._worth_catching_up(seq, k, bars[seq.spec_drafter] * value, value):
                k = 0
            if k > 0 and spare > 0:
                k = min(k, spare)
                spare -= k
                asked.append(seq)
                ks.append(k)
        total = 0
        by_drafter: dict[str, tuple[list[Sequence], list[int]]] = {}
        for seq, k in zip(asked, ks):
            group = by_drafter.setdefault(seq.spec_drafter, ([], []))
            group[0].append(seq)
            group[1].append(k)
        for name, (seqs, group_ks) in by_drafter.items():  # one batched call per drafter
            drafter = self.drafter or self.drafters[name]
            t0 = time.perf_counter()
            drafts = drafter.propose(seqs, group_ks)
            self._draft_seconds += time.perf_counter() - t0
            for seq, draft in zip(seqs, drafts, strict=True):
                seq.spec_draft = draft
                total += len(draft)
        self._step = (b, total > 0)
        return total

    def finished(self, seq: Sequence) -> None:
        """A sequence ended on its own (a stop or its length): its output length joins its model's record."""
        kept = self._lengths.setdefault(spec_key(seq.adapter), deque(maxlen=LENGTHS_KEPT))
        kept.append(seq.num_output_tokens)
        self._gains.clear()

    def _horizons(self, seq: Sequence) -> list[int]:
        """The tokens this sequence may still produce, one figure per recent finished answer of its model that
        got as far as it has (how far that one went beyond); with none such, one figure: as many as it has run
        before any answer finished (it has lived that long), 1 once it has outlived every recorded one. Never
        past max_tokens."""
        done = seq.num_output_tokens
        left = seq.params.max_tokens - done
        record = self._lengths.get(spec_key(seq.adapter), ())
        beyond = [n - done for n in record if n > done] or [1 if record else max(1, done)]
        return [min(r, left) for r in beyond]

    def _remaining(self, seq: Sequence) -> float:
        """The tokens this sequence is expected to go on for: the mean of its horizons."""
        horizons = self._horizons(seq)
        return sum(horizons) / len(horizons)

    def _expected_gain(self, seq: Sequence, k: int, rate: float, cost_token: float, value: float) -> float:
        """What drafting k tokens a step is expected to save over the rest of this sequence: per step, the
        expected emitted draft tokens' worth less the verification rows, times the tokens it goes on for.
        Read over its horizons (`_horizons`), each on its own -- a draft token past a sequence's end is never
        emitted; a sequence that has outlived every recorded answer is expected to end next and gains nothing
        from drafts (at saturation's tail such sequences were caught up for 4 drafts, 1-2 of them
        accepted, stop 41)."""
        memo_key = (spec_key(seq.adapter), seq.num_output_tokens, seq.params.max_tokens, k, rate, cost_token, value)
        gain = self._gains.get(memo_key)  # a step's sequences of one model mostly share all of these
        if gain is not None:
            return gain
        horizons = self._horizons(seq)
        total = 0.0
        for r in horizons:
            useful = min(k, r - 1)  # drafts that can still be emitted before it ends
            total += (sum(rate ** j for j in range(1, useful + 1)) * value - k * cost_token) * r
        gain = total / len(horizons)
        self._gains[memo_key] = gain
        return gain

    def _worth_catching_up(self, seq: Sequence, k: int, cost_token: float, value: float) -> bool:
        """A drafter that runs a model must first feed it the sequence's tokens it has not seen (its whole
        context, the first time). That pays only if the drafting it enables saves more: the expected gain of a
        step of k draft tokens over the tokens the sequence is expected to go on for (`_horizons`). At
        saturation's tail the sequences that start drafting are nearly done: their catch-ups (~630 tokens
        through the draft model in a 0.18 s `repeat` run of bench/spec_bench.py) were the whole of speculation's
        loss there. A step's draft tokens count only as far as the sequence is expected to live (`_expected_gain`):
        chat answers of 6-10 tokens at saturation's tail caught up six sequences a run for 4 drafts each, most
        past their ends (acceptance 0.25-0.31 against 0.93 elsewhere; 5 ms of a ~165 ms run, stop 40). A drafter
        without a catch-up (prompt lookup) is never held back here."""
        d = self.drafter or self.drafters.get(seq.spec_drafter)
        catchup = getattr(d, "catchup_cost", None)
        if catchup is None:
            return True
        cost = catchup(seq)
        if cost <= 0:
            return True
        return self._expected_gain(seq, k, acceptance_rate(seq), cost_token, value) >= cost

    def _k(self, seq: Sequence, threshold: float, max_model_len: int, probe_every: int = PROBE_EVERY) -> int:
        """Draft length for one decoding sequence: the depth at which rate ** depth falls below the bar,
        capped so that a fully accepted step never passes max_tokens or the context."""
        p = seq.params
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.matcher is not None:
            return 0  # mid-prefill; or constrained output, whose grammar would need a mask per draft position
        if not seq.spec_drafter:
            return 0  # the gate (spec/gate.py) did not find speculation exact and worth it for this model/adapter
        cap = min(self.config.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                  max_model_len - seq.num_tokens)
        if cap <= 0:
            return 0
        rate = acceptance_rate(seq)
        if rate >= 1.0:
            k = cap
        elif rate <= 0.0:
            k = 0
        else:
            k = int(math.log(threshold) / math.log(rate))
        if k <= 0:
            seq.spec_idle_steps += 1
            if seq.spec_idle_steps < probe_every:
                return 0
            k = 1  # probe: a sequence's copy phase may start late (a quote after a preamble)
        seq.spec_idle_steps = 0
        return min(k, cap)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` tokens matched. Each accepted token is a success and
        the first rejection (if any) a failure of the per-token acceptance estimate."""
        seq.spec_drafted += drafted
        seq.spec_accepted += accepted
        seq.spec_hits = DECAY * seq.spec_hits + accepted
        seq.spec_trials = DECAY * seq.spec_trials + accepted + (accepted < drafted)

    def check_integrity(self, live: set[str]) -> None:
        for drafter in self.drafters.values():
            drafter.check_integrity(live)

    def forget(self, request_id: str) -> None:
        for drafter in (self.drafter, *self.drafters.values()):
            if drafter is not None:
                drafter.forget(request_id)


def acceptance_rate(seq: Sequence) -> float:
    """Estimated chance that the next draft token is accepted (optimistic before any evidence)."""
    prior_hits, prior_trials = 0.4, 0.5
    return (seq.spec_hits + prior_hits) / (seq.spec_trials + prior_trials)
