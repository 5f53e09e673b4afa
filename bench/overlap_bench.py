"""Async scheduling (services/engine/overlap.py) against the synchronous step loop, in-process, on the serving
benchmark's model and base burst (bench/serving_bench.py): throughput of both, alternated in one run, and where a
step's time goes -- scheduling, input tensors, forward + sampling, post-processing -- so the CPU share that
overlap can hide is measured, not guessed.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict

import torch

from bench.common import Target, table, write_results
from bench.serving_bench import MAX_NEW, WORK, _prompts, build_model

N_REQUESTS = int(os.environ.get("MPLEX_BENCH_OVERLAP_REQUESTS", "256"))
REPEATS = int(os.environ.get("MPLEX_BENCH_OVERLAP_REPEATS", "5"))


def _engine(model, async_scheduling: bool):
    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model_dir=model, served_model_name="base", cache=CacheConfig(memory_bytes=1024 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, interactive_ttft_slo_s=None),
        async_scheduling=async_scheduling))


class _Breakdown:
    """Wall time per part of the synchronous step, by wrapping the engine's own methods (instance attributes:
    the classes are untouched)."""

    PARTS = {"schedule": ("scheduler", "schedule"), "inputs": ("runner", "begin"), "forward": ("runner", "run"),
             "postprocess": (None, "_postprocess"), "step": (None, "step")}

    def __init__(self, engine):
        self.seconds: dict[str, float] = defaultdict(float)
        for part, (owner, name) in self.PARTS.items():
            obj = engine if owner is None else getattr(engine, owner)
            setattr(obj, name, self._timed(part, getattr(obj, name)))

    def _timed(self, part, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[part] += time.perf_counter() - t0
        return timed


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    model = build_model()
    engines = {"sync": _engine(model, False), "async": _engine(model, True)}
    tok = engines["sync"].tokenizer
    prompts = [tok.encode(p) for p in _prompts(N_REQUESTS, 1)]
    from services.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outputs = {}
    for name, e in engines.items():
        outputs[name] = e.generate(prompts[:16], params)  # warm-up
    assert outputs["sync"] == outputs["async"], "async scheduling changed the tokens"
    breakdown = _Breakdown(engines["sync"])
    overlap = engines["async"].overlap
    overlap.times.cpu = overlap.times.wait = overlap.times.forward = 0.0
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(REPEATS):  # alternated: the VM's other load falls on both alike
        for name, e in engines.items():
            t0 = time.perf_counter()
            e.generate(prompts, params)
            rates[name].append(N_REQUESTS * MAX_NEW / (time.perf_counter() - t0))
    best = {name: max(r) for name, r in rates.items()}
    # The median of the paired ratios (each async run against the sync run just before it): the VM is shared,
    # and a load spike during one run must not decide the figure.
    ratio = statistics.median(a / s for a, s in zip(rates["async"], rates["sync"]))
    b = breakdown.seconds
    step = b["step"]
    cpu = step - b["forward"]
    t = overlap.times
    rows = [["sync", round(best["sync"]), *[f"{100 * b[k] / step:.1f}%" for k in ("schedule", "inputs", "forward",
                                                                                   "postprocess")],
             f"{100 * cpu / step:.1f}%"],
            ["async", round(best["async"]), "-", "-", f"{100 * t.forward / (t.cpu + t.wait):.1f}%", "-",
             f"{100 * t.cpu / (t.cpu + t.wait):.1f}%"]]
    print(table(f"async scheduling: {N_REQUESTS} base requests x {MAX_NEW} tokens, best of {REPEATS} alternated runs, "
                f"{torch.get_num_threads()} torch threads (async: its step thread's CPU time and the worker's forward, "
                "as shares of the loop's wall time)",
                ["loop", "tok/s", "schedule", "inputs", "forward+sample", "postprocess", "CPU side"], rows))
    print(f"async / sync throughput (median of paired runs): {ratio:.3f}  (all runs: sync {[round(x) for x in rates['sync']]}, "
          f"async {[round(x) for x in rates['async']]})")
    figures = {"requests": N_REQUESTS, "max_new_tokens": MAX_NEW, "repeats": REPEATS, "tok_s": rates,
               "sync_breakdown_s": dict(b), "async_times_s": {"cpu": t.cpu, "wait": t.wait, "forward": t.forward},
               "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    write_results("overlap", figures, [Target("async / sync throughput, base burst", ratio, 0.98)])


if __name__ == "__main__":
    main()
