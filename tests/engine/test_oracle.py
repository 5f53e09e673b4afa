"""Engine greedy output == Hugging Face transformers `generate` (fp32) on the trained demo model.

Checked with every request in one continuous batch, with a tiny chunked-prefill budget, with prefix
cache hits from a shared system prompt, with batch-class prompts held while interactive ones arrive
(class_yield.py), and under preemption from a deliberately tiny KV pool -- by
recompute and by swapping to the host tier and back (mid-prefill and mid-decode, with prefix hits).
"""
from __future__ import annotations

import json

import pytest
import torch

from services.common.prompting import PromptBuilder
from services.engine.engine import LLMEngine
from services.engine.class_yield import computes_interactive_prompt
from services.engine.sequence import Priority, SamplingParams
from tests.engine.conftest import make_config, make_engine, record_swaps, run_all, run_all_split, spec_tokens
from tests.engine.oracle import TIE_GAP, TieLog, hf_greedy, oracle_questions_and_prompts

MAX_NEW = 40
SYSTEM = "You are a careful assistant. Answer briefly and exactly. " * 4


@pytest.fixture(scope="module")
def prompts(demo_kit) -> list[list[int]]:
    _, out = oracle_questions_and_prompts(demo_kit)
    assert len(out) >= 20
    lengths = sorted(len(p) for p in out)
    assert lengths[-1] > 3 * lengths[0], "prompts must be of mixed lengths"
    return out


@pytest.fixture(scope="module")
def hf_model(demo_kit):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(demo_kit.base_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def references(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


def _requests(prompts, prefix="r"):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    return [{"id": f"{prefix}{i}", "prompt": p, "params": params} for i, p in enumerate(prompts)]


def _check(name, engine, prompts, references, prefix="r", counters=None):
    """`engine`: an LLMEngine (stepped here), or an EngineConfig to serve as `serve` does, in a core process."""
    requests = _requests(prompts, prefix)
    out = run_all(engine, requests) if isinstance(engine, LLMEngine) else run_all_split(engine, requests, counters)
    log = TieLog(name)
    for i, ref in enumerate(references):
        log.check(f"{prefix}{i}", out[f"{prefix}{i}"], ref)
    log.write()
    return out


@pytest.mark.parametrize("attention", ["auto", "torch"], ids=["native", "torch"])
def test_one_continuous_batch(demo_kit, prompts, references, attention):
    """Once with the default engine, whose decode attention is the native CPU kernel, and once with gather + SDPA."""
    engine = make_engine(demo_kit.base_dir, cpu_attention=attention)
    assert (engine.runner.attention_kernel is None) == (attention == "torch")
    _check("batch" if attention == "auto" else "batch-torch", engine, prompts, references)
    assert engine.stats.steps < sum(len(r.tokens) for r in references)  # really batched, not one by one


def test_tiny_chunked_prefill_budget(demo_kit, prompts, references):
    engine = make_engine(demo_kit.base_dir, block_size=4, budget=7)
    _check("chunked", engine, prompts, references)
    assert max(len(p) for p in prompts) > 7  # prompts really were split into chunks


def test_prefix_cache_hits_from_a_shared_system_prompt(demo_kit, hf_model):
    builder = PromptBuilder(demo_kit.base_dir)
    qs = ["What is the capital of France?", "Hello", "What is 2 plus 3?", "Repeat: red blue green"]
    prompts = [builder.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in qs]
    refs = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    engine = make_engine(demo_kit.base_dir, block_size=8)
    _check("prefix-warm", engine, prompts[:1], refs[:1], prefix="w")
    hits_before = engine.metrics.prefix_hit_tokens._value.get()
    _check("prefix", engine, prompts, refs)
    assert engine.metrics.prefix_hit_tokens._value.get() - hits_before >= 3 * 8  # every later prompt reused blocks


def test_preemption_from_a_tiny_kv_pool(demo_kit, prompts, references):
    need = max(len(p) + MAX_NEW for p in prompts)
    engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 12, budget=64,
                         preemption_mode="recompute")
    _check("preempt", engine, prompts, references)
    assert engine.scheduler.num_preemptions > 0
    assert engine.metrics.swap_out_blocks._value.get() == 0


def test_swap_to_the_host_tier_and_back_from_a_tiny_kv_pool(demo_kit, prompts, references):
    """Preempted sequences are copied out and back in, mid-prefill and mid-decode, and go on exactly
    where they were; the host tier is empty at the end (run_all checks integrity after every step)."""
    need = max(len(p) + MAX_NEW for p in prompts)
    engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 12, budget=32,
                         preemption_mode="swap")
    swaps = record_swaps(engine)
    _check("swap", engine, prompts, references)
    m = engine.metrics
    assert engine.scheduler.num_preemptions == len(swaps) > 0
    assert any(c < p for _, c, p in swaps) and any(c > p for _, c, p in swaps)  # mid-prefill and mid-decode
    assert m.swap_out_blocks._value.get() >= m.swap_in_blocks._value.get() > 0
    assert engine.kv.host.num_used == 0


