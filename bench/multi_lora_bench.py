"""Multi-LoRA serving: 256 adapters of mixed ranks (more than fit in device slots), Zipf and uniform
popularity, mixed lengths, in one continuous batch — vs the same requests on the base model alone, and vs
PEFT mixed-adapter `generate` with static batches of 16 and 64 — for two rank mixes:

- proportional (ranks 1, 2, 4, 8): what a LoRA costs relative to its base scales with rank / hidden size.
  The demo model is 192 wide, so rank r here weighs what rank ~21r does on a 4096-wide 8B model: this mix
  stands for ranks ~21-171 there, the range real adapters use (Fireworks takes 4-64). The targets are
  checked on this mix.
- stress (ranks 4..64): ranks ~85-1365 at 8B scale, adapters up to a third of this base model's size. Its
  figures are reported next to the targets: on the CPU they are bound by reading those weights from DRAM.

Throughput runs are repeated, and every LoRA run is bracketed by base-only runs: its ratio is taken against
the mean of the base runs just before and just after it (runs minutes apart on this shared VM differ by up
to 30% in speed, neighbours taking memory bandwidth; a bracket cancels a drift that is linear over the
~20 s it spans). The median ratio over the repetitions is reported with its spread, and the median run's
tokens/s.
"""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path

import torch

from bench.common import Target, pct, table, write_results
from bench.engine_bench import SLO_TPOT, SLO_TTFT, Timing
from bench.workload import BenchRequest, mixed_workload, with_poisson_arrivals

N_ADAPTERS = int(os.environ.get("MPLEX_BENCH_ADAPTERS", "256"))
N_REQUESTS = int(os.environ.get("MPLEX_BENCH_LORA_REQUESTS", "384"))
PEFT_REQUESTS = int(os.environ.get("MPLEX_BENCH_PEFT_REQUESTS", "128"))  # PEFT is slow: a prefix of the same requests
RATE = float(os.environ.get("MPLEX_BENCH_LORA_RATE", "12"))
REPS = int(os.environ.get("MPLEX_BENCH_LORA_REPS", "5"))
# The CPU LoRA kernel: auto (native C when it builds, else torch), native or torch (lora.cpu_kernel).
CPU_KERNEL = os.environ.get("MPLEX_BENCH_LORA_KERNEL", "auto")
# Fewer device slots than the distinct adapters either popularity draws (zipf ~110, uniform ~190), and a
# host tier that cannot hold all 256 either: slots are swapped and adapters evicted during the run.
MAX_LORAS, MAX_CPU_LORAS = 96, 192
RANK_MIXES = {"proportional": (1, 2, 4, 8), "stress": (4, 8, 16, 32, 64)}
TARGET_MIX = "proportional"
RANKS = RANK_MIXES["stress"]
TARGET_SETS = (
    ("q_proj", "v_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("gate_proj", "up_proj", "down_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)


def build_adapters(kit, root: Path, n: int, ranks: tuple[int, ...] = RANKS):
    """n random adapters for the demo base (cached on disk across runs, one directory per rank mix)."""
    from services.common.lora_format import content_id
    from services.engine.sequence import AdapterRef
    from services.modelkit import make_random_adapter

    refs = []
    for i in range(n):
        path = root / "-".join(map(str, ranks)) / f"a{i:03d}"
        if not (path / "adapter_model.safetensors").exists():
            rank = ranks[i % len(ranks)]
            make_random_adapter(kit.base_dir, path, rank=rank, target_modules=list(TARGET_SETS[i % len(TARGET_SETS)]),
                                lora_alpha=2 * rank, seed=1000 + i)
        refs.append(AdapterRef(content_id(path), f"a{i:03d}", str(path)))
    return refs


def default_adapter_root() -> Path:
    """Where the random benchmark adapters are cached across runs."""
    return Path(os.environ.get("MPLEX_HOME", ".mplex")) / "bench" / "adapters"


def assign(n: int, adapters, popularity: str, seed: int = 3):
    rng = random.Random(seed)
    if popularity == "uniform":
        return [adapters[rng.randrange(len(adapters))] for _ in range(n)]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(adapters))]
    order = list(adapters)
    rng.shuffle(order)
    return rng.choices(order, weights=weights, k=n)


def _engine(kit):
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model_dir=kit.base_dir, served_model_name=kit.model_name,
        cache=CacheConfig(memory_bytes=1024 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=1024),
        lora=LoraConfig(max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS, max_lora_rank=64, cpu_kernel=CPU_KERNEL),
    ))


