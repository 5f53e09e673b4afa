"""The KV cache as virtual memory: preemption by swap vs by recompute, and prompt forks for n > 1.

1. Copy vs recompute, per sequence length: swapping a sequence's blocks out and back in, against
   prefilling the same tokens (what a recompute costs), on this machine.
2. A preemption-heavy workload (long outputs, a KV pool a fraction of the working set, everything
   submitted at once) run three ways on the same requests: recompute only (no host tier), swap forced,
   and auto (the engine's cost model decides). Throughput, TTFT/TPOT of the preempted requests, swap
   bytes, the cost model's estimates and choices, tokens computed, and whether outputs are identical.
   Timings on a shared 2-core VM swing by 10x when another process takes a core (the OpenMP team then
   waits for its descheduled thread), so the three run interleaved, REPEATS times in alternating order,
   and the timing figures are medians.
3. n > 1: each prompt asked for N_CHOICES greedy choices with prompt sharing (forks, copy-on-write) on
   and off: prompt tokens computed, peak KV blocks, copies, wall time, identical outputs.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import torch

from bench.common import Target, pct, table, write_results
from bench.workload import BenchRequest, mixed_workload

N_REQUESTS = int(os.environ.get("MPLEX_BENCH_SWAP_REQUESTS", "48"))
POOL_FRACTION = float(os.environ.get("MPLEX_BENCH_SWAP_POOL", "0.3"))  # KV pool / the workload's peak need
BLOCK_SIZE = 16
N_CHOICES = 4
MICRO_LENGTHS = (64, 256, 480)
REPEATS = int(os.environ.get("MPLEX_BENCH_SWAP_REPEATS", "3"))
TIMED = ("wall_s", "output_tok_s", "swap_copy_seconds")
TIMED_PCT = ("ttft_all_s", "tpot_all_ms", "ttft_preempted_s", "tpot_preempted_ms")


def _engine(kit, *, num_blocks: int | None = None, swap: str = "auto", sharing: bool = True, prefix: bool = True,
            budget: int = 1024):
    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, memory_bytes=512 * 2**20,
                        enable_prefix_caching=prefix, enable_prompt_sharing=sharing,
                        swap_space_bytes=0 if swap == "off" else None,
                        preemption_mode="recompute" if swap == "off" else swap)
    return LLMEngine(EngineConfig(model_dir=kit.base_dir, served_model_name=kit.model_name, cache=cache,
                                  scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget)))


def _greedy(n: int):
    from services.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# -- 1. copy vs recompute ----------------------------------------------------------------------------

def copy_vs_recompute(kit) -> list[dict]:
    from services.engine.kv.copies import BlockCopy, CopyKind

    engine = _engine(kit, prefix=False, budget=1024)
    runner = engine.runner
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    rows = []
    for length in MICRO_LENGTHS:
        prefill = []
        for rep in range(4):
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            engine.add_request(f"m{length}-{rep}", prompt, _greedy(1))
            t0 = time.perf_counter()
            engine.step()  # the whole prompt in one step: what a recompute of `length` tokens costs
            prefill.append(time.perf_counter() - t0)
            engine.check_integrity()
        blocks = -(-length // BLOCK_SIZE)
        ids = list(range(blocks))
        swap = []
        for _ in range(10):
            out = runner.copy_blocks([BlockCopy(CopyKind.SWAP_OUT, i, i) for i in ids])
            back = runner.copy_blocks([BlockCopy(CopyKind.SWAP_IN, i, i) for i in ids])
            swap.append(out.swap_seconds + back.swap_seconds)
        p, s = min(prefill[1:]), min(swap)  # best of the warm repetitions
        rows.append({"tokens": length, "blocks": blocks, "bytes_each_way": blocks * runner.block_bytes,
                     "swap_out_and_in_us": s * 1e6, "prefill_us": p * 1e6, "recompute_over_swap": p / s})
    return rows


# -- 2. preemption-heavy workload ---------------------------------------------------------------------

@dataclass
class RunResult:
    name: str
    figures: dict
    outputs: dict[str, list[int]]


def preemption_workload(kit) -> tuple[list[BenchRequest], int]:
    """Mixed chat prompts with long outputs: every sequence grows until the pool is short, so running
    sequences preempt each other all the time."""
    rng = random.Random(11)
    base = mixed_workload(kit, N_REQUESTS, seed=5)
    reqs = []
    for r in base:
        room = 511 - len(r.prompt_ids)
        reqs.append(BenchRequest(r.prompt_ids, max(16, min(room, rng.randint(128, 256)))))
    need = sum(-(-(len(r.prompt_ids) + r.max_tokens) // BLOCK_SIZE) for r in reqs)
    biggest = max(-(-(len(r.prompt_ids) + r.max_tokens) // BLOCK_SIZE) for r in reqs)
    return reqs, max(biggest + 8, int(need * POOL_FRACTION))


def run_workload(kit, reqs: list[BenchRequest], num_blocks: int, swap: str) -> RunResult:
    engine = _engine(kit, num_blocks=num_blocks, swap=swap)
    engine.generate([reqs[0].prompt_ids], [_greedy(2)])  # warm-up (also seeds the prefill estimate)
    base_tokens, base_steps = engine.stats.tokens, engine.stats.steps
    seqs = {f"w{i}": engine.add_request(f"w{i}", r.prompt_ids, _greedy(r.max_tokens)) for i, r in enumerate(reqs)}
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outputs: dict[str, list[int]] = {rid: [] for rid in seqs}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            outputs[o.request_id] += o.new_token_ids
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
    wall = time.perf_counter() - start
    engine.check_integrity()
    m, pm = engine.metrics, engine.preemption
    ttft = {rid: first[rid] - start for rid in seqs}
    tpot = {rid: (last[rid] - first[rid]) / max(1, len(outputs[rid]) - 1) for rid in seqs}
    preempted = [rid for rid, s in seqs.items() if s.num_preemptions]
    out_tokens = sum(len(v) for v in outputs.values())
    useful = sum(len(r.prompt_ids) + r.max_tokens - 1 for r in reqs)  # tokens a run without preemption computes
    sched = engine.scheduler
    figures = {
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "steps": engine.stats.steps - base_steps,
        "forward_tokens": engine.stats.tokens - base_tokens,
        "forward_tokens_over_needed": (engine.stats.tokens - base_tokens) / useful,
        "preemptions": {k.value: v for k, v in sched.preemptions_by_kind.items()},
        "preempted_requests": len(preempted),
        "swap_out_blocks": m.swap_out_blocks._value.get(),
        "swap_in_blocks": m.swap_in_blocks._value.get(),
        "swap_out_mib": m.swap_out_bytes._value.get() / 2**20,
        "swap_in_mib": m.swap_in_bytes._value.get() / 2**20,
        "swap_copy_seconds": m.swap_seconds._value.get(),
        "swap_shared_blocks_left_on_device": engine.kv.num_swap_shared_blocks,
        "restores_cut_short": engine.kv.num_restore_misses,
        "cost_model": {
            "copy_gb_s": (pm.copy_bytes_per_second or 0) / 1e9,
            "prefill_us_per_token": (pm.prefill_seconds_per_token or 0) * 1e6,
            "choices": {k.value: v for k, v in pm.decisions.items()},
            "last_decision": None if pm.last is None else {
                "kind": pm.last.kind.value, "swap_us": (pm.last.swap_seconds or 0) * 1e6,
                "recompute_us": (pm.last.recompute_seconds or 0) * 1e6},
        },
        "ttft_all_s": {"p50": pct(list(ttft.values()), 50), "p99": pct(list(ttft.values()), 99)},
        "tpot_all_ms": {"p50": 1e3 * pct(list(tpot.values()), 50), "p99": 1e3 * pct(list(tpot.values()), 99)},
        "ttft_preempted_s": {"p50": pct([ttft[r] for r in preempted], 50), "p99": pct([ttft[r] for r in preempted], 99)},
        "tpot_preempted_ms": {"p50": 1e3 * pct([tpot[r] for r in preempted], 50),
                              "p99": 1e3 * pct([tpot[r] for r in preempted], 99)},
        "kv_blocks": num_blocks,
        "host_blocks": engine.kv.host.num_blocks if engine.kv.host else 0,
    }
    return RunResult(swap, figures, outputs)


def _median_run(results: list[RunResult]) -> RunResult:
    """The first repetition's counts (the same every time, but for auto's timing-driven choices), with
    each timing figure replaced by its median over the repetitions, and the repetitions' throughputs."""
    f = dict(results[0].figures)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    for key in TIMED:
        f[key] = med([r.figures[key] for r in results])
    for key in TIMED_PCT:
        f[key] = {q: med([r.figures[key][q] for r in results]) for q in ("p50", "p99")}
    f["output_tok_s_each"] = [r.figures["output_tok_s"] for r in results]
    f["choices_each"] = [r.figures["cost_model"]["choices"] for r in results]
    return RunResult(results[0].name, f, results[0].outputs)