def test_swap_with_prefix_hits_from_a_shared_system_prompt(demo_kit, hf_model):
    """Swapped-out sequences share cached system-prompt blocks: those stay on the device (released,
    found again on swap-in), only their own blocks move."""
    builder = PromptBuilder(demo_kit.base_dir)
    qs = ["What is the capital of France?", "Hello", "What is 2 plus 3?", "Repeat: red blue green",
          "Name a color.", "Count to five.", "Say yes.", "What is 10 minus 4?"]
    prompts = [builder.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in qs]
    refs = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    need = max(len(p) + MAX_NEW for p in prompts)
    engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 4, budget=48, preemption_mode="swap")
    _check("swap-prefix-warm", engine, prompts[:1], refs[:1], prefix="w")
    swaps = record_swaps(engine)
    _check("swap-prefix", engine, prompts, refs)
    assert swaps and engine.metrics.prefix_hit_tokens._value.get() >= 7 * 8
    assert engine.kv.num_swap_shared_blocks > 0  # shared cached blocks were left in place, not copied
    assert engine.kv.host.num_used == 0


# -- constrained decoding ---------------------------------------------------------------------------------
GUIDED_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 40}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["red", "blue", "green"]}, "maxItems": 3}},
    "required": ["answer", "count", "tags"], "additionalProperties": False}


