"""Engine vs static-batching `transformers.generate` on the demo model, same requests, same run.

1. Throughput: every request submitted at once; output tokens/s (only the tokens each request asked for).
2. Poisson arrivals at a stated rate: TTFT and TPOT p50/p99 and goodput (requests/s meeting both SLOs).
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import torch

from bench.common import Target, pct, table, write_results
from bench.workload import BenchRequest, mixed_workload, with_poisson_arrivals

N_REQUESTS = int(os.environ.get("MPLEX_BENCH_REQUESTS", "240"))
# Requests/s for the Poisson runs: a light load every system keeps up with, and one near the engine's
# capacity (about twice what static batching can serve), where goodput tells them apart.
RATES = tuple(float(r) for r in os.environ.get("MPLEX_BENCH_RATES", "6,24").split(","))
SLO_TTFT = 2.0  # seconds
SLO_TPOT = 0.150  # seconds per output token
HF_BATCHES = (16, 64)


@dataclass
class Timing:
    ttft: float
    tpot: float
    e2e: float

    @property
    def meets_slo(self) -> bool:
        return self.ttft <= SLO_TTFT and self.tpot <= SLO_TPOT


def _engine(kit):
    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    cfg = EngineConfig(
        model_dir=kit.base_dir,
        served_model_name=kit.model_name,
        cache=CacheConfig(memory_bytes=1024 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=1024),
    )
    return LLMEngine(cfg)


def _params(r: BenchRequest):
    from services.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)


def engine_throughput(engine, reqs: list[BenchRequest]) -> dict:
    t0 = time.perf_counter()
    outs = engine.generate([r.prompt_ids for r in reqs], [_params(r) for r in reqs])
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    assert tokens == sum(r.max_tokens for r in reqs)
    engine.check_integrity()
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "steps": engine.stats.steps}


def engine_poisson(engine, reqs: list[BenchRequest]) -> list[Timing]:
    from services.engine.async_engine import AsyncEngine

    async def run() -> list[Timing]:
        aeng = AsyncEngine(engine)
        aeng.start(asyncio.get_running_loop())
        start = time.perf_counter()

        async def one(i: int, r: BenchRequest) -> Timing:
            await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
            arrived = time.perf_counter()
            first = last = None
            n = 0
            async for out in aeng.generate(f"p{i}", r.prompt_ids, _params(r)):
                now = time.perf_counter()
                first = first or now
                last = now
                n += len(out.new_token_ids)
            return Timing(first - arrived, (last - first) / max(1, n - 1), last - arrived)

        try:
            return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        finally:
            aeng.shutdown()

    return asyncio.run(run())


class _Stamp:
    """A logits processor that timestamps every generation step of `generate`."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _hf_batch(model, pad_id: int, batch: list[BenchRequest]) -> list[float]:
    from transformers import LogitsProcessorList

    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):  # left padding, as decoder-only batching requires
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    longest = max(r.max_tokens for r in batch)
    stamp = _Stamp()
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
            do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([stamp]),
        )
    return stamp.times


def hf_throughput(model, pad_id: int, reqs: list[BenchRequest], bs: int) -> dict:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), bs):
        _hf_batch(model, pad_id, reqs[i : i + bs])
    wall = time.perf_counter() - t0
    tokens = sum(r.max_tokens for r in reqs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}


def hf_poisson(model, pad_id: int, reqs: list[BenchRequest], bs: int) -> list[Timing]:
    """Static batching under arrivals: a batch takes up to `bs` arrived requests and runs to its longest."""
    start = time.perf_counter()
    timings: list[Timing] = []
    i = 0
    while i < len(reqs):
        now = time.perf_counter() - start
        if reqs[i].arrival > now:
            time.sleep(reqs[i].arrival - now)
            now = time.perf_counter() - start
        j = i
        while j < len(reqs) and j - i < bs and reqs[j].arrival <= now:
            j += 1
        batch = reqs[i:j]
        stamps = _hf_batch(model, pad_id, batch)
        for r in batch:
            arrived = start + r.arrival
            first, last = stamps[0], stamps[r.max_tokens - 1]
            timings.append(Timing(first - arrived, (last - first) / max(1, r.max_tokens - 1), last - arrived))
        i = j
    return timings


