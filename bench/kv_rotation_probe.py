"""The fp8 KV key rotation, measured on its own: greedy token agreement with the fp32 KV cache on every demo
eval set, for the fp8 cache with its key rotation (as served) and without (kv_fp8.key_rotation removed from
the same engine), same run; and the score error of fp8 keys with and without the rotation on the demo
model's real queries and keys (RMS error of q . k over the scores' spread, per layer and kv head).

`python -m bench.kv_rotation_probe` (not in `make bench`: bench.kv_fp8 reports the served scheme's figures).
"""
from __future__ import annotations

import os
import time

import torch

from bench.common import table, write_results

ITEMS = int(os.environ.get("MPLEX_BENCH_FP8_ITEMS", "200"))


def _score_errors(kit) -> dict[str, list[float]]:
    from services.engine.kernels.kv_fp8 import FP8_KV_DTYPE, Fp8WritePlan, dequantize, key_rotation, write_fp8_kv
    from services.engine.kv_gate import _engine, demo_eval_sets
    from services.engine.model import llama
    from services.engine.sequence import SamplingParams

    engine = _engine(kit.base_dir, "float32", "auto", "auto", 64 << 20, 64)
    captured = []
    original = llama.paged_attention

    def record(q, k, v, cache, meta, scale):
        captured.append((q.clone(), k.clone()))
        return original(q, k, v, cache, meta, scale)

    llama.paged_attention = record
    try:
        prompts = demo_eval_sets(kit, 8)[0].prompts[:8]
        engine.generate(prompts, [SamplingParams(max_tokens=1, temperature=0)] * len(prompts))
    finally:
        llama.paged_attention = original
    cfg = engine.model.config
    heads, kvh, dim, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    out = {}
    for name, rot in (("plain", torch.eye(dim)), ("rotated", key_rotation(dim))):
        errs = []
        for q, k in captured[: cfg.num_layers]:
            t = k.shape[0]
            kr, qr = (k.reshape(-1, dim) @ rot).view(k.shape), (q.reshape(-1, dim) @ rot).view(q.shape)
            cache = torch.zeros((t + bs - 1) // bs, bs, kvh, dim, dtype=FP8_KV_DTYPE)
            scales = torch.zeros(cache.shape[0], kvh)
            write_fp8_kv(cache, scales, kr, Fp8WritePlan.build(torch.arange(t), bs))
            back = dequantize(cache, scales).reshape(-1, kvh, dim)[:t]
            g = heads // kvh
            for h in range(kvh):
                qq = qr[:, h * g:(h + 1) * g].reshape(-1, dim)
                exact = qq @ kr[:, h].T
                errs.append(float(((qq @ back[:, h].T - exact).pow(2).mean().sqrt() / exact.std())))
        out[name] = errs
    return out


def main() -> None:
    from services.engine.kv_gate import _engine, _greedy, demo_eval_sets, token_agreement
    from services.modelkit import ensure_demo

    torch.set_num_threads(int(os.environ.get("MPLEX_BENCH_THREADS", "1")))
    kit = ensure_demo()
    errors = _score_errors(kit)
    print(table("fp8 key score error (RMS of q.k error / std of q.k), per layer x kv head",
                ["keys", "mean", "min", "max"],
                [[n, sum(e) / len(e), min(e), max(e)] for n, e in errors.items()]))
    t0 = time.perf_counter()
    engines = {name: _engine(kit.base_dir, "float32", "auto", "auto" if name == "auto" else "fp8", 256 << 20, 64)
               for name in ("auto", "fp8", "fp8-norot")}
    for layer in engines["fp8-norot"].runner.kv_caches:
        layer.k_rotation = None
    rows, figs, tokens = [], {}, {kv: [] for kv in engines}
    for s in demo_eval_sets(kit, ITEMS):
        out = {kv: _greedy(e, s, 48)[0] for kv, e in engines.items()}
        for kv in engines:
            tokens[kv] += out[kv]
        figs[s.name] = {kv: token_agreement(out["auto"], out[kv]) for kv in ("fp8", "fp8-norot")}
        rows.append([s.name, len(s.prompts), figs[s.name]["fp8"], figs[s.name]["fp8-norot"]])
    total = {kv: token_agreement(tokens["auto"], tokens[kv]) for kv in ("fp8", "fp8-norot")}
    rows.append(["all", len(tokens["auto"]), total["fp8"], total["fp8-norot"]])
    print(table(f"greedy token agreement with the fp32 KV cache ({time.perf_counter() - t0:.0f} s)",
                ["eval set", "items", "fp8, keys rotated (served)", "fp8, no rotation"], rows))
    write_results("kv_rotation_probe", {"score_errors": errors, "agreement": figs, "all": total}, [])


if __name__ == "__main__":
    main()