def _params(r: BenchRequest):
    from services.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)


def throughput(kit, reqs: list[BenchRequest], adapters: list) -> dict:
    engine = _engine(kit)
    engine.generate([reqs[0].prompt_ids], [_params(reqs[0])])  # warm-up
    for i, (r, a) in enumerate(zip(reqs, adapters)):
        engine.add_request(f"t{i}", r.prompt_ids, _params(r), adapter=a)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += len(out.new_token_ids)
        if engine.last_plan_empty:
            engine.wake.wait(0.01)
            engine.wake.clear()
    wall = time.perf_counter() - t0
    engine.check_integrity()
    a = engine.adapters
    if a is not None:
        a.shutdown()
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "steps": engine.stats.steps,
            "distinct_adapters": len({x.content_id for x in adapters if x}), "slot_loads": a.slot_loads if a else 0,
            "cpu_kernel": a.cpu_kernel if a else ""}


def poisson(kit, reqs: list[BenchRequest], adapters: list) -> list[Timing]:
    from services.engine.async_engine import AsyncEngine

    engine = _engine(kit)

    async def run():
        aeng = AsyncEngine(engine)
        aeng.start(asyncio.get_running_loop())
        start = time.perf_counter()

        async def one(i, r, a):
            await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
            arrived = time.perf_counter()
            first = last = None
            n = 0
            async for out in aeng.generate(f"p{i}", r.prompt_ids, _params(r), adapter=a):
                now = time.perf_counter()
                first = first or now
                last = now
                n += len(out.new_token_ids)
            return Timing(first - arrived, (last - first) / max(1, n - 1), last - arrived)

        try:
            return await asyncio.gather(*(one(i, r, a) for i, (r, a) in enumerate(zip(reqs, adapters))))
        finally:
            aeng.shutdown()

    return asyncio.run(run())


def peft_throughput(kit, reqs: list[BenchRequest], adapters: list, bs: int) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from bench.engine_bench import _Stamp

    base = AutoModelForCausalLM.from_pretrained(kit.base_dir, dtype=torch.float32)
    used = list(dict.fromkeys(a for a in adapters if a is not None))
    model = PeftModel.from_pretrained(base, used[0].path, adapter_name=used[0].name)
    for a in used[1:]:
        model.load_adapter(a.path, adapter_name=a.name)
    model.eval()
    pad = kit_pad_id(model)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), bs):
        batch, names = reqs[i:i + bs], [a.name if a else "__base__" for a in adapters[i:i + bs]]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[j, width - len(r.prompt_ids):] = 1
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad, adapter_names=names, logits_processor=LogitsProcessorList([_Stamp()]))
    wall = time.perf_counter() - t0
    tokens = sum(r.max_tokens for r in reqs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "requests": len(reqs)}


def kit_pad_id(model) -> int:
    gen = model.generation_config
    eos = gen.eos_token_id
    return gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)