def _summary(name: str, timings: list[Timing], wall: float) -> list:
    good = sum(t.meets_slo for t in timings)
    return [
        name,
        pct([t.ttft for t in timings], 50), pct([t.ttft for t in timings], 99),
        1000 * pct([t.tpot for t in timings], 50), 1000 * pct([t.tpot for t in timings], 99),
        good / wall, good / len(timings),
    ]


def main() -> None:
    from transformers import AutoModelForCausalLM

    from services.modelkit import ensure_demo

    torch.set_num_threads(os.cpu_count() or 2)
    kit = ensure_demo()
    reqs = mixed_workload(kit, N_REQUESTS)
    out_tokens = [r.max_tokens for r in reqs]
    prompt_tokens = [len(r.prompt_ids) for r in reqs]
    print(
        f"workload: {len(reqs)} requests, prompt tokens p50/max {pct(prompt_tokens, 50):.0f}/{max(prompt_tokens)}, "
        f"output tokens p50/max {pct(out_tokens, 50):.0f}/{max(out_tokens)}, total output {sum(out_tokens)}",
        flush=True,
    )
    hf = AutoModelForCausalLM.from_pretrained(kit.base_dir, dtype=torch.float32).eval()
    gen = hf.generation_config
    eos = gen.eos_token_id
    pad_id = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    engine = _engine(kit)
    engine.generate([reqs[0].prompt_ids], [_params(reqs[0])])  # warm-up
    thr = {"engine": engine_throughput(engine, reqs)}
    print(f"engine: {thr['engine']['output_tok_s']:.1f} tok/s", flush=True)
    for bs in HF_BATCHES:
        thr[f"hf_static_bs{bs}"] = hf_throughput(hf, pad_id, reqs, bs)
        print(f"hf bs={bs}: {thr[f'hf_static_bs{bs}']['output_tok_s']:.1f} tok/s", flush=True)
    best_hf = max(thr[f"hf_static_bs{bs}"]["output_tok_s"] for bs in HF_BATCHES)
    ratio = thr["engine"]["output_tok_s"] / best_hf
    print(table("throughput (all requests at once)", ["system", "wall s", "output tok/s"],
                [[k, v["wall_s"], v["output_tok_s"]] for k, v in thr.items()]))

    poisson_figs: dict[str, dict] = {}
    for rate in RATES:
        timed = with_poisson_arrivals(reqs, rate)
        span = timed[-1].arrival
        poisson: dict[str, list[Timing]] = {"engine": engine_poisson(_engine(kit), timed)}
        for bs in HF_BATCHES:
            poisson[f"hf_static_bs{bs}"] = hf_poisson(hf, pad_id, timed, bs)
        rows = []
        for name, timings in poisson.items():
            wall = max(t.e2e + r.arrival for t, r in zip(timings, timed))
            rows.append(_summary(name, timings, max(wall, span)))
        print(table(
            f"Poisson arrivals at {rate:g} req/s (SLO: TTFT <= {SLO_TTFT}s, TPOT <= {SLO_TPOT * 1000:.0f}ms)",
            ["system", "TTFT p50", "TTFT p99", "TPOT p50 ms", "TPOT p99 ms", "goodput req/s", "SLO met"], rows,
        ), flush=True)
        poisson_figs[f"{rate:g}_req_s"] = {
            r[0]: dict(zip(["ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "goodput_req_s", "slo_fraction"], r[1:]))
            for r in rows
        }
    figures = {
        "workload": {"requests": len(reqs), "total_output_tokens": sum(out_tokens), "rates_req_s": list(RATES),
                     "slo": {"ttft_s": SLO_TTFT, "tpot_s": SLO_TPOT}},
        "throughput": thr,
        "engine_vs_best_hf_ratio": ratio,
        "poisson": poisson_figs,
    }
    write_results("engine", figures, [Target("engine output tok/s / best HF static batch", ratio, 2.0)])
