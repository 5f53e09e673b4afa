"""Structured outputs on the demo kit: what constrained decoding costs a decode step, and grammar compile time.

1. TPOT and throughput of a 64-row decode batch with 0%, 50% and 100% of its rows constrained (a JSON schema
   every row's output must follow), greedy and sampled, fp32 on the CPU. All rows decode together for the
   whole measured window (free rows ignore eos, constrained rows follow a schema longer than the window), so
   the only difference between the runs is the grammar work: the mask fill on the grammar thread while the
   forward runs, and the mask in the sampler. Each round builds one engine per fraction and steps them in
   turn, one decode step each, the order rotating (the VM is shared: a neighbour's burst then slows every
   fraction's steps alike); a fraction's TPOT is its median step over all rounds, its overhead
   TPOT(constrained) / TPOT(free) - 1. A second table times the grammar work of one step on its own, best of
   200, for an estimate free of that noise.
2. Grammar compile time for the test schemas (tests/structured_models.py and the forced tool-call guide):
   cold (a schema never seen: each variant carries a distinct title, so a distinct content hash) and cached
   (the same guide again), p50 / p99.
3. The two grammar engines on this sampler's workload: filling a 64-row mask for each token of a schema-valid
   answer, xgrammar (batched fill) vs llguidance (serial and parallel fill), when llguidance is installed.
4. `tool_choice: "auto"` on the demo kit's tool eval (evals/tools.jsonl: 40 held-out questions with the kit's
   weather and time tools offered; half are theirs, half not -- other tasks, and prices, a tool not offered); a
   choice is right when the model calls the right tool exactly when it should.
"""
from __future__ import annotations

import json
import os
import time

from bench.common import Target, pct, table, write_results

ROWS = 64
WINDOW = int(os.environ.get("MPLEX_BENCH_STRUCT_STEPS", "48"))  # decode steps measured per run
REPEATS = int(os.environ.get("MPLEX_BENCH_STRUCT_REPEATS", "3"))
COMPILES = int(os.environ.get("MPLEX_BENCH_STRUCT_COMPILES", "60"))
# 40 digits in an array: a constrained answer is longer than the window, so no row finishes inside it.
LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40,
               "maxItems": 40}


def _engine(kit):
    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=kit.base_dir, served_model_name=kit.model_name,
                                  cache=CacheConfig(memory_bytes=256 * 2**20),
                                  scheduler=SchedulerConfig(max_num_seqs=ROWS, max_num_batched_tokens=4096)))


FRACTIONS = (0.0, 0.5, 1.0)


def _prefilled(kit, prompts, fraction: float, temperature: float):
    """A fresh engine with its 64 rows admitted and prefilled (`fraction` of them constrained), ready to decode."""
    from services.common.structured import GUIDE_JSON_SCHEMA, Guide
    from services.engine.sequence import SamplingParams

    engine = _engine(kit)
    guide = Guide(GUIDE_JSON_SCHEMA, schema=LONG_SCHEMA).text
    engine.grammars.get(Guide.parse(guide))  # compiled before the clock starts (compile time is part 2)
    n_guided = int(round(ROWS * fraction))
    for i, p in enumerate(prompts[:ROWS]):
        kw = {"guide": guide} if i < n_guided else {"ignore_eos": True}
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=WINDOW + 8, temperature=temperature, seed=i, **kw))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()  # prefill, not measured
    return engine


def _interleaved(kit, prompts, temperature: float) -> dict[float, dict]:
    """One decode step of each fraction's engine in turn (the order rotating every step), for the whole window:
    a neighbour's burst on this shared VM then slows the steps of every fraction alike, instead of whichever
    run it lands in (whole runs one after another gave overheads from -28% to +40% on the same tree)."""
    engines = {f: _prefilled(kit, prompts, f, temperature) for f in FRACTIONS}
    times: dict[float, list[float]] = {f: [] for f in FRACTIONS}
    c0 = {f: 0.0 for f in FRACTIONS}
    for step in range(WINDOW):
        order = FRACTIONS[step % 3:] + FRACTIONS[:step % 3]
        for f in order:
            c = time.process_time()
            t0 = time.perf_counter()
            outs = engines[f].step()
            times[f].append(time.perf_counter() - t0)
            c0[f] += time.process_time() - c  # every thread of the process, the grammar thread's work included
            assert len(outs) == ROWS and not any(o.finished for o in outs), "a row finished inside the window"
    for engine in engines.values():
        for rid in list(engine._seqs):
            engine.abort_request(rid)
    return {f: {"times_s": times[f], "cpu_per_step_s": c0[f] / WINDOW} for f in FRACTIONS}