def main() -> None:
    from services.modelkit import ensure_demo

    torch.set_num_threads(int(os.environ.get("MPLEX_BENCH_THREADS", "2")))
    kit = ensure_demo()
    root = default_adapter_root()
    reqs = mixed_workload(kit, N_REQUESTS, seed=11)
    runs: dict[str, list] = {"base_only": [None] * len(reqs)}
    for mix, ranks in RANK_MIXES.items():
        refs = build_adapters(kit, root, N_ADAPTERS, ranks)
        for popularity in ("zipf", "uniform"):
            runs[f"{mix}_{popularity}"] = assign(len(reqs), refs, popularity)
    print(f"workload: {len(reqs)} requests over {N_ADAPTERS} adapters per rank mix {RANK_MIXES}; device slots "
          f"{MAX_LORAS}, host tier {MAX_CPU_LORAS}; CPU LoRA kernel {CPU_KERNEL}; distinct adapters used: "
          + ", ".join(f"{k}={len(set(v))}" for k, v in runs.items() if k != "base_only"), flush=True)

    samples: dict[str, list[dict]] = {name: [] for name in runs}
    ratios: dict[str, list[float]] = {name: [] for name in runs if name != "base_only"}

    def measure(rep: int, name: str) -> dict:
        out = throughput(kit, reqs, runs[name])
        samples[name].append(out)
        print(f"  [{rep + 1}/{REPS}] {name}: {out['output_tok_s']:.1f} tok/s", flush=True)
        return out

    for rep in range(REPS):
        before = measure(rep, "base_only")
        for name in ratios:
            run = measure(rep, name)
            after = measure(rep, "base_only")
            ratios[name].append(run["output_tok_s"] / ((before["output_tok_s"] + after["output_tok_s"]) / 2))
            before = after
    thr = {}
    for name, runs_of in samples.items():
        med = statistics.median_low(r["output_tok_s"] for r in runs_of)
        thr[name] = {**next(r for r in runs_of if r["output_tok_s"] == med), "runs_tok_s": [r["output_tok_s"] for r in runs_of]}
    sub = reqs[:PEFT_REQUESTS]
    for mix in RANK_MIXES:
        for bs in (16, 64):
            thr[f"peft_{mix}_bs{bs}"] = peft_throughput(kit, sub, runs[f"{mix}_zipf"][:PEFT_REQUESTS], bs)
            print(f"  peft {mix} bs={bs}: {thr[f'peft_{mix}_bs{bs}']['output_tok_s']:.1f} tok/s", flush=True)
    base = thr["base_only"]["output_tok_s"]

    def vs_base(name: str) -> float:
        """Median over repetitions of this run's tokens/s over the mean of the base-only runs around it."""
        return statistics.median(ratios[name]) if name in ratios else 1.0

    def spread(name: str) -> str:
        return f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f}" if name in ratios else ""

    print(table(f"throughput, all requests at once (median of {REPS} repetitions; vs base: median of the ratios "
                "to the base runs bracketing each run)",
                ["run", "wall s", "output tok/s", "vs base", "vs base min-max"],
                [[k, v["wall_s"], v["output_tok_s"], vs_base(k) if k in samples else v["output_tok_s"] / base, spread(k)]
                 for k, v in thr.items()]))

    timed = with_poisson_arrivals(reqs, RATE, seed=5)
    rows, poisson_figs = [], {}
    for name in ("base_only", f"{TARGET_MIX}_zipf", "stress_zipf"):
        t = poisson(kit, timed, runs[name])
        wall = max(x.e2e + r.arrival for x, r in zip(t, timed))
        good = sum(x.meets_slo for x in t)
        row = [name, pct([x.ttft for x in t], 50), pct([x.ttft for x in t], 99), 1000 * pct([x.tpot for x in t], 50),
               1000 * pct([x.tpot for x in t], 99), good / wall, good / len(t)]
        rows.append(row)
        poisson_figs[name] = dict(zip(["ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "goodput_req_s", "slo_fraction"], row[1:]))
    print(table(f"Poisson arrivals at {RATE:g} req/s (SLO: TTFT <= {SLO_TTFT}s, TPOT <= {SLO_TPOT * 1000:.0f}ms)",
                ["run", "TTFT p50", "TTFT p99", "TPOT p50 ms", "TPOT p99 ms", "goodput req/s", "SLO met"], rows))

    def best_peft(mix: str) -> float:
        return max(thr[f"peft_{mix}_bs16"]["output_tok_s"], thr[f"peft_{mix}_bs64"]["output_tok_s"])

    m = TARGET_MIX
    targets = [
        Target(f"LoRA zipf / base-only throughput ({m} ranks)", vs_base(f"{m}_zipf"), 0.85),
        Target(f"LoRA uniform / base-only throughput ({m} ranks)", vs_base(f"{m}_uniform"), 0.85),
        Target(f"engine LoRA zipf / best PEFT static batch ({m} ranks)", thr[f"{m}_zipf"]["output_tok_s"] / best_peft(m), 10.0),
    ]
    stress = {
        "zipf_vs_base": vs_base("stress_zipf"),
        "uniform_vs_base": vs_base("stress_uniform"),
        "zipf_vs_best_peft": thr["stress_zipf"]["output_tok_s"] / best_peft("stress"),
    }
    print(table("stress ranks 4..64 (reported, not the targets' mix)", ["figure", "value"], [[k, v] for k, v in stress.items()]))
    write_results("multi_lora", {"workload": {"requests": len(reqs), "adapters_per_mix": N_ADAPTERS, "rank_mixes": RANK_MIXES,
                                              "target_mix": TARGET_MIX, "max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS,
                                              "distinct_adapters": {k: len(set(v)) for k, v in runs.items() if k != "base_only"},
                                              "peft_requests": PEFT_REQUESTS, "rate_req_s": RATE, "repetitions": REPS,
                                              "cpu_kernel": thr[f"{TARGET_MIX}_zipf"]["cpu_kernel"]},
                                 "throughput": thr, "ratios_vs_base": ratios, "poisson": poisson_figs, "stress_ranks": stress}, targets)