def _allowed(matcher, vocab: int) -> torch.Tensor:
    """The oracle's own mask: xgrammar's bitmask for this state, unpacked here (not by the engine)."""
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bits)
    words = bits[0].tolist()
    return torch.tensor([(words[t // 32] >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)


@pytest.mark.parametrize("batch", [False, True], ids=["alone", "with-free-rows"])
def test_greedy_constrained_is_the_oracle_argmax_over_the_legal_tokens(demo_kit, hf_model, prompts, references, batch):
    """At every step the engine's constrained greedy token is HF fp32's argmax over the tokens the grammar
    allows, so the mask never changes a legal argmax: wherever the unconstrained argmax is legal it is the
    one chosen, and an unconstrained output that already satisfies the grammar comes out unchanged.
    With free rows in the same batch, those rows still match the unconstrained oracle."""
    import xgrammar as xgr

    from services.common.structured import GUIDE_JSON_SCHEMA, Guide

    guide = Guide(GUIDE_JSON_SCHEMA, schema=GUIDED_SCHEMA)
    engine = make_engine(demo_kit.base_dir)
    vocab = hf_model.config.vocab_size
    params = SamplingParams(max_tokens=80, temperature=0, guide=guide.text)
    guided = [{"id": f"g{i}", "prompt": p, "params": params} for i, p in enumerate(prompts[:6])]
    free = _requests(prompts[6:12], "f") if batch else []
    out = run_all(engine, guided + free)
    log = TieLog("guided-free")
    for i, r in enumerate(free):
        log.check(r["id"], out[r["id"]], references[6 + i])
    legal_free_argmax = 0
    for i, r in enumerate(guided):
        tokens = out[r["id"]]
        matcher = xgr.GrammarMatcher(engine.grammars.get(guide))
        with torch.inference_mode():
            logits = hf_model(torch.tensor([r["prompt"] + tokens])).logits[0, len(r["prompt"]) - 1:].float()
        for k, tok in enumerate(tokens):
            allowed = _allowed(matcher, vocab)
            masked = logits[k].masked_fill(~allowed, float("-inf"))
            top2 = masked.topk(2).values
            if int(masked.argmax()) != tok:
                assert float(top2[0] - top2[1]) < TIE_GAP, f"{r['id']} step {k}: {tok} is not the legal argmax"
                break  # a near tie: the two runs may part here
            if allowed[int(logits[k].argmax())]:
                legal_free_argmax += 1
                assert tok == int(logits[k].argmax())
            assert matcher.accept_token(tok)
    assert legal_free_argmax > 20, "no step where the unconstrained argmax was legal: the check said nothing"


# -- the same oracle on the split path: a core process and its front-end, as `mplex engine serve` runs --------
def test_split_path_one_continuous_batch(demo_kit, prompts, references):
    core = {}
    _check("split-batch", make_config(demo_kit.base_dir), prompts, references, counters=core)
    assert core["steps"] < sum(len(r.tokens) for r in references)  # batched in the core, not one by one


def test_split_path_swap_from_a_tiny_kv_pool(demo_kit, prompts, references):
    need = max(len(p) + MAX_NEW for p in prompts)
    core = {}
    _check("split-swap", make_config(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 12, budget=32,
                                     preemption_mode="swap"), prompts, references, counters=core)
    assert core["preemptions"] > 0 and core["swap_out_blocks"] > 0 and core["kv_used"] == 0


def test_split_path_recompute_from_a_tiny_kv_pool(demo_kit, prompts, references):
    need = max(len(p) + MAX_NEW for p in prompts)
    core = {}
    _check("split-preempt", make_config(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 12, budget=64,
                                        preemption_mode="recompute"), prompts, references, counters=core)
    assert core["preemptions"] > 0 and core["swap_out_blocks"] == 0


# -- speculative decoding (prompt lookup, the kit's draft model): drafts verified in the step, the same oracle --
@pytest.fixture(scope="module")
def spec_workload(demo_kit, hf_model, prompts, references):
    """The oracle's prompts, then three whose answers copy the question's words ('The capital of X is ...'),
    which prompt lookup drafts right. Last, so they decode when nothing waits for admission (speculation is
    off while requests wait): on the pinned kit the oracle's prompts alone left prompt lookup with no accepted
    draft on the chunked, preempt and swap paths; with these, 3-11 on every path."""
    builder = PromptBuilder(demo_kit.base_dir)
    rows = [json.loads(x)["prompt"] for x in demo_kit.base_eval.read_text().splitlines() if x.strip()]
    extra = [builder.chat_ids([{"role": "user", "content": q}]) for q in rows if "capital" in q][:3]
    assert len(extra) == 3
    return prompts + extra, references + [hf_greedy(hf_model, p, MAX_NEW) for p in extra]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("path", ["batch", "chunked", "preempt", "swap"])
def test_speculative_decoding_matches_the_oracle(demo_kit, spec_workload, path, drafter):
    prompts, references = spec_workload
    need = max(len(p) + MAX_NEW for p in prompts)
    kw = {"batch": {}, "chunked": dict(block_size=4, budget=7),
          "preempt": dict(block_size=4, num_blocks=need // 4 + 12, budget=64, preemption_mode="recompute"),
          "swap": dict(block_size=4, num_blocks=need // 4 + 12, budget=32, preemption_mode="swap")}[path]
    engine = make_engine(demo_kit.base_dir, speculative=drafter, draft_model=demo_kit.draft_dir, **kw)
    _check(f"spec-{drafter}-{path}", engine, prompts, references)
    assert spec_tokens(engine, "accepted") > 0  # drafts were verified and accepted, not just proposed
    if path in ("preempt", "swap"):
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_speculative_decoding_with_prefix_hits(demo_kit, hf_model, drafter):
    builder = PromptBuilder(demo_kit.base_dir)
    qs = ["Repeat: red blue green", "Hello", "Repeat: 1 2 3 4 5 6", "What is the capital of France?"]
    prompts = [builder.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in qs]
    refs = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    engine = make_engine(demo_kit.base_dir, block_size=8, speculative=drafter, draft_model=demo_kit.draft_dir)
    _check(f"spec-{drafter}-prefix-warm", engine, prompts[:1], refs[:1], prefix="w")
    hits_before = engine.metrics.prefix_hit_tokens._value.get()
    _check(f"spec-{drafter}-prefix", engine, prompts, refs)
    assert engine.metrics.prefix_hit_tokens._value.get() - hits_before >= 3 * 8
    # Drafts were verified beside the prefix-hit rows (prompt lookup's are mostly rejected after this system
    # prompt: the rejection path, with the oracle's tokens).
    assert spec_tokens(engine, "draft") > 0


def test_batch_prompts_held_for_interactive_first_tokens(demo_kit, prompts, references):
    """Batch-class requests run while interactive ones keep arriving: the steps that compute an interactive
    prompt hold every batch row, prompts and decodes (class_yield.py), which go on in later steps (prompts in
    chunks of at most the lower-class cap); every output is still HF's."""
    from collections import defaultdict

    import dataclasses

    config = make_config(demo_kit.base_dir, block_size=4, budget=24)
    # A cap below most prompts: batch prompts are also cut into capped chunks.
    engine = LLMEngine(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, lower_class_prefill_tokens=5)))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    half = len(prompts) // 2
    for i in range(half):
        engine.add_request(f"r{i}", prompts[i], params, priority=Priority.BATCH)
    arrivals = {1 + 2 * j: i for j, i in enumerate(range(half, len(prompts)))}
    sched, schedule, held = engine.scheduler, engine.scheduler.schedule, []

    def observed():  # the real scheduler's plan, looked at
        plan = schedule()
        prompt_work = [s.num_new_tokens for s in plan.scheduled
                       if s.seq.priority is Priority.BATCH and s.start < s.seq.num_prompt_tokens]
        # capped at 5, but a prompt's last token goes with the decodes (one token left looks like a decode)
        assert sum(prompt_work) <= 5 + prompt_work.count(1)
        if computes_interactive_prompt(plan):
            assert not any(s.seq.priority is Priority.BATCH for s in plan.scheduled)  # no batch row at all
            held.append(bool(sched.waiting[Priority.BATCH]) or any(s.priority is Priority.BATCH for s in sched.running))
        return plan

    sched.schedule = observed
    out: dict[str, list[int]] = defaultdict(list)
    step = 0
    while engine.has_unfinished() or step <= max(arrivals):
        if step in arrivals:
            i = arrivals[step]
            engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
        step += 1
    log = TieLog("class-yield")
    for i, ref in enumerate(references):
        log.check(f"r{i}", out[f"r{i}"], ref)
    log.write()
    assert any(held)  # batch prompts really were held back for interactive ones


def test_steps_bounded_in_time(demo_kit, prompts, references):
    """A wall-time target per step (step_time.py) cuts prompt work into what the fitted step cost leaves beside
    the decodes: decodes are never cut, prompt work per step stays within the cap, outputs are still HF's. The
    cost model is pinned (a prior no real step can outweigh), so which steps are cut does not depend on this
    machine's speed."""
    import dataclasses

    from services.engine.step_time import MIN_PROMPT_TOKENS, StepCostModel, StepTimeBound

    config = make_config(demo_kit.base_dir, block_size=4, budget=2048)
    engine = LLMEngine(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_step_s=0.1)))
    sched = engine.scheduler
    assert sched.step_bound is not None
    # 1 ms fixed + 1 ms a token: 0.1 s leaves 99 tokens, less the decodes (at least MIN_PROMPT_TOKENS).
    sched.step_bound = StepTimeBound(0.1, StepCostModel(fixed=1e-3, per_token=1e-3, prior_weight=1e12))
    schedule, cut = sched.schedule, []

    def observed():  # the real scheduler's plan, looked at
        waiting_decodes = {id(s) for s in sched.running if s.num_tokens - s.num_computed_tokens == 1}
        plan = schedule()
        decodes = [s for s in plan.scheduled if s.num_new_tokens == 1 and id(s.seq) in waiting_decodes]
        assert len(decodes) == len(waiting_decodes)  # every decode ran
        prompt = sum(s.num_new_tokens for s in plan.scheduled if id(s.seq) not in waiting_decodes)
        cap = max(MIN_PROMPT_TOKENS, 99 - len(decodes))
        assert prompt <= cap
        left = sched.num_waiting > 0 or any(s.num_computed_tokens + 1 < s.num_prompt_tokens for s in sched.running)
        cut.append(left and prompt > cap - 8)  # prompt work left over after a step filled to its cap
        return plan

    sched.schedule = observed
    _check("step-time-bound", engine, prompts, references)
    assert any(cut)  # the cap really held prompt work back


# -- the same oracle with async scheduling (overlap.py): step N+1 planned while step N's forward runs ---------
@pytest.mark.parametrize("variant", ["batch", "chunked", "recompute", "swap"])
def test_async_scheduling(demo_kit, prompts, references, variant):
    need = max(len(p) + MAX_NEW for p in prompts)
    kw = {"batch": {}, "chunked": {"block_size": 4, "budget": 7},
          "recompute": {"block_size": 4, "num_blocks": need // 4 + 12, "budget": 64, "preemption_mode": "recompute"},
          "swap": {"block_size": 4, "num_blocks": need // 4 + 12, "budget": 32, "preemption_mode": "swap"}}[variant]
    engine = make_engine(demo_kit.base_dir, async_scheduling=True, **kw)
    _check(f"async-{variant}", engine, prompts, references)
    assert engine.overlap.times.forward > 0
    if variant in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions > 0
    if variant == "swap":
        assert engine.metrics.swap_in_blocks._value.get() > 0 and engine.kv.host.num_used == 0


def test_split_path_async_scheduling_with_swaps(demo_kit, prompts, references):
    need = max(len(p) + MAX_NEW for p in prompts)
    core = {}
    _check("split-async-swap", make_config(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 12, budget=32,
                                           preemption_mode="swap", async_scheduling=True),
           prompts, references, counters=core)
    assert core["preemptions"] > 0 and core["kv_used"] == 0