def _tpot(kit) -> tuple[list[list], dict, float]:
    from services.common.prompting import PromptBuilder

    builder = PromptBuilder(kit.base_dir)
    prompts = [builder.chat_ids([{"role": "user", "content": f"List digits, please ({i})."}]) for i in range(ROWS)]
    rows, figs, overhead_100 = [], {}, float("nan")
    for temperature in (0.0, 1.0):
        mode = "greedy" if temperature == 0 else "sampled"
        steps: dict[float, list[float]] = {f: [] for f in FRACTIONS}
        cpu: dict[float, list[float]] = {f: [] for f in FRACTIONS}
        for _ in range(REPEATS):  # fresh engines each round
            for f, r in _interleaved(kit, prompts, temperature).items():
                steps[f] += r["times_s"]
                cpu[f].append(r["cpu_per_step_s"])
        # TPOT: the median decode step over every round, all fractions timed step by step in turn.
        free = pct(steps[0.0], 50)
        for f in FRACTIONS:
            tpot = pct(steps[f], 50)
            over = 100 * (tpot / free - 1)
            fig = {"tpot_ms": 1e3 * tpot, "tpot_p90_ms": 1e3 * pct(steps[f], 90),
                   "cpu_ms_per_step": 1e3 * min(cpu[f]), "tok_s": ROWS / tpot, "steps": len(steps[f])}
            if f:
                fig["tpot_overhead_pct"] = over
            figs[f"{mode}_{int(f * 100)}pct"] = fig
            rows.append([mode, f"{int(f * 100)}%", fig["tpot_ms"], fig["cpu_ms_per_step"], fig["tok_s"],
                         over if f else float("nan")])
            if f == 1.0:
                overhead_100 = over if mode == "greedy" else max(overhead_100, over)
    return rows, figs, overhead_100


def _components(kit) -> tuple[list[list], dict]:
    """The grammar work of one 64-row step on its own, best of many (noise-free, unlike a whole step): the
    mask fill (overlapped with the forward in the engine), applying the mask in the sampler, and the
    matchers' acceptance of the sampled tokens."""
    import torch

    from services.common.structured import GUIDE_JSON_SCHEMA, Guide
    from services.engine.grammar import GrammarCache, MaskFiller
    from services.engine.sampler import apply_bitmask

    engine = _engine(kit)
    vocab = engine.model.config.vocab_size
    guide = Guide(GUIDE_JSON_SCHEMA, schema=LONG_SCHEMA).text
    cache = GrammarCache(engine.tokenizer, vocab, engine.eos_token_ids)
    matchers = [cache.matcher(guide) for _ in range(ROWS)]
    for m in matchers:
        m.raw.accept_string("[1, ")
    filler = MaskFiller(vocab, threaded=True)
    bitmask = filler.fill(matchers)
    filler.fill_seconds = 1.0  # as if fills were long: start() hands them to the worker thread
    logits = torch.randn(ROWS, vocab)
    rows_t = torch.arange(ROWS)
    digit = engine.tokenizer.encode("7")[0]

    def best(fn, n=200) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    def accept_and_back() -> None:
        for m in matchers:
            m.accept(digit)
        for m in matchers:
            m.raw.rollback(1)

    figs = {"fill_ms": best(lambda: filler.fill(matchers)),
            "thread_hand_off_and_fill_ms": best(lambda: filler.start(matchers).result()),
            "apply_mask_ms": best(lambda: apply_bitmask(logits, rows_t, bitmask)),
            "accept_and_rollback_ms": best(accept_and_back)}
    return [[k, v] for k, v in figs.items()], figs


