"""n > 1 choices and identical concurrent prompts share the prompt's KV copy-on-write (forks.py), on
the demo model: the same tokens as computing each choice alone (greedy == the HF oracle; seeded
sampling == sharing off), fewer blocks, and the same under adapters, preemption by swap and by
priority, and aborts. Every run checks integrity after every step (run_all)."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from services.common.lora_format import content_id
from services.common.prompting import PromptBuilder
from services.engine.preemption import PreemptKind
from services.engine.sequence import AdapterRef, Priority, SamplingParams
from tests.engine.conftest import make_engine, record_swaps, run_all
from tests.engine.oracle import TieLog, hf_greedy

MAX_NEW = 24
N = 4
QUESTIONS = ["What is the capital of France?", "Repeat: red blue green", "What is 2 plus 3?"]
DOC = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 2


@pytest.fixture(scope="module")
def prompts(demo_kit) -> list[list[int]]:
    builder = PromptBuilder(demo_kit.base_dir)
    return [builder.chat_ids([{"role": "system", "content": DOC}, {"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(demo_kit, prompts):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(demo_kit.base_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


def choices(prompts, params: SamplingParams, n=N, **extra) -> list[dict]:
    """What the server sends for n choices: one request per choice, `<rid>-<k>`, choice k seeded seed+k."""
    return [{"id": f"q{i}-{k}", "prompt": p, "params": params.with_seed_offset(k), **extra}
            for i, p in enumerate(prompts) for k in range(n)]


def run_counting_blocks(engine, requests) -> tuple[dict[str, list[int]], int]:
    """run_all, also returning the most device blocks in use after any step."""
    peak = 0
    orig = engine.step

    def step():
        nonlocal peak
        out = orig()
        peak = max(peak, engine.kv.pool.num_used)
        return out

    engine.step = step
    return run_all(engine, requests), peak


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


def test_greedy_choices_fork_one_prompt_match_the_oracle_and_hold_fewer_blocks(demo_kit, prompts, references):
    shared_engine = make_engine(demo_kit.base_dir, block_size=8, prefix_caching=False)
    shared, shared_peak = run_counting_blocks(shared_engine, choices(prompts, GREEDY))
    alone_engine = make_engine(demo_kit.base_dir, block_size=8, prefix_caching=False, prompt_sharing=False)
    alone, alone_peak = run_counting_blocks(alone_engine, choices(prompts, GREEDY))
    log = TieLog("forks")
    for i, ref in enumerate(references):
        for k in range(N):
            log.check(f"q{i}-{k}", shared[f"q{i}-{k}"], ref)
    log.write()
    assert shared == alone
    s = shared_engine.scheduler
    # Every choice but the first of each prompt forked it, sharing all of its prompt but the last token.
    assert s.num_forks == len(prompts) * (N - 1)
    assert s.fork_tokens == sum((N - 1) * (len(p) - 1) for p in prompts)
    assert alone_engine.scheduler.num_forks == 0
    # Each fork copied at most its one shared partial block (the first write into it).
    assert shared_engine.kv.num_cow_copies <= s.num_forks
    assert shared_engine.kv.num_cow_copies == sum((N - 1) * ((len(p) - 1) % 8 != 0) for p in prompts)
    # Without sharing all N choices hold every prompt block; with it the full prompt blocks are held
    # once per prompt: (N - 1) * (full blocks before the last token) fewer at the peak, all prompts in flight.
    saved = sum((N - 1) * ((len(p) - 1) // 8) for p in prompts)
    assert shared_peak <= alone_peak - saved, (shared_peak, alone_peak, saved)
    assert shared_engine.metrics.forks._value.get() == s.num_forks
    assert shared_engine.metrics.cow_copies._value.get() == shared_engine.kv.num_cow_copies
    # Prompt tokens actually computed: each prompt once plus one token per fork.
    assert shared_engine.stats.tokens < alone_engine.stats.tokens


def test_forks_report_their_sources_cached_tokens_not_the_shared_prompt(demo_kit, prompts):
    """cached_tokens is billed at the cached price: a fork's shared prompt was computed for the request
    (or its twin), so each choice reports what the prefix cache gave, as without sharing."""
    engine = make_engine(demo_kit.base_dir, block_size=8)
    run_all(engine, [{"id": "warm", "prompt": prompts[0][:40], "params": GREEDY}])
    seqs = [engine.add_request(f"c{k}", prompts[0], GREEDY.with_seed_offset(k)) for k in range(3)]
    run_all(engine, [])
    assert engine.scheduler.num_forks == 2
    assert [s.num_cached_tokens for s in seqs] == [40, 40, 40]  # the warm-up prompt: 5 full blocks of 8


def test_seeded_choices_sample_the_same_tokens_with_and_without_sharing(demo_kit, prompts):
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    shared_engine = make_engine(demo_kit.base_dir, block_size=8)
    shared = run_all(shared_engine, choices(prompts, seeded))
    alone = run_all(make_engine(demo_kit.base_dir, block_size=8, prompt_sharing=False), choices(prompts, seeded))
    assert shared == alone
    assert shared_engine.scheduler.num_forks == len(prompts) * (N - 1)
    assert len({tuple(shared[f"q0-{k}"]) for k in range(N)}) > 1  # the choices really differ


def test_forks_under_an_adapter_and_never_across_adapters_or_tenants(demo_kit, prompts):
    name, adapter = next(iter(demo_kit.adapters.items()))
    ref = AdapterRef(content_id(adapter.path), name, str(adapter.path))
    # ignore_eos: a choice forks from a *running* member, and an adapter may answer this off-task prompt with
    # an immediate EOS (the pinned kit's `reverse` does), finishing choice 0 before the others could fork it.
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    reqs = (choices(prompts[:1], greedy, n=3, adapter=ref)
            + [{"id": "base", "prompt": prompts[0], "params": greedy}]  # same tokens, no adapter
            + [{"id": "other-tenant", "prompt": prompts[0], "params": greedy, "adapter": ref, "salt": "t2"}])
    engine = make_engine(demo_kit.base_dir, block_size=8)
    shared = run_all(engine, reqs)
    alone = run_all(make_engine(demo_kit.base_dir, block_size=8, prompt_sharing=False), reqs)
    assert shared == alone
    assert engine.scheduler.num_forks == 2  # the adapter's choices 1 and 2 only
    assert shared["q0-0"] == shared["q0-1"] == shared["q0-2"]


def test_forks_and_swaps_together_under_a_tiny_pool(demo_kit, prompts, references):
    """Forked choices are preempted and swapped (their shared partial block too), come back and finish
    exactly as the oracle; nothing is left in either tier."""
    need = max(len(p) + MAX_NEW for p in prompts)
    engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 8, budget=16, preemption_mode="swap")
    swaps = record_swaps(engine)
    out = run_all(engine, choices(prompts, GREEDY))
    log = TieLog("forks-swap")
    for i, ref in enumerate(references):
        for k in range(N):
            log.check(f"q{i}-{k}", out[f"q{i}-{k}"], ref)
    log.write()
    assert engine.scheduler.num_forks > 0 and swaps
    assert engine.kv.pool.num_used == 0 and engine.kv.host.num_used == 0


def test_interactive_arrivals_swap_out_batch_sequences_and_everyone_matches_the_oracle(demo_kit, prompts, references):
    """Preemption by priority: batch-class choices are running when interactive requests arrive and KV
    is short; the batch sequences are swapped out, not recomputed, and finish identically."""
    need = max(len(p) + MAX_NEW for p in prompts)
    # The pool's slack is calibrated on the kit's answers (+20 swapped on stop 33's kit; on stop 39's, whose
    # answers end sooner, +18 still does, +20 not): +10 runs short with room for every swap-in.
    engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 10, budget=256, preemption_mode="swap")
    batch = choices(prompts, GREEDY, n=2, priority=Priority.BATCH)
    for r in batch:
        engine.add_request(r["id"], r["prompt"], r["params"], priority=Priority.BATCH)
    out: dict[str, list[int]] = defaultdict(list)
    for _ in range(6):  # the batch sequences prefill and decode a few tokens
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
    interactive = [{"id": f"i{i}", "prompt": p, "params": GREEDY} for i, p in enumerate(prompts)]
    rest = run_all(engine, interactive)
    for rid, toks in rest.items():
        out[rid] += toks
    log = TieLog("forks-priority")
    for i, ref in enumerate(references):
        log.check(f"i{i}", out[f"i{i}"], ref)
        for k in range(2):
            log.check(f"q{i}-{k}", out[f"q{i}-{k}"], ref)
    log.write()
    assert engine.scheduler.preemptions_by_kind[PreemptKind.SWAP] > 0
    assert engine.scheduler.preemptions_by_kind[PreemptKind.RECOMPUTE] == 0
    assert engine.kv.host.num_used == 0


def test_aborts_return_host_blocks_and_followers_outlive_their_leader(demo_kit, prompts):
    need = max(len(p) + MAX_NEW for p in prompts)
    engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 8, budget=16, preemption_mode="swap")
    reqs = choices(prompts, GREEDY)
    for r in reqs:
        engine.add_request(r["id"], r["prompt"], r["params"])
    aborted = set()
    for _ in range(400):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.check_integrity()
        swapped = sorted(engine.kv.swapped_request_ids - aborted)
        if swapped and len(aborted) < 3:  # abort swapped-out sequences: their host blocks come back at once
            used = engine.kv.host.num_used
            assert engine.abort_request(swapped[0])
            aborted.add(swapped[0])
            assert engine.kv.host.num_used < used
            engine.check_integrity()
    assert aborted and not engine.has_unfinished()
    assert engine.kv.host.num_used == 0 and engine.kv.pool.num_used == 0

    # A leader aborted while its followers wait for its prompt: one of them computes it instead.
    engine = make_engine(demo_kit.base_dir, block_size=4, budget=8)
    for r in choices(prompts[:1], GREEDY, n=3):
        engine.add_request(r["id"], r["prompt"], r["params"])
    engine.step()
    assert engine.get_sequence("q0-0").num_computed_tokens > 0 and engine.scheduler.num_forks == 0
    assert engine.abort_request("q0-0")
    out = run_all(engine, [])
    alone = run_all(make_engine(demo_kit.base_dir, prompt_sharing=False), [{"id": "x", "prompt": prompts[0], "params": GREEDY}])
    assert out["q0-1"] == out["q0-2"] == alone["x"]
    assert engine.scheduler.num_forks == 1
