"""The CPU projection GEMM: torch's F.linear against oneDNN with a prepacked weight (model/layers.py,
Linear.pack), on the projection shapes of the serving benchmark's model (hidden 256, intermediate 688, 8/2
heads of 32: fused QKV 384, fused gate-up 1376) and of the demo model's, rows M from one decode row to a
2,048-token prefill step, 1 and 2 threads. Median of interleaved repetitions; GFLOP/s and the ratios. "engine" is
what the engine calls (Linear.pack as the engine packs: both paths timed on this machine, oneDNN from the fewest
rows where it won, F.linear below, or F.linear only where packing never won)."""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import Target, table, write_results
from services.engine.model.layers import Linear, can_pack

# (name, out_features N, in_features K)
SHAPES = [("qkv", 384, 256), ("o", 256, 256), ("gate_up", 1376, 256), ("down", 256, 688), ("lm_head", 512, 256)]
ROWS = [1, 2, 4, 8, 16, 64, 256, 2048]
REPS = 7


def _time(fn, x, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t) / n


def main() -> None:
    if not can_pack(torch.zeros(1, 1)):
        print("torch has no oneDNN linear ops here: nothing to compare")
        return
    threads0 = torch.get_num_threads()
    rows, figs, engine_ratios, packed_ratios = [], {}, [], []
    gen = torch.Generator().manual_seed(0)
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, n_out, k in SHAPES:
                w = torch.randn(n_out, k, generator=gen)
                engine = Linear(w.clone())
                engine.pack()  # measured, as the engine does: may decline on this machine

                packed_w = torch.ops.mkldnn._reorder_linear_weight(w)

                def packed(v, pw=packed_w):
                    return torch.ops.mkldnn._linear_pointwise(v, pw, None, "none", [], "")

                for m in ROWS:
                    x = torch.randn(m, k, generator=gen)
                    calls = max(3, int(2e8 / (2 * m * n_out * k + 1e5)))  # ~0.1-1 s a side
                    times = {"linear": [], "packed": [], "engine": []}
                    for _ in range(REPS):  # interleaved, so drift hits every side alike
                        times["linear"].append(_time(lambda v: F.linear(v, w), x, calls))
                        times["packed"].append(_time(packed, x, calls))
                        times["engine"].append(_time(engine, x, calls))
                    a, b, e = (statistics.median(times[key]) for key in ("linear", "packed", "engine"))
                    flop = 2 * m * n_out * k
                    rows.append([threads, name, m, flop / a / 1e9, flop / b / 1e9, a / b, a / e])
                    figs[f"t{threads}-{name}-m{m}"] = {"linear_s": a, "packed_s": b, "engine_s": e}
                    engine_ratios.append(a / e)
                    if m >= 64:
                        packed_ratios.append(a / b)
    finally:
        torch.set_num_threads(threads0)
    print(table("CPU projection GEMM: F.linear vs oneDNN prepacked (GFLOP/s, median of interleaved repetitions)",
                ["threads", "projection", "rows M", "F.linear GF/s", "packed GF/s", "packed speedup", "engine speedup"],
                rows))
    # The engine's dispatch must never lose much to F.linear (one-row decode included), and packing must pay
    # where the rows are many.
    targets = [Target("engine / F.linear, worst cell (every M)", min(engine_ratios), 0.9),
               Target("packed / F.linear, worst cell with M >= 64 rows", min(packed_ratios), 1.5)]
    write_results("gemm", {"cells": figs, "cpus": os.cpu_count()}, targets)


if __name__ == "__main__":
    main()