def _guides() -> list:
    from openai.lib._pydantic import to_strict_json_schema

    from services.common.structured import GUIDE_JSON_SCHEMA, GUIDE_TOOL_CALLS, Guide, check_tool
    from tests.structured_models import MODELS, TOOLS

    guides = [Guide(GUIDE_JSON_SCHEMA, schema=to_strict_json_schema(m)) for m in MODELS]
    guides.append(Guide(GUIDE_TOOL_CALLS, tools=tuple(check_tool(t["function"], "t") for t in TOOLS)))
    return guides


def _with_title(guide, k: int):
    """The same grammar under a distinct content hash (a title is an annotation)."""
    import dataclasses

    if guide.schema is not None:
        return dataclasses.replace(guide, schema={**guide.schema, "title": f"v{k}"})
    tools = tuple(dataclasses.replace(t, parameters={**t.parameters, "title": f"v{k}"}) for t in guide.tools)
    return dataclasses.replace(guide, tools=tools)


def _compile(kit) -> tuple[list[list], dict]:
    from services.engine.grammar import GrammarCache

    engine = _engine(kit)
    cache = GrammarCache(engine.tokenizer, engine.model.config.vocab_size, engine.eos_token_ids, max_entries=4096)
    cold, cached = [], []
    guides = _guides()
    for k in range(COMPILES):
        g = _with_title(guides[k % len(guides)], k)
        t0 = time.perf_counter()
        cache.get(g)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.get(g)
        cached.append(time.perf_counter() - t0)
    figs = {"cold_ms": {"p50": 1e3 * pct(cold, 50), "p99": 1e3 * pct(cold, 99)},
            "cached_ms": {"p50": 1e3 * pct(cached, 50), "p99": 1e3 * pct(cached, 99)}, "compiles": COMPILES}
    rows = [["cold", figs["cold_ms"]["p50"], figs["cold_ms"]["p99"]],
            ["cached", figs["cached_ms"]["p50"], figs["cached_ms"]["p99"]]]
    return rows, figs


def _engines(kit) -> tuple[list[list], dict]:
    """Per-step mask fill for 64 rows over one schema-valid answer, both grammar engines."""
    from services.common.prompting import PromptBuilder
    from services.engine.grammar import GrammarCache, MaskFiller
    from services.engine.sequence import SamplingParams

    engine = _engine(kit)
    vocab = engine.model.config.vocab_size
    guide = _guides()[1]
    cache = GrammarCache(engine.tokenizer, vocab, engine.eos_token_ids)
    builder = PromptBuilder(kit.base_dir)
    # A valid answer, written as the grammar writes it (compact separators, schema property order).
    prompt = builder.chat_ids([{"role": "user", "content": "x"}])
    answer = engine.generate([prompt], SamplingParams(max_tokens=400, temperature=0, guide=guide.text))[0][:-1]
    filler = MaskFiller(vocab, threaded=False)
    matchers = [cache.matcher(guide.text) for _ in range(ROWS)]
    t0 = time.perf_counter()
    for tok in answer:
        filler.fill(matchers)
        for m in matchers:
            m.accept(tok)
    xgr_ms = 1e3 * (time.perf_counter() - t0) / len(answer)
    figs = {"tokens": len(answer), "xgrammar_fill_ms_per_step": xgr_ms}
    rows = [["xgrammar (batched fill)", xgr_ms]]
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lltorch
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        figs["llguidance"] = "not installed"
        return rows, figs
    tok = PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer.tokenizer)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(guide.schema), defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    bitmask = lltorch.allocate_token_bitmask(ROWS, vocab)
    executor = llguidance.LLExecutor()
    for label, par in (("llguidance (serial fill)", False), ("llguidance (parallel fill)", True)):
        ms = [llguidance.LLMatcher(lltok, grammar) for _ in range(ROWS)]
        t0 = time.perf_counter()
        for tok_id in answer:
            if par:
                lltorch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bitmask)
            else:
                for i, m in enumerate(ms):
                    lltorch.fill_next_token_bitmask(m, bitmask, i)
            for m in ms:
                m.consume_token(tok_id)
        per = 1e3 * (time.perf_counter() - t0) / len(answer)
        figs[label] = per
        rows.append([label, per])
    return rows, figs