# -- 3. n > 1 -------------------------------------------------------------------------------------------

def n_choices(kit) -> dict[str, dict]:
    reqs = [r for r in mixed_workload(kit, 200, seed=9) if len(r.prompt_ids) > 200][:12]
    results: dict[str, dict] = {}
    outputs = {}
    walls: dict[str, list[float]] = {"sharing": [], "no sharing": []}
    for i in range(REPEATS):
        for sharing in (False, True) if i % 2 == 0 else (True, False):
            name = "sharing" if sharing else "no sharing"
            engine = _engine(kit, sharing=sharing, prefix=False)
            engine.generate([reqs[0].prompt_ids[:20]], [_greedy(2)])  # warm-up
            base_tokens = engine.stats.tokens
            for j, r in enumerate(reqs):
                for k in range(N_CHOICES):
                    engine.add_request(f"n{j}-{k}", r.prompt_ids, _greedy(64))
            peak, out = 0, {}
            t0 = time.perf_counter()
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
                peak = max(peak, engine.kv.pool.num_used)
            walls[name].append(time.perf_counter() - t0)
            engine.check_integrity()
            outputs[name] = out
            results[name] = {
                "forward_tokens": engine.stats.tokens - base_tokens, "peak_kv_blocks": peak,
                "steps": engine.stats.steps, "forks": engine.scheduler.num_forks,
                "cow_copies": engine.metrics.cow_copies._value.get(), "prompt_tokens_shared": engine.scheduler.fork_tokens,
            }
    for name, w in walls.items():
        results[name]["wall_s"] = sorted(w)[len(w) // 2]
        results[name]["wall_s_each"] = w
        results[name]["output_tok_s"] = sum(map(len, outputs[name].values())) / results[name]["wall_s"]
    results["identical_outputs"] = outputs["sharing"] == outputs["no sharing"]
    results["requests"] = {"prompts": len(reqs), "choices": N_CHOICES,
                           "prompt_tokens_p50": pct([len(r.prompt_ids) for r in reqs], 50), "max_tokens": 64}
    return results


def main() -> None:
    from services.modelkit import ensure_demo

    torch.set_num_threads(os.cpu_count() or 2)
    kit = ensure_demo()

    micro = copy_vs_recompute(kit)
    print(table("copy vs recompute, one sequence (swap = out + back in)",
                ["tokens", "blocks", "bytes each way", "swap us", "prefill us", "recompute / swap"],
                [[r["tokens"], r["blocks"], r["bytes_each_way"], r["swap_out_and_in_us"], r["prefill_us"],
                  r["recompute_over_swap"]] for r in micro]), flush=True)

    reqs, num_blocks = preemption_workload(kit)
    print(f"workload: {len(reqs)} requests, output tokens {sum(r.max_tokens for r in reqs)}, "
          f"KV pool {num_blocks} blocks of {BLOCK_SIZE} ({POOL_FRACTION:.0%} of the peak need)", flush=True)
    names = ("off", "swap", "auto")
    repeats: dict[str, list[RunResult]] = {n: [] for n in names}
    for i in range(REPEATS):
        for swap in names if i % 2 == 0 else names[::-1]:
            r = run_workload(kit, reqs, num_blocks, swap)
            repeats[swap].append(r)
            print(f"  {swap}: {r.figures['output_tok_s']:.0f} tok/s, preemptions {r.figures['preemptions']}", flush=True)
    runs = {n: _median_run(rs) for n, rs in repeats.items()}
    rows = []
    for name, r in runs.items():
        f = r.figures
        rows.append([name, f["wall_s"], f["output_tok_s"], f["steps"], f["forward_tokens_over_needed"], f["preemptions"]["swap"],
                     f["preemptions"]["recompute"], f["preempted_requests"], f["ttft_preempted_s"]["p50"],
                     f["ttft_preempted_s"]["p99"], f["tpot_preempted_ms"]["p50"], f["tpot_preempted_ms"]["p99"],
                     f["swap_out_mib"], f["swap_in_mib"], f["swap_copy_seconds"]])
    print(table(f"preemption-heavy workload (same requests; 'off' = recompute only; timings: medians of {REPEATS})",
                ["run", "wall s", "out tok/s", "steps", "computed/needed", "swaps", "recomputes", "preempted reqs",
                 "TTFT p50 (pre.)", "TTFT p99 (pre.)", "TPOT p50 ms (pre.)", "TPOT p99 ms (pre.)",
                 "out MiB", "in MiB", "copy s"], rows))
    cm = runs["auto"].figures["cost_model"]
    print(f"auto cost model: copy {cm['copy_gb_s']:.2f} GB/s, prefill {cm['prefill_us_per_token']:.1f} us/token, "
          f"choices {cm['choices']}, last decision {cm['last_decision']}")
    identical = {name: sum(r.outputs[k] == runs["off"].outputs[k] for k in r.outputs) / len(r.outputs)
                 for name, r in runs.items()}

    forks = n_choices(kit)
    print(table(f"n = {N_CHOICES} greedy choices per prompt ({forks['requests']['prompts']} prompts, no prefix cache)",
                ["run", "wall s", "out tok/s", "steps", "forward tokens", "peak KV blocks", "forks", "CoW copies"],
                [[k, v["wall_s"], v["output_tok_s"], v["steps"], v["forward_tokens"], v["peak_kv_blocks"], v["forks"], v["cow_copies"]]
                 for k, v in forks.items() if isinstance(v, dict) and "wall_s" in v]))

    off, auto, on = runs["off"].figures, runs["auto"].figures, forks["sharing"]
    figures = {
        "copy_vs_recompute": micro,
        "workload": {"requests": len(reqs), "output_tokens": sum(r.max_tokens for r in reqs), "kv_blocks": num_blocks,
                     "block_size": BLOCK_SIZE, "pool_fraction_of_need": POOL_FRACTION},
        "runs": {name: r.figures for name, r in runs.items()},
        "identical_to_recompute": identical,
        "n_choices": forks,
    }
    write_results("kv_swap", figures, [
        Target("auto / recompute-only throughput", auto["output_tok_s"] / off["output_tok_s"], 1.0),
        Target("auto: preempted requests' TPOT p99 / recompute-only's",
               auto["tpot_preempted_ms"]["p99"] / off["tpot_preempted_ms"]["p99"], 1.0, higher_is_better=False),
        Target("auto: tokens computed / tokens needed", auto["forward_tokens_over_needed"], 1.05, higher_is_better=False),
        Target("outputs identical to recompute-only (auto)", identical["auto"], 1.0),
        Target(f"n={N_CHOICES}: peak KV blocks with sharing / without", on["peak_kv_blocks"] / forks["no sharing"]["peak_kv_blocks"],
               0.5, higher_is_better=False),
        Target(f"n={N_CHOICES}: outputs identical with and without sharing", float(forks["identical_outputs"]), 1.0),
    ])


if __name__ == "__main__":
    main()
