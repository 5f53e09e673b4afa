"""Tensor parallelism on this machine: TP=1 vs TP=2 on the demo kit over gloo, and what the collectives cost.

1. Memory: weight bytes per rank (fp32 and FP8 weights) against the unsharded model, and KV capacity per rank
   (blocks and tokens one rank's budget holds: its KV heads are 1/N of the model's, so the same budget per
   rank holds N times the tokens, for N times the heads in the group).
2. Throughput and TPOT: the engine benchmark's mixed workload (bench/workload.py) all at once, TP=1 (one torch
   thread) against TP=2 (one thread per rank), interleaved repetitions on fresh engines; output tok/s, output
   tokens per CPU second of all the engine's processes (steadier than wall time on a VM other sessions load),
   and per-request TPOT (time between its first and last token / tokens after the first). On 2 CPU cores no
   speed-up is expected: each rank does half the matmuls, but the step's fixed costs are paid by both ranks and
   each step adds 2 x layers + 1 all-reduces, a gather and a broadcast over loopback TCP.
3. gloo all-reduce between two processes (TpComm, the engine's own path): latency and bandwidth by size, and
   the all-reduce payload of a step computed from the written model (docs/engine.md, "Tensor parallelism").
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import statistics
import time

import torch

from bench.common import Target, pct, table, write_results
from bench.workload import mixed_workload

N_REQUESTS = int(os.environ.get("MPLEX_BENCH_TP_REQUESTS", "64"))
REPEATS = int(os.environ.get("MPLEX_BENCH_TP_REPEATS", "3"))
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _config(kit, n: int, weight_dtype: str = "auto"):
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, ParallelConfig, SchedulerConfig

    return EngineConfig(model_dir=kit.base_dir, weight_dtype=weight_dtype,
                        cache=CacheConfig(memory_bytes=256 * 2**20, swap_space_bytes=0),
                        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
                        lora=LoraConfig(enabled=False), parallel=ParallelConfig(tensor_parallel_size=n))


def _engine(config, threads: int):
    from services.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    return LLMEngine(config)


def _close(engine) -> None:
    if engine.tp is not None:
        engine.tp.close()


def _memory(kit) -> tuple[list[list], dict]:
    rows, figs = [], {}
    for wd in ("auto", "fp8"):
        for n in (1, 2):
            e = _engine(_config(kit, n, wd), 1)
            try:
                per_rank = e.tp.rank_weight_bytes if e.tp else [e.model.weight_bytes()]
                blocks, bs = e.kv.pool.num_blocks, e.kv.block_size
                kv_per_token = e.runner.kv_bytes_per_token
            finally:
                _close(e)
            key = f"{'fp32' if wd == 'auto' else 'fp8'}-tp{n}"
            figs[key] = {"weight_bytes_per_rank": per_rank, "kv_blocks_per_rank": blocks,
                         "kv_tokens_per_rank": blocks * bs, "kv_bytes_per_token_per_rank": kv_per_token}
            rows.append([key, " / ".join(f"{b / 2**20:.3f}" for b in per_rank), blocks * bs, kv_per_token])
    for wd in ("fp32", "fp8"):
        one, two = figs[f"{wd}-tp1"], figs[f"{wd}-tp2"]
        figs[f"{wd}_rank_weight_fraction"] = max(two["weight_bytes_per_rank"]) / one["weight_bytes_per_rank"][0]
    return rows, figs


def _cpu_seconds(engine) -> float:
    """CPU time of every process of the engine (rank 0 and its ranks' processes), user + system."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for proc in engine.tp.procs if engine.tp is not None else ():
        fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _run(engine, reqs) -> dict:
    from services.engine.sequence import SamplingParams

    for i, r in enumerate(reqs):
        engine.add_request(f"b{i}", r.prompt_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    t0, cpu0 = time.perf_counter(), _cpu_seconds(engine)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds(engine) - cpu0
    tpot = [(last[k] - first[k]) / (count[k] - 1) for k in count if count[k] > 1]
    out = sum(count.values())
    return {"tok_s": out / wall, "tok_per_cpu_s": out / cpu, "tpot_p50_ms": pct(tpot, 50) * 1e3,
            "tpot_p90_ms": pct(tpot, 90) * 1e3, "wall_s": wall, "cpu_s": cpu}


# (label, ranks, torch threads per rank). TP=1 runs one thread, the compute of one TP=2 rank. TP=1 with two
# threads (MPLEX_BENCH_TP_TWO_THREADS=1) is the same two cores as TP=2, but on this shared VM its OpenMP team
# waits on its slower thread at every op: 28-58 tok/s in the first run, 13-25x slower than one thread.
CONFIGS = (("TP=1, 1 thread", 1, 1), ("TP=2, 1 thread per rank", 2, 1))
if os.environ.get("MPLEX_BENCH_TP_TWO_THREADS"):  # slow on a shared VM (see docs/engine.md)
    CONFIGS += (("TP=1, 2 threads", 1, 2),)


def _throughput(kit) -> tuple[list[list], dict]:
    reqs = mixed_workload(kit, N_REQUESTS)
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in CONFIGS}
    for _ in range(REPEATS):  # interleaved, fresh engines: the VM's load drifts between runs
        for label, n, threads in CONFIGS:
            e = _engine(_config(kit, n), threads)
            try:
                runs[label].append(_run(e, reqs))
            finally:
                _close(e)
    rows, figs = [], {}
    keys = ("tok_s", "tok_per_cpu_s", "tpot_p50_ms", "tpot_p90_ms")
    for label, _, _ in CONFIGS:
        med = {k: statistics.median(r[k] for r in runs[label]) for k in keys}
        figs[label] = {"runs": runs[label], **med}
        rows.append([label, *(med[k] for k in keys)])
    one, two = runs[CONFIGS[0][0]], runs[CONFIGS[1][0]]
    for key in ("tok_s", "tok_per_cpu_s", "tpot_p50_ms"):  # ratios of runs adjacent in time
        figs[f"tp2_over_tp1_{key}"] = statistics.median(b[key] / a[key] for a, b in zip(one, two))
    return rows, figs


def _time_allreduce(comm) -> list[tuple[int, float]]:
    """(bytes, seconds per all-reduce) for each size; both ranks run it in step."""
    results = []
    for size in SIZES:
        t = torch.ones(size // 4)
        for _ in range(3):
            comm.all_reduce(t)
        reps = max(5, min(200, (64 << 20) // size))
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            comm.all_reduce(t)
        results.append((size, (time.perf_counter() - t0) / reps))
    return results


def _allreduce_rank1(port: int) -> None:
    from services.engine.parallel.comm import TpComm

    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    _time_allreduce(TpComm(store, 1, 2, "gloo", 60, "cpu"))


def _allreduce() -> tuple[list[list], dict]:
    from services.engine.parallel.comm import TpComm, open_store

    store = open_store(2, 60)  # rank 0 (this process) serves the rendezvous
    proc = multiprocessing.get_context("spawn").Process(target=_allreduce_rank1, args=(store.port,), daemon=True)
    proc.start()
    torch.set_num_threads(1)
    results = _time_allreduce(TpComm(store, 0, 2, "gloo", 60, "cpu"))
    proc.join(30)
    rows, figs = [], {"sizes": []}
    for size, sec in results:
        algbw = size / sec
        busbw = algbw * 2 * (2 - 1) / 2  # ring all-reduce: each rank sends and receives 2(N-1)/N of the data
        figs["sizes"].append({"bytes": size, "seconds": sec, "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9})
        rows.append([f"{size >> 10} KiB", sec * 1e6, algbw / 1e9, busbw / 1e9])
    return rows, figs


def _volume_model(kit, ar: dict) -> tuple[list[list], dict]:
    """All-reduce payload per token = (2 x layers + 1 embedding) x hidden x bytes; per step x its tokens."""
    from services.engine.config import ModelConfig

    m = ModelConfig.from_dir(kit.base_dir)
    shapes = {"demo (fp32 activations)": (m.num_layers, m.hidden_size, 4),
              "Llama-3-70B (bf16 activations)": (80, 8192, 2)}
    rows, figs = [], {}
    small = ar["sizes"][0]["seconds"]  # the smallest size's time: the per-collective latency here
    for name, (layers, hidden, nbytes) in shapes.items():
        per_token = (2 * layers + 1) * hidden * nbytes
        decode_step = 256 * per_token
        figs[name] = {"bytes_per_token": per_token, "bytes_per_256_token_step": decode_step,
                      "collectives_per_step": 2 * layers + 2}
        rows.append([name, per_token / 1024, decode_step / 2**20, 2 * layers + 2])
    # The demo on gloo here: the collectives of one decode step of 64 sequences, from the measured latency
    # and bandwidth, against a TP=1 step.
    demo = figs["demo (fp32 activations)"]
    bw = max(s["algbw_GBps"] for s in ar["sizes"]) * 1e9
    figs["demo_step_collectives_est_ms"] = (demo["collectives_per_step"] * small + 64 * demo["bytes_per_token"] / bw) * 1e3
    return rows, figs


def main() -> None:
    from services.modelkit import ensure_demo

    kit = ensure_demo()
    mem_rows, mem = _memory(kit)
    print(table("weights and KV per rank (KV budget 256 MiB per rank)", ["config", "weights MiB per rank", "KV tokens per rank",
                                                                         "KV bytes/token per rank"], mem_rows))
    ar_rows, ar = _allreduce()
    print(table("gloo all-reduce, 2 processes on this VM (loopback TCP)", ["size", "µs", "algbw GB/s", "busbw GB/s"], ar_rows))
    tp_rows, tput = _throughput(kit)
    print(table(f"TP=1 vs TP=2 on this VM's 2 cores: {N_REQUESTS} mixed requests at once, median of {REPEATS}",
                ["engine", "output tok/s", "tok per CPU s (all ranks)", "TPOT p50 ms", "TPOT p90 ms"], tp_rows))
    vol_rows, vol = _volume_model(kit, ar)
    print(table("all-reduce volume model (2 per layer + the embedding's, x hidden x bytes)",
                ["model", "KiB per token", "MiB per 256-token step", "collectives per step"], vol_rows))
    print(f"TP=2 / TP=1 (1 thread), median of paired runs: throughput {tput['tp2_over_tp1_tok_s']:.3f}, tokens per CPU "
          f"second {tput['tp2_over_tp1_tok_per_cpu_s']:.3f}, TPOT p50 {tput['tp2_over_tp1_tpot_p50_ms']:.3f}; estimated "
          f"collective time of a 64-sequence demo decode step here: {vol['demo_step_collectives_est_ms']:.2f} ms")
    targets = [
        Target("rank weight fraction, fp32, TP=2 (~1/2)", mem["fp32_rank_weight_fraction"], 0.55, higher_is_better=False),
        Target("rank weight fraction, fp8, TP=2 (~1/2)", mem["fp8_rank_weight_fraction"], 0.55, higher_is_better=False),
        Target("KV tokens per rank TP=2 / TP=1 (same budget)", mem["fp32-tp2"]["kv_tokens_per_rank"] / mem["fp32-tp1"]["kv_tokens_per_rank"], 2.0),
        # Reported, not expected on 2 shared CPU cores: a speed-up needs a device per rank.
        Target("TP=2 / TP=1 throughput, 2 shared CPU cores (report)", tput["tp2_over_tp1_tok_s"], 1.0),
        Target("TP=2 / TP=1 tokens per CPU second (report)", tput["tp2_over_tp1_tok_per_cpu_s"], 1.0),
    ]
    write_results("tp", {"memory": mem, "allreduce": ar, "throughput": tput, "volume_model": vol,
                         "requests": N_REQUESTS, "repeats": REPEATS}, targets)


if __name__ == "__main__":
    main()