def _auto(kit) -> tuple[list[list], dict]:
    """The kit's tool eval (evals/tools.jsonl, held out from the base model's training) through the serving
    path: the questions with the kit's tools offered, `tool_choice: "auto"`, greedy."""
    from services.common.openai_protocol import ChatCompletionRequest
    from services.common.openai_serving import plan_request
    from services.common.prompting import PromptBuilder
    from services.common.tool_calls import split_output
    from services.modelkit.build import TOOL_EVAL_TOKENS, tool_decisions
    from services.modelkit.corpus import DEMO_TOOLS
    from services.modelkit.evaluate import read_eval

    engine = _engine(kit)
    builder = PromptBuilder(kit.base_dir)
    items = read_eval(kit.tools_eval)
    prompts, params = [], []
    for item in items:
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": item.prompt}], tools=DEMO_TOOLS,
                                    temperature=0, max_tokens=TOOL_EVAL_TOKENS)
        job = plan_request("chat", req, builder, engine.max_model_len).jobs[0]
        assert job.prompt_ids == builder.chat_ids(item.messages()), "the eval's tools block is not the server's"
        prompts.append(job.prompt_ids)
        params.append(job.params)
    texts = [builder.tokenizer.decode(out) for out in engine.generate(prompts, params)]
    accuracy = tool_decisions(texts, items)  # the kit build's own rule
    called = sum(bool(split_output(t)[1]) for t in texts)
    figs = {"items": len(items), "should_call": sum(i.tool is not None for i in items), "called": called,
            "correct": round(accuracy * len(items)), "accuracy": accuracy,
            "hf_build_time": kit.manifest["base"]["tools"]["decision_accuracy"]}
    return [[len(items), figs["should_call"], called, figs["correct"], accuracy, figs["hf_build_time"]]], figs


def main() -> None:
    import torch

    from services.modelkit import ensure_demo

    torch.set_num_threads(int(os.environ.get("MPLEX_BENCH_THREADS", "2")))
    kit = ensure_demo()
    tpot_rows, tpot, overhead = _tpot(kit)
    print(table(f"decode step, {ROWS} rows, {WINDOW} steps x {REPEATS} rounds, fractions interleaved step by step",
                ["mode", "constrained", "TPOT ms", "CPU ms/step", "tok/s", "TPOT overhead %"], tpot_rows))
    comp_rows, comp_figs = _components(kit)
    print(table(f"grammar work of one {ROWS}-row step, best of 200", ["part", "ms"], comp_rows))
    compile_rows, compile_figs = _compile(kit)
    print(table(f"grammar compile, {COMPILES} test-schema guides", ["", "p50 ms", "p99 ms"], compile_rows))
    engine_rows, engine_figs = _engines(kit)
    print(table(f"mask fill per step, {ROWS} rows", ["grammar engine", "ms / step"], engine_rows))
    auto_rows, auto_figs = _auto(kit)
    print(table("tool_choice auto on the demo kit's tool eval", ["items", "should call", "called", "correct",
                                                                "accuracy", "HF at build"], auto_rows))
    write_results("structured", {"tpot": tpot, "step_components": comp_figs, "compile": compile_figs,
                                 "grammar_engines": engine_figs, "auto": auto_figs}, [
        Target("TPOT overhead, 100% of 64 rows constrained (%)", overhead, 10.0, higher_is_better=False),
        Target("cached compile p99 (ms)", compile_figs["cached_ms"]["p99"], 1.0, higher_is_better=False),
        Target("tool_choice auto: right decisions on the kit's tool eval", auto_figs["accuracy"], 0.9),
    ])
