"""Speculative decoding (services/engine/spec/): drafts verified in the ordinary step change nothing a
request receives -- greedy and seeded outputs are token-identical to plain decoding on every scheduler path
(chunked prefill, prefix hits, preemption by recompute and swap, many adapters), sampling follows the
same distribution (chi-square), stops / min_tokens / max_tokens / logprobs hold -- and the KV of rejected
drafts is released block-exactly (check_integrity after every step)."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from services.common.lora_format import content_id
from services.engine.config import ConfigError, EngineConfig, SpeculativeConfig
from services.engine.engine import LLMEngine
from services.engine.sequence import AdapterRef, SamplingParams
from services.engine.spec.controller import SpecController
from services.engine.step_time import StepCostModel
from services.engine.spec.drafter import NgramDrafter
from services.engine.spec.verify import accepted_lengths, sample_rows
from tests.engine.conftest import make_config, spec_tokens

# Not adaptive to load: which steps speculate must not depend on how fast this machine runs them.
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive_to_load=False)


class ScriptedDrafter:
    """A deterministic drafter for tests: proposes a known continuation (the plain run's output at the
    sequence's position), corrupting one token of every `wrong_every`-th proposal -- so steps accept all,
    part or none of their drafts. Deterministic given the schedule (which does not depend on timing here:
    NGRAM is not adaptive to load), and a point mass per proposal, as the Drafter contract asks."""

    name = "scripted"
    cost_per_position = 0.0

    def __init__(self, refs: dict[str, list[int]], vocab: int, wrong_every: int = 3):
        self.refs, self.vocab, self.wrong_every = refs, vocab, wrong_every
        self.calls = 0

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            n = s.num_output_tokens
            draft = list(self.refs.get(s.request_id, [])[n : n + k])
            if draft:
                self.calls += 1
                if self.calls % self.wrong_every == 0:
                    j = n % len(draft)
                    draft[j] = (draft[j] + 1) % self.vocab
            out.append(tuple(draft))
        return out

    def forget(self, request_id):
        pass


def spec_config(config: EngineConfig, **kw) -> EngineConfig:
    return dataclasses.replace(config, speculative=dataclasses.replace(NGRAM, **kw))


def run(engine: LLMEngine, requests: list[dict]) -> dict[str, dict]:
    """Every request to completion, integrity checked after every step: tokens, text, logprobs, and the
    last output (finish reason, usage) per request."""
    for r in requests:
        engine.add_request(r["id"], r["prompt"], r["params"], adapter=r.get("adapter"))
    res = {r["id"]: {"tokens": [], "text": "", "logprobs": [], "last": None} for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            d = res[o.request_id]
            d["tokens"] += o.new_token_ids
            d["text"] += o.new_text
            d["logprobs"] += o.logprobs or []
            d["last"] = o
        engine.check_integrity()
        if engine.last_plan_empty:
            engine.wake.wait(0.05)
            engine.wake.clear()
    engine.check_integrity()
    return res


def prompts(n: int, seed: int = 0, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 70))]
        out.append((shared or []) + body if i % 2 == 0 else body)
    return out


def compare_with_plain(config: EngineConfig, requests: list[dict], *, wrong_every: int = 3,
                       min_drafts: int = 20) -> tuple[LLMEngine, dict, dict]:
    """Plain run, then a speculative run whose drafter proposes the plain outputs with errors: identical."""
    plain = run(LLMEngine(config), requests)
    engine = LLMEngine(spec_config(config))
    engine.spec.drafter = ScriptedDrafter({k: v["tokens"] for k, v in plain.items()},
                                          engine.model.config.vocab_size, wrong_every)
    spec = run(engine, [dict(r, id=r["id"]) for r in requests])
    for rid in plain:
        assert spec[rid]["tokens"] == plain[rid]["tokens"], rid
        assert spec[rid]["last"].finish_reason == plain[rid]["last"].finish_reason
    drafted = sum(v["last"].num_draft_tokens for v in spec.values())
    accepted = sum(v["last"].num_accepted_tokens for v in spec.values())
    assert drafted >= min_drafts and 0 < accepted < drafted, (drafted, accepted)
    return engine, plain, spec


def greedy(max_tokens=32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


# -- pieces ---------------------------------------------------------------------------------------
def test_ngram_drafter_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(min_n=1, max_n=3)

    class S:
        def __init__(self, rid, ids):
            self.request_id, self.all_token_ids = rid, ids

    # suffix (7, 8) occurred twice; the latest occurrence is followed by 9, 4.
    assert d.propose([S("a", [7, 8, 1, 2, 7, 8, 9, 4, 5, 7, 8])], [2]) == [(9, 4)]
    assert d.propose([S("b", [1, 2, 3, 4])], [3]) == [()]  # nothing repeats
    assert d.propose([S("c", [5, 6, 5])], [4]) == [(6, 5)]  # continuation shorter than asked: what there is
    assert d.propose([S("d", [1, 2, 3, 1, 2])], [0]) == [()]
    # Tokens appended later are seen (the drafter keeps a growing buffer per request).
    s = S("e", [1, 2, 3])
    assert d.propose([s], [2]) == [()]
    s.all_token_ids = [1, 2, 3, 9, 1, 2]
    assert d.propose([s], [2]) == [(3, 9)]
    d.forget("e")
    assert "e" not in d._arrays


def test_sample_rows_and_accepted_lengths():
    ends = torch.tensor([5, 6, 12])
    assert sample_rows(ends, torch.tensor([1, 0, 3])).tolist() == [4, 9, 10, 11]
    # seq0: draft (3, 4), sampled (3, 4, 9): 2; seq1: no draft: 0; seq2: (5, 6, 7) vs (5, 1, 7, 2): 1.
    sampled = [3, 4, 9, 8, 5, 1, 7, 2]
    assert accepted_lengths(sampled, [(3, 4), (), (5, 6, 7)]) == [2, 0, 1]
    assert accepted_lengths([1, 2], [(), ()]) == [0, 0]


def test_controller_adapts_per_sequence_and_to_load(tiny_model):
    engine = LLMEngine(spec_config(make_config(tiny_model), adaptive_to_load=True))
    ctl: SpecController = engine.spec
    ctl.drafter = ScriptedDrafter({f"s{i}": list(range(100, 200)) for i in range(4)}, 512, wrong_every=10**9)
    seqs = [engine.add_request(f"s{i}", [5, 6, 7, 5, 6, 7, 5, 6, 40 + i, 5, 6], greedy(64)) for i in range(4)]
    engine.step()  # prefill: now each sequence is one decode row
    ctl.cost = StepCostModel()  # forget that step's timing: the test must not depend on this machine's speed
    assert all(s.num_tokens - s.num_computed_tokens == 1 for s in seqs)
    assert ctl.propose(seqs, 0, 2048, 256) > 0 and all(len(s.spec_draft) == 4 for s in seqs)
    # A sequence whose drafts keep failing stops drafting (and probes now and then); the others go on.
    for _ in range(6):
        ctl.observe(seqs[0], 4, 0)
    ctl.propose(seqs, 0, 2048, 256)
    assert seqs[0].spec_draft == () and len(seqs[1].spec_draft) == 4
    # Requests waiting for admission, or a full batch: no speculation at all.
    assert ctl.propose(seqs, 1, 2048, 256) == 0 and all(s.spec_draft == () for s in seqs)
    full = SpecController(dataclasses.replace(NGRAM, max_running=4), ctl.drafter)
    assert full.propose(seqs, 0, 2048, 256) == 0
    # The bar a draft token must clear rises with the batch (the step's fixed cost is shared by more
    # sequences) and reaches 1 for a big batch when the fixed cost is small next to the per-token cost.
    assert ctl.threshold(1) <= ctl.threshold(8) < ctl.threshold(64) < ctl.threshold(256)
    for _ in range(300):
        ctl.observe_step(8, 1e-3 + 8 * 1e-4, 8, True)
        ctl.observe_step(64, 1e-3 + 64 * 1e-4, 64, True)
    fixed, per_token = ctl.cost.estimate()
    assert fixed == pytest.approx(1e-3, rel=0.05) and per_token == pytest.approx(1e-4, rel=0.05)
    assert ctl.threshold(256) > 0.95
    # Never past max_tokens: a sequence with 2 tokens left drafts at most 1.
    seqs[2].params = dataclasses.replace(seqs[2].params, max_tokens=seqs[2].num_output_tokens + 2)
    ctl.propose(seqs, 0, 2048, 256)
    assert len(seqs[2].spec_draft) <= 1


def test_probes_thin_out_as_the_batch_fills(tiny_model):
    """Sequences whose drafts never land still probe one token now and then -- every 8th step in a small batch,
    about one probe per step over a fuller one (a probe through a draft model costs a catch-up forward)."""
    from services.engine.spec.controller import PROBE_EVERY, PROBE_PER

    engine = LLMEngine(spec_config(make_config(tiny_model), adaptive_to_load=False))
    ctl: SpecController = engine.spec
    ctl.drafter = ScriptedDrafter({f"s{i}": list(range(100, 200)) for i in range(64)}, 512, wrong_every=10**9)
    seqs = [engine.add_request(f"s{i}", [5, 6, 7, 40 + i % 50], greedy(200)) for i in range(64)]
    engine.step()
    for seq in seqs:
        for _ in range(6):
            ctl.observe(seq, 4, 0)

    def probes(group, steps):
        drafted = []
        for _ in range(steps):
            ctl.propose(group, 0, 4096, 512)
            drafted.append(sum(len(x.spec_draft) for x in group))
        return drafted

    small = probes(seqs[:4], 4 * PROBE_EVERY)
    assert sum(small) == 4 * 4 and max(small) == 4  # each of the 4 probes once every PROBE_EVERY steps
    full = seqs[:24]  # below the controller's max_running (32), where speculation is on at all
    every = PROBE_EVERY * (24 // PROBE_PER)
    big = probes(full, every)
    assert every == 24 and sum(big) == 24  # each of the 24 once in `every` steps, not 3 times


def test_payoff_tracker_turns_speculation_off_where_it_loses_and_keeps_exploring():
    from services.engine.spec.payoff import EXPLORE_EVERY, PayoffTracker, bucket

    assert [bucket(n) for n in (1, 2, 3, 4, 7, 8, 31, 32)] == [0, 1, 1, 2, 2, 3, 4, 5]
    t = PayoffTracker()
    decisions = [t.pays(3) for _ in range(2 * EXPLORE_EVERY)]
    assert decisions.count(False) == 2  # no evidence: speculate, but explore the other side
    for _ in range(3):  # at this load, steps with drafts emit fewer tokens per second (MIN_SAMPLES of each)
        t.observe(3, True, 10, 0.01)
        t.observe(3, False, 16, 0.01)
        t.observe(0, True, 3, 0.002)
        t.observe(0, False, 1, 0.002)
    decisions = [t.pays(3) for _ in range(2 * EXPLORE_EVERY)]
    assert decisions.count(True) == 2  # off, exploring once in EXPLORE_EVERY steps (backing off: the next test)
    assert [t.pays(0) for _ in range(EXPLORE_EVERY - 1)] == [True] * (EXPLORE_EVERY - 1)


def test_exploring_a_losing_speculation_backs_off_and_resets_when_it_wins():
    """Each exploration that confirms the loss doubles the wait for the next (8, 16, 32, ... EXPLORE_MAX); a win
    brings it back to every EXPLORE_EVERY-th step."""
    from services.engine.spec.payoff import EXPLORE_EVERY, EXPLORE_MAX, PayoffTracker

    t = PayoffTracker()
    for _ in range(10):
        t.observe(5, False, 16, 0.01)
    gaps, last = [], 0
    for step in range(1, 1200):
        if t.pays(5):
            gaps.append(step - last)
            last = step
            t.observe(5, True, 10, 0.01)  # the exploration loses again
        else:
            t.observe(5, False, 16, 0.01)
    assert gaps[:3] == [1, 1, 1]  # no evidence about drafts yet: speculate until MIN_SAMPLES steps say otherwise
    assert gaps[4:8] == [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, 8 * EXPLORE_EVERY, EXPLORE_MAX]
    assert set(gaps[8:]) == {EXPLORE_MAX} and len(gaps[8:]) >= 5
    for _ in range(20):  # the load drops: drafts now win in this bucket
        t.observe(5, True, 40, 0.01)
    assert sum(not t.pays(5) for _ in range(2 * EXPLORE_EVERY)) == 2  # on again, the off side explored every 8th


def test_config_is_validated():
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="draft_model")  # no checkpoint
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="auto", draft_model="d", drafters=(("base", "eagle"),))
    # Each sequence's drafter: auto routes the base model to the draft model and adapters to prompt lookup
    # unless the gates chose otherwise; enabled_for still turns speculation off per key.
    auto = SpeculativeConfig(method="auto", draft_model="d", drafters=(("cid-b", "draft_model"),))
    assert [auto.drafter_for(k) for k in ("base", "cid-a", "cid-b")] == ["draft_model", "ngram", "draft_model"]
    gated = dataclasses.replace(auto, enabled_for=("cid-a",))
    assert [gated.drafter_for(k) for k in ("base", "cid-a")] == [None, "ngram"]
    assert SpeculativeConfig(method="ngram").drafter_for("base") == "ngram" and auto.drafter_names == ("ngram", "draft_model")


# -- greedy: identical to plain decoding on every scheduler path -------------------------------------
def test_greedy_identical_in_one_batch(tiny_model):
    reqs = [{"id": f"r{i}", "prompt": p, "params": greedy(40)} for i, p in enumerate(prompts(16))]
    compare_with_plain(make_config(tiny_model), reqs)


def test_greedy_identical_with_chunked_prefill_beside_drafts(tiny_model):
    """A small budget: verification rows share steps with other requests' prefill chunks."""
    reqs = [{"id": f"r{i}", "prompt": p, "params": greedy(30)} for i, p in enumerate(prompts(12, seed=1))]
    engine, _, _ = compare_with_plain(make_config(tiny_model, budget=24, block_size=4), reqs)


def test_greedy_identical_under_preemption(tiny_model):
    """A tiny KV pool: sequences are preempted (by recompute, and by swap) between speculative steps."""
    ps = prompts(12, seed=2)
    need = max(len(p) for p in ps) + 40
    for mode in ("recompute", "swap"):
        reqs = [{"id": f"{mode}{i}", "prompt": p, "params": greedy(40)} for i, p in enumerate(ps)]
        config = make_config(tiny_model, block_size=4, budget=64, num_blocks=need // 4 + 24, preemption_mode=mode)
        engine, _, _ = compare_with_plain(config, reqs, min_drafts=10)
        assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_blocks_written_by_accepted_drafts_are_right(tiny_model):
    """Full blocks completed by accepted drafts are published to the prefix cache: later prompts that
    extend a finished request's output hit them, and their outputs still equal plain decoding's."""
    shared = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    first = [{"id": f"a{i}", "prompt": p, "params": greedy(40)} for i, p in enumerate(prompts(6, seed=3, shared=shared))]
    config = make_config(tiny_model, block_size=4)
    engine, plain, spec = compare_with_plain(config, first)
    second = [{"id": f"b{i}", "prompt": r["prompt"] + spec[r["id"]]["tokens"][:30], "params": greedy(16)}
              for i, r in enumerate(first)]
    hits = engine.metrics.prefix_hit_tokens._value.get()
    plain2 = run(LLMEngine(config), second)
    engine.spec.drafter.refs.update({k: v["tokens"] for k, v in plain2.items()})
    spec2 = run(engine, second)
    assert {k: v["tokens"] for k, v in spec2.items()} == {k: v["tokens"] for k, v in plain2.items()}
    assert engine.metrics.prefix_hit_tokens._value.get() - hits >= 6 * 24  # prompt + generated blocks


def test_many_adapters_verify_with_their_adapter(tiny_model, tmp_path):
    """Adapter rows' draft tokens run through their adapter (the SGMV segments cover the extra rows)."""
    from services.modelkit import make_random_adapter

    refs = []
    for i, (rank, targets) in enumerate([(4, ["q_proj", "v_proj"]), (8, ["gate_proj", "up_proj", "down_proj"]),
                                         (16, ["q_proj", "k_proj", "v_proj", "o_proj"]), (2, ["o_proj"])]):
        path = make_random_adapter(tiny_model, tmp_path / f"a{i}", rank=rank, target_modules=targets, seed=i,
                                   init_scale=3.0)
        refs.append(AdapterRef(content_id(path), f"a{i}", str(path)))
    reqs = [{"id": f"r{i}", "prompt": p, "params": greedy(30), "adapter": refs[i % 5] if i % 5 < 4 else None}
            for i, p in enumerate(prompts(15, seed=4))]
    for kernel in ("native", "torch"):
        compare_with_plain(make_config(tiny_model, max_loras=4, lora_kernel=kernel), reqs)
    # The adapters matter: the same prompts on the base model alone come out different.
    base = run(LLMEngine(make_config(tiny_model)), [dict(r, adapter=None) for r in reqs])
    adapted = run(LLMEngine(make_config(tiny_model, max_loras=4)), reqs)
    assert sum(base[r["id"]]["tokens"] != adapted[r["id"]]["tokens"] for r in reqs if r["adapter"]) >= 6


# -- sampling -------------------------------------------------------------------------------------------
def test_seeded_sampling_stops_min_tokens_and_logprobs_identical(tiny_model):
    """temperature / top-k / top-p, min_tokens, stop_token_ids, max_tokens and logprobs: the speculative
    run emits exactly what plain decoding emits (each position is sampled with the request's seed and the
    counter of that output position, then the draft is accepted only where it matches)."""
    ps = prompts(16, seed=5)
    reqs = []
    for i, p in enumerate(ps):
        params = SamplingParams(max_tokens=20 + i, temperature=[0.7, 1.0, 1.3][i % 3], seed=1000 + i,
                                top_k=[0, 20, 5][i % 3], top_p=[1.0, 0.9, 0.8][i // 3 % 3], min_tokens=i % 8,
                                stop_token_ids=(7, 9, 11) if i % 4 == 0 else (), logprobs=[None, 0, 3][i % 3])
        reqs.append({"id": f"s{i}", "prompt": p, "params": params})
    engine, plain, spec = compare_with_plain(make_config(tiny_model), reqs, min_drafts=10)
    for r in reqs:
        a, b = plain[r["id"]], spec[r["id"]]
        p = r["params"]
        assert len(b["tokens"]) <= p.max_tokens and b["last"].num_output_tokens == len(b["tokens"])
        assert b["text"] == a["text"]
        if p.logprobs is not None:
            assert [x.token_id for x in b["logprobs"]] == b["tokens"]
            for x, y in zip(a["logprobs"], b["logprobs"]):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_stop_strings_inside_an_accepted_draft(tiny_model):
    """A stop string completed by a draft token in the middle of a draft ends the request there: the
    rest of the accepted draft is never emitted, and the text is the plain run's."""
    reqs = [{"id": f"t{i}", "prompt": p, "params": greedy(40)} for i, p in enumerate(prompts(8, seed=6))]
    plain = run(LLMEngine(make_config(tiny_model)), reqs)
    stopped = []
    for r in reqs:
        text = plain[r["id"]]["text"]
        mid = text[len(text) // 2 : len(text) // 2 + 3]
        if mid.strip() and len(mid) == 3:
            stopped.append(dict(r, params=greedy(40, stop=(mid,))))
    assert len(stopped) >= 4
    engine, plain2, spec2 = compare_with_plain(make_config(tiny_model), stopped, wrong_every=7, min_drafts=5)
    for r in stopped:
        assert spec2[r["id"]]["text"] == plain2[r["id"]]["text"]
        assert spec2[r["id"]]["last"].finish_reason == "stop"
        assert len(spec2[r["id"]]["tokens"]) < 40


def test_sampled_distribution_is_the_same_with_and_without_speculation(tiny_model, tiny_draft):
    """Chi-square homogeneity test on the four sampled tokens (top-k 3 keeps the cells few) of
    many unseeded requests with one prompt: plain decoding vs speculation whose drafts are the plain
    greedy continuation (accepted often, rejected often), and vs the draft model's. Different seeds per
    run, so equality of the samples is not what is tested -- their distribution is."""
    prompt = [5, 9, 31, 7, 44, 5, 9]
    n = 800
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    config = make_config(tiny_model, max_seqs=n)
    greedy_ref = run(LLMEngine(config), [{"id": "g", "prompt": prompt, "params": greedy(4)}])["g"]["tokens"]

    def sample(spec: str | None, seed: int) -> Counter:
        kw = dict(method="draft_model", draft_model=tiny_draft) if spec == "draft_model" else {}
        cfg = dataclasses.replace(spec_config(config, max_running=10 * n, **kw) if spec else config, seed=seed)
        engine = LLMEngine(cfg)
        if spec == "scripted":
            engine.spec.drafter = ScriptedDrafter({f"q{i}": greedy_ref for i in range(n)}, 0, wrong_every=10**9)
        res = run(engine, [{"id": f"q{i}", "prompt": prompt, "params": params} for i in range(n)])
        if spec:
            drafted = sum(v["last"].num_draft_tokens for v in res.values())
            accepted = sum(v["last"].num_accepted_tokens for v in res.values())
            assert drafted > n and 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
        assert all(len(v["tokens"]) == 4 for v in res.values())
        return Counter(tuple(v["tokens"]) for v in res.values())

    a, b = sample(None, 1), sample("scripted", 2)
    for other in (b, sample("draft_model", 3)):
        cells = sorted(set(a) | set(other), key=lambda c: -(a[c] + other[c]))
        common = [c for c in cells if a[c] + other[c] >= 10]
        table = [[a[c] for c in common] + [sum(a[c] for c in cells if c not in common)],
                 [other[c] for c in common] + [sum(other[c] for c in cells if c not in common)]]
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        assert len(common) >= 5
        _, pvalue = chi2_contingency(table)
        assert pvalue > 0.001, (pvalue, table)
    # The test can fail: against a distribution tilted towards the greedy path, it rejects.
    tilted = Counter(b)
    tilted[tuple(greedy_ref)] += n // 4
    t2 = [[a[c] for c in common], [tilted[c] for c in common]]
    assert chi2_contingency(t2)[1] < 0.001


def chi2_contingency(table: list[list[int]]) -> tuple[float, float]:
    """Pearson's chi-square test of homogeneity: (statistic, p-value)."""
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = (t.shape[0] - 1) * (t.shape[1] - 1)
    return float(stat), float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_billing_counts_only_emitted_tokens(tiny_model):
    """Usage is what was emitted: num_output_tokens equals the tokens streamed, and the same as without
    speculation; the draft and accepted totals are reported beside it and in the metrics."""
    reqs = [{"id": f"u{i}", "prompt": p, "params": greedy(25)} for i, p in enumerate(prompts(6, seed=7))]
    engine, plain, spec = compare_with_plain(make_config(tiny_model), reqs, min_drafts=10)
    for rid in plain:
        assert spec[rid]["last"].num_output_tokens == len(spec[rid]["tokens"]) == plain[rid]["last"].num_output_tokens
        assert spec[rid]["last"].num_prompt_tokens == plain[rid]["last"].num_prompt_tokens
    drafted = sum(v["last"].num_draft_tokens for v in spec.values())
    accepted = sum(v["last"].num_accepted_tokens for v in spec.values())
    assert spec_tokens(engine, "draft") == drafted and spec_tokens(engine, "accepted") == accepted
    m = engine.metrics.registry
    assert m.get_sample_value("mplex_engine_spec_tokens_total",
                              {"model": engine.config.model_name, "adapter": "base", "kind": "draft"}) == drafted
    assert m.get_sample_value("mplex_engine_spec_tokens_total",
                              {"model": engine.config.model_name, "adapter": "base", "kind": "accepted"}) == accepted
    assert m.get_sample_value("mplex_engine_generation_tokens_total", {"model": engine.config.model_name}) == \
        sum(len(v["tokens"]) for v in spec.values())


def test_ngram_drafter_end_to_end_on_repetitive_output(tiny_model):
    """The real prompt-lookup drafter: a prompt that repeats a span; whatever it drafts, the output equals
    plain decoding, and it does draft."""
    span = [21, 34, 55, 89, 144, 233, 377, 61]
    reqs = [{"id": f"n{i}", "prompt": span * 4 + [21 + i], "params": greedy(40)} for i in range(6)]
    config = make_config(tiny_model)
    plain = run(LLMEngine(config), reqs)
    engine = LLMEngine(spec_config(config))
    spec = run(engine, reqs)
    assert {k: v["tokens"] for k, v in spec.items()} == {k: v["tokens"] for k, v in plain.items()}
    assert sum(v["last"].num_draft_tokens for v in spec.values()) > 0


def test_constrained_rows_decode_plainly_beside_speculating_rows(tiny_model):
    """Grammar-constrained requests get no draft (a mask per draft position is not built yet): they
    decode one token a step, with their masks on the right rows, beside rows that speculate."""
    from services.common.structured import GUIDE_JSON_OBJECT, Guide

    guide = Guide(GUIDE_JSON_OBJECT).text
    reqs = []
    for i, p in enumerate(prompts(10, seed=8)):
        params = greedy(30) if i % 2 else SamplingParams(max_tokens=30, temperature=1.0, seed=i, guide=guide)
        reqs.append({"id": f"g{i}", "prompt": p, "params": params})
    engine, plain, spec = compare_with_plain(make_config(tiny_model), reqs, min_drafts=10)
    for i, r in enumerate(reqs):
        last = spec[r["id"]]["last"]
        assert (last.num_draft_tokens == 0) == (i % 2 == 0)


def test_gate_turns_speculation_on_only_where_it_passed(tiny_model, tmp_path):
    """The gate's verdict lists the sets (base / adapter content ids) where outputs agreed and the gain
    reached the bar; an engine speculates only for those. (The gain itself is a timing: the test sets the
    bar at 0 and at an unreachable value, and asserts the bookkeeping, not the speed.)"""
    from services.engine.kv_gate import KvEvalSet
    from services.engine.spec.gate import check_speculation, chosen_drafters, enabled_keys, record_verdict

    span = [21, 34, 55, 89, 144, 233, 377, 61]
    sets = [KvEvalSet("base", [span * 3 + [i] for i in range(3)])]
    ok = check_speculation(tiny_model, sets, min_gain=0.0, max_new_tokens=16)
    assert ok.per_set["base"]["token_agreement"] == 1.0 and ok.enabled == ["base"]
    assert check_speculation(tiny_model, sets, min_gain=1e9, max_new_tokens=16).enabled == []
    assert enabled_keys(tmp_path, tiny_model, "ngram") is None
    record_verdict(tmp_path, tiny_model, ok)
    assert enabled_keys(tmp_path, tiny_model, "ngram") == ("base",)
    # --speculative auto: per key, the drafter whose verdict passed with the higher gain.
    assert chosen_drafters(tmp_path / "none", tiny_model) is None
    assert chosen_drafters(tmp_path, tiny_model) == (("base",), (("base", "ngram"),))
    gain = ok.per_set["base"]["gain"]
    better = dataclasses.replace(ok, method="draft_model", per_set={
        "base": {**ok.per_set["base"], "gain": gain + 1}, "a1": {**ok.per_set["base"], "key": "cid1", "passed": False}})
    record_verdict(tmp_path, tiny_model, better)
    assert chosen_drafters(tmp_path, tiny_model) == (("base",), (("base", "draft_model"),))
    # enabled_for without "base": base rows never draft.
    engine = LLMEngine(spec_config(make_config(tiny_model), enabled_for=("some-adapter-content-id",)))
    res = run(engine, [{"id": "x", "prompt": span * 4, "params": greedy(20)}])
    assert res["x"]["last"].num_draft_tokens == 0


def test_split_path_multi_token_deltas_keep_stops_and_usage(tiny_model):
    """Through a core process (the front-end detokenizes and matches stop strings): a delta carrying an
    accepted draft is cut at a stop string inside it, and usage counts only the tokens shown."""
    import asyncio

    from tests.engine.conftest import collect, split_engine

    span = [21, 34, 55, 89, 144, 233, 377, 61, 99, 120]
    reqs = [{"id": f"p{i}", "prompt": span * 4 + [30 + i], "params": greedy(40)} for i in range(6)]
    config = make_config(tiny_model)
    plain = run(LLMEngine(config), reqs)
    for r in reqs:  # a stop string from the middle of each plain output
        text = plain[r["id"]]["text"]
        r["params"] = greedy(40, stop=(text[len(text) // 2: len(text) // 2 + 2],))
    plain_engine = LLMEngine(config)
    plain = run(plain_engine, reqs)

    async def main():
        async with split_engine(spec_config(config)) as (client, _):
            outs = await asyncio.gather(*(collect(client, r["id"], r["prompt"], r["params"]) for r in reqs))
            counters = await client.op("counters")
            return outs, counters

    outs, counters = asyncio.run(main())
    assert counters["steps"] < plain_engine.stats.steps  # drafts were accepted: fewer steps for the same tokens
    for r, o in zip(reqs, outs):
        p = plain[r["id"]]
        assert o.new_token_ids == p["tokens"] and o.new_text == p["text"], r["id"]
        assert o.finish_reason == p["last"].finish_reason
        assert o.num_output_tokens == len(o.new_token_ids)
    # the draft / accepted totals cross the core protocol (the engine's server reports them in `usage`)
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert all(0 <= o.num_accepted_tokens <= o.num_draft_tokens for o in outs)


# -- the draft-model drafter (spec/draft_model.py) -----------------------------------------------------
def draft_config(config: EngineConfig, draft, **kw) -> EngineConfig:
    return spec_config(config, method="draft_model", draft_model=draft, **kw)


def compare_draft_model(config: EngineConfig, draft, requests: list[dict]) -> tuple[LLMEngine, dict]:
    """The real draft model drafting: outputs identical to plain decoding's, drafts accepted in part."""
    plain = run(LLMEngine(config), requests)
    engine = LLMEngine(draft_config(config, draft))
    spec = run(engine, requests)
    for rid in plain:
        assert spec[rid]["tokens"] == plain[rid]["tokens"], rid
        assert spec[rid]["text"] == plain[rid]["text"]
    drafted = sum(v["last"].num_draft_tokens for v in spec.values())
    accepted = sum(v["last"].num_accepted_tokens for v in spec.values())
    assert drafted >= 20 and 0 < accepted < drafted, (drafted, accepted)
    assert not engine.spec.drafters["draft_model"]._slots  # every finished request's slot given back
    return engine, spec


class _Seq:
    def __init__(self, rid, ids):
        self.request_id, self.all_token_ids = rid, ids


def test_draft_model_cache_follows_accepted_and_rejected_tokens(tiny_model, tiny_draft):
    """The draft model's own KV: after drafts partly accepted, fully accepted, and a slot lost to another
    sequence, its proposals and the K/V its slot holds are those of a drafter that computed the sequence's
    tokens from scratch."""
    from services.engine.spec.draft_model import BLOCK, DraftModelDrafter

    def drafter(slots):
        return DraftModelDrafter(tiny_draft, vocab_size=512, max_seqs=slots, dtype=torch.float32, device="cpu")

    def fresh(ids, k):
        d = drafter(1)
        return d.propose([_Seq("x", list(ids))], [k])[0], d

    def slot_kv(d, rid, n):
        base = d._slots[rid].index * d.blocks_per_slot * BLOCK
        return d.caches[0].k.view(-1, *d.caches[0].k.shape[2:])[base : base + n]

    d = drafter(2)
    rng = random.Random(0)
    a = _Seq("a", [rng.randrange(3, 500) for _ in range(37)])
    b = _Seq("b", [rng.randrange(3, 500) for _ in range(5)])
    for step in range(8):
        da, db = d.propose([a, b], [4, 2 + step % 3])
        assert len(da) == 4 and len(db) == 2 + step % 3
        assert da == fresh(a.all_token_ids, 4)[0] and db == fresh(b.all_token_ids, 2 + step % 3)[0]
        # a accepts part of its draft (all of it every third step), then a token of its own; b rejects it all.
        cut = 4 if step % 3 == 0 else step % 3
        a.all_token_ids = a.all_token_ids + list(da[:cut]) + [(da[cut - 1] + 7) % 500 if cut < 4 else 11]
        b.all_token_ids = b.all_token_ids + [(db[0] + 1) % 500]
        if step == 4:  # steps without drafting (k = 0, or its draft did not fit the step): several plain tokens,
            # the first unlike its stale draft, over positions the slot had filled with draft tokens
            a.all_token_ids = a.all_token_ids + [(da[0] + 1) % 500, da[1], 5]
    n = len(a.all_token_ids) - 1  # the last token is fed at the next proposal
    ref = fresh(a.all_token_ids, 1)[1]
    d.propose([a], [1])
    assert torch.allclose(slot_kv(d, "a", n), slot_kv(ref, "x", n), atol=1e-5)
    # A third sequence takes the least recently used slot (b's); b is prefilled again when it next drafts.
    c = _Seq("c", [rng.randrange(3, 500) for _ in range(9)])
    assert d.propose([c], [3]) == [fresh(c.all_token_ids, 3)[0]] and "b" not in d._slots
    assert d.propose([b], [3]) == [fresh(b.all_token_ids, 3)[0]]
    d.forget("c"), d.forget("b"), d.forget("a")
    assert not d._slots and sorted(d._free) == [0, 1]


def test_greedy_identical_with_the_draft_model_on_adapter_rows(tiny_model, tiny_draft, tmp_path):
    """The real draft-model drafter, adapter rows verified under their adapter beside base rows, outputs
    identical. (Its scheduler paths -- batch, chunked prefill, recompute, swap, prefix hits -- are in the
    oracle suite with the kit's draft model, test_oracle.py.)"""
    from services.modelkit import make_random_adapter

    refs = [AdapterRef(content_id(p), f"a{i}", str(p)) for i, p in enumerate(
        make_random_adapter(tiny_model, tmp_path / f"a{i}", rank=4, target_modules=["q_proj", "down_proj"], seed=i)
        for i in range(3))]
    reqs = [{"id": f"d{i}", "prompt": p, "params": greedy(40), "adapter": refs[i % 4] if i % 4 < 3 else None}
            for i, p in enumerate(prompts(12, seed=10))]
    compare_draft_model(make_config(tiny_model, max_loras=4), tiny_draft, reqs)


def test_draft_model_seeded_sampling_identical(tiny_model, tiny_draft):
    """Seeded sampling with top-k / top-p / min_tokens: greedy drafts are point masses, so the verification
    keeps every emitted token the plain run's."""
    reqs = [{"id": f"s{i}", "prompt": p, "params": SamplingParams(
        max_tokens=24, temperature=[0.5, 1.0][i % 2], seed=7 + i, top_k=[0, 10][i % 2], top_p=[1.0, 0.9][i // 2 % 2],
        min_tokens=i % 5, ignore_eos=True)} for i, p in enumerate(prompts(10, seed=11))]
    compare_draft_model(make_config(tiny_model), tiny_draft, reqs)


def test_auto_gives_each_sequence_its_drafter_and_aborts_free_the_draft_slot(tiny_model, tiny_draft, tmp_path):
    """--speculative auto: base rows draft with the draft model, adapter rows with prompt lookup (one batched
    call per drafter), outputs identical; an aborted request's draft slot is given back."""
    from services.modelkit import make_random_adapter

    path = make_random_adapter(tiny_model, tmp_path / "ad", rank=4, target_modules=["q_proj"], seed=3)
    ref = AdapterRef(content_id(path), "ad", str(path))
    span = [21, 34, 55, 89, 144, 233, 377, 61]
    reqs = [{"id": f"m{i}", "prompt": (span * 3 + [40 + i]) if i % 2 else prompts(6, seed=12)[i], "params": greedy(30),
             "adapter": ref if i % 2 else None} for i in range(6)]
    config = make_config(tiny_model)
    plain = run(LLMEngine(config), reqs)
    engine = LLMEngine(spec_config(config, method="auto", draft_model=tiny_draft))
    engine.add_request("gone", prompts(1, seed=13)[0], greedy(30))
    for _ in range(3):
        engine.step()
    assert "gone" in engine.spec.drafters["draft_model"]._slots
    engine.abort_request("gone")
    assert "gone" not in engine.spec.drafters["draft_model"]._slots
    # Who drafts is the question here, not whether a catch-up pays (that pricing reads the wall time of the
    # draft model's forwards, so it would decide by the machine's speed: the two tests below pin it).
    engine.spec.drafters["draft_model"].catchup_cost = lambda seq: 0.0
    used = {name: set() for name in engine.spec.drafters}
    for name, d in engine.spec.drafters.items():  # the real drafters, looked at: who drafted for whom
        def recording(seqs, ks, name=name, propose=d.propose):
            used[name].update(s.request_id for s in seqs)
            return propose(seqs, ks)
        d.propose = recording
    spec = run(engine, reqs)
    assert {k: v["tokens"] for k, v in spec.items()} == {k: v["tokens"] for k, v in plain.items()}
    assert used == {"draft_model": {r["id"] for r in reqs if not r["adapter"]}, "ngram": {r["id"] for r in reqs if r["adapter"]}}
    assert all(v["last"].num_draft_tokens > 0 for v in spec.values())


class _CatchingUpDrafter(ScriptedDrafter):
    """A scripted drafter that, like a draft model, must first feed a sequence the tokens it has not seen:
    `catchup_cost` seconds per sequence it has never drafted for."""

    def __init__(self, *a, cost: float, **kw):
        super().__init__(*a, **kw)
        self.cost, self.seen = cost, set()

    def catchup_cost(self, seq):
        return 0.0 if seq.request_id in self.seen else self.cost

    def propose(self, seqs, ks):
        self.seen |= {s.request_id for s in seqs}
        return super().propose(seqs, ks)


def test_a_sequence_starts_a_costly_drafter_only_if_its_expected_remaining_output_pays_for_the_catch_up(tiny_model):
    """A drafter that must catch a sequence up first (a draft model feeding it the whole context) is started
    on a sequence only when the expected gain over the steps it is expected to go on for -- its model's mean
    output length so far, less what it has produced -- covers that cost. Sequences near their expected end
    (saturation's tail) are left to decode plainly; fresh ones of a model with long outputs draft; once a
    sequence is caught up there is nothing to pay and it drafts on its acceptance alone."""
    engine = LLMEngine(spec_config(make_config(tiny_model), adaptive_to_load=True))
    ctl: SpecController = engine.spec
    ctl.cost = StepCostModel(fixed=2e-3, per_token=1e-4, prior_weight=1e12)  # pinned: no timing in this test
    refs = {f"s{i}": list(range(100, 200)) for i in range(8)}
    seqs = [engine.add_request(f"s{i}", [5, 6, 7, 40 + i], greedy(64)) for i in range(8)]
    engine.step()
    # A step with 8 sequences: an emitted token is worth 2e-3 / 8 + 1e-4 = 0.35 ms; four drafts at the prior
    # acceptance (0.8) are expected to emit 2.36 tokens (0.83 ms) for 4 verification rows (0.4 ms): a gain of
    # 0.43 ms a step. A catch-up of 3 ms pays over 9 steps, not over 3.
    ctl.drafter = _CatchingUpDrafter(refs, 512, wrong_every=10**9, cost=3e-3)
    assert seqs[0].num_output_tokens == 1

    def produced(n):  # what the controller reads of a sequence of this model that has produced n tokens
        return SimpleNamespace(adapter=None, num_output_tokens=n, params=seqs[0].params)

    for n in (10.0, 4.0):  # the model's finished sequences averaged n output tokens
        ctl._lengths.clear()
        for _ in range(3):
            ctl.finished(produced(int(n)))
        assert ctl._remaining(seqs[0]) == pytest.approx(n - 1)
        ctl.drafter.seen.clear()
        ctl.propose(seqs, 0, 2048, 256)
        drafted = [len(s.spec_draft) for s in seqs]
        assert drafted == ([4] * 8 if n == 10.0 else [0] * 8), (n, drafted)
    # Caught up (the first case drafted for them all): nothing to pay, so the short horizon no longer matters.
    ctl.drafter.seen |= {s.request_id for s in seqs}
    ctl.propose(seqs, 0, 2048, 256)
    assert all(len(s.spec_draft) == 4 for s in seqs)
    # Draft tokens count only as far as a sequence is expected to live. Answers of 10 tokens: a sequence 9 in
    # (saturation's tail) gains nothing from 4 drafts -- its next token is its last -- while one 2 in does.
    ctl._lengths.clear()
    for _ in range(3):
        ctl.finished(produced(10))
    assert ctl._expected_gain(produced(9), 4, 0.8, 1e-4, 0.35e-3) < 0 < ctl._expected_gain(produced(2), 4, 0.8, 1e-4, 0.35e-3)
    # One that has outlived every recorded answer is expected to end next: its drafts count for nothing either
    # (saturation's longest answers were caught up for 4 drafts each, 1-2 accepted).
    assert ctl._remaining(produced(12)) == 1.0 and ctl._expected_gain(produced(12), 4, 0.8, 1e-4, 0.35e-3) < 0
    # Bimodal answers (three of 2 tokens, one of 40): the long one pays for the catch-up of all of them.
    ctl._lengths.clear()
    for n in (2, 2, 2, 40):
        ctl.finished(produced(n))
    ctl.drafter.seen.clear()
    ctl.propose(seqs, 0, 2048, 256)
    assert all(len(s.spec_draft) == 4 for s in seqs)
    # Before any sequence of the model finished, a sequence is expected to run as long again as it has.
    ctl._lengths.clear()
    assert ctl._remaining(seqs[0]) == 1.0 and ctl._remaining(produced(10)) == 10.0
    # Never past max_tokens.
    ctl.finished(produced(200))
    assert ctl._remaining(seqs[0]) == 63.0


def test_draft_model_measures_what_a_catch_up_costs(tiny_model, tiny_draft):
    from services.engine.spec.draft_model import DraftModelDrafter

    d = DraftModelDrafter(tiny_draft, vocab_size=512, max_seqs=2, dtype=torch.float32, device="cpu")
    a = _Seq("a", list(range(3, 43)))
    assert d.catchup_cost(a) == 0.0  # nothing measured yet
    d.propose([a], [2])  # 40 unseen tokens: a real catch-up, timed
    assert d.cost_per_catchup_token > 0
    assert d.catchup_cost(a) == 0.0 or d.catchup_cost(a) <= d.cost_per_catchup_token  # fed: at most the draft token
    b = _Seq("b", list(range(3, 23)))
    assert d.catchup_cost(b) == pytest.approx(19 * d.cost_per_catchup_token)  # all but the token every draft feeds
