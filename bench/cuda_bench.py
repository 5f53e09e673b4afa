"""The CUDA paths on a GPU, against this GPU's own roofline and against the peer in the same run.

1. HBM: a device-to-device copy (bytes read + written / time) -- the bandwidth every memory-bound kernel below is
   measured against (the datasheet figure is not what a kernel can reach).
2. SGMV (Triton): one decode step's LoRA work for one projection (shrink x A^T, expand v B^T into a fused
   output's slice) over many adapters at once; bytes = the adapters' weights it must read plus x and y. Against the
   roofline, against the torch reference over the same slot stacks, and as a fraction of the base projection's
   bf16 GEMM it rides on.
3. FP8 weights: `_scaled_mm` (rowwise scales, bf16 out) against a bf16 GEMM of the same shape, decode and
   prefill M; and fp8_linear (with its per-token activation quantization) against F.linear in bf16.
4. Paged decode attention (Triton) over fp8 and bf16 caches: KV bytes read per second against the roofline,
   and against gather + SDPA (the engine's path without the kernel) on the same cache.
5. The engine end to end on a random 0.4B Llama (bf16; FP8 weights): every request at once, output tokens/s, base
   model and 32 LoRA adapters mixed, against Hugging Face `generate` (static batches, bf16) in the same run.

On a machine without CUDA it prints that and writes nothing. Run: `python -m bench.run cuda`.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Target, table, write_results

CUDA = "cuda"


def _time(fn, iters: int = 50, reps: int = 5) -> float:
    """Median over reps of the mean seconds per call (CUDA events, after a warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / iters)
    return statistics.median(out)


def _graph_time(fn, iters: int = 20) -> float:
    """Seconds per call with `iters` calls captured in one CUDA graph: the GPU's own time, no launch cost."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    return _time(g.replay, iters=5) / iters


def _host_time(fn, calls: int = 200) -> float:
    """Host seconds per call to issue fn's work (the GPU runs behind; synchronized once at the end)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host


def hbm_copy() -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=CUDA)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), iters=20)
    del src, dst
    return 2 * 2 * 2**30 / t


def sgmv(peak: float) -> tuple[list[list], dict]:
    from services.engine.kernels import build_sgmv_meta, lora_expand, lora_shrink

    rows, figs = [], {}
    h, rank, dt = 4096, 16, torch.bfloat16
    w_base = torch.randn(3 * h, h, dtype=dt, device=CUDA) / 64  # a fused qkv-sized projection (MHA)
    for t_tok, n in ((64, 8), (256, 64), (256, 128)):
        a = torch.randn(n, rank, h, dtype=dt, device=CUDA) / 64
        b = torch.randn(n, h, rank, dtype=dt, device=CUDA) / 4
        ranks = torch.full((n,), rank, dtype=torch.int32, device=CUDA)
        slots = (torch.arange(t_tok, device=CUDA) % n).sort().values
        meta = build_sgmv_meta(slots)
        x = torch.randn(t_tok, h, dtype=dt, device=CUDA)
        y = torch.zeros(t_tok, 3 * h, dtype=dt, device=CUDA)
        v = torch.empty(t_tok, rank, dtype=torch.float32, device=CUDA)

        def lora(backend="triton"):
            lora_shrink(x, a, ranks, meta, out=v, backend=backend)
            lora_expand(v, b, ranks, meta, y, y_offset=h, backend=backend)

        t_tri = _time(lora)
        t_gpu = _graph_time(lora)  # the kernels alone: t_tri - t_gpu is launch and wrapper cost
        t_host = _host_time(lora)
        t_ref = _time(lambda: lora("torch"), iters=10)
        t_base = _graph_time(lambda: torch.mm(x, w_base.t()))
        moved = 2 * n * rank * h * 2 + t_tok * h * 2 + 2 * t_tok * h * 2  # A, B; x; y slice read + written
        frac = moved / t_gpu / peak
        rows.append([f"T={t_tok} adapters={n} r={rank}", t_tri * 1e6, t_host * 1e6, t_gpu * 1e6, moved / t_gpu / 1e9,
                     frac, t_ref / t_tri, t_base * 1e6, t_gpu / t_base])
        figs[f"sgmv_T{t_tok}_N{n}"] = {"us": t_tri * 1e6, "host_us": t_host * 1e6, "graph_us": t_gpu * 1e6,
                                       "gb_s": moved / t_gpu / 1e9, "roofline_frac": frac,
                                       "vs_torch_ref": t_ref / t_tri, "base_qkv_gemm_us": t_base * 1e6,
                                       "lora_over_base": t_gpu / t_base}
    return rows, figs


def fp8() -> tuple[list[list], dict]:
    import torch.nn.functional as F

    from services.engine.kernels import fp8_linear, quantize_fp8

    rows, figs = [], {}
    k = n = 8192
    w16 = torch.randn(n, k, dtype=torch.bfloat16, device=CUDA) / 90
    wq = quantize_fp8(w16)
    for m in (16, 256, 8192):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=CUDA)
        xq = x.to(torch.float8_e4m3fn)
        one = torch.ones(m, 1, dtype=torch.float32, device=CUDA)
        t_bf16 = _time(lambda: F.linear(x, w16), iters=20)
        t_mm = _time(lambda: torch._scaled_mm(xq, wq.weight.t(), scale_a=one, scale_b=wq.scale.view(1, -1),
                                              out_dtype=torch.bfloat16), iters=20)
        t_lin = _time(lambda: fp8_linear(x, wq), iters=20)
        t_lin_g = _graph_time(lambda: fp8_linear(x, wq))
        flops = 2 * m * n * k
        rows.append([m, flops / t_bf16 / 1e12, flops / t_mm / 1e12, t_bf16 / t_mm, t_bf16 / t_lin, t_bf16 / t_lin_g])
        figs[f"fp8_M{m}"] = {"bf16_tflops": flops / t_bf16 / 1e12, "scaled_mm_tflops": flops / t_mm / 1e12,
                             "scaled_mm_speedup": t_bf16 / t_mm, "fp8_linear_speedup": t_bf16 / t_lin,
                             "fp8_linear_graph_speedup": t_bf16 / t_lin_g}
    return rows, figs


def decode_attention(peak: float) -> tuple[list[list], dict]:
    import torch.nn.functional as F

    from services.engine.kernels.decode_attention import TritonDecodeAttention

    kern = TritonDecodeAttention()
    rows, figs = [], {}
    bsz, ctx, heads, kvh, d, bs = 128, 2048, 32, 8, 128, 16
    per = ctx // bs
    nblocks = bsz * per
    tables = torch.randperm(nblocks, device=CUDA).view(bsz, per)
    ctx_lens = torch.full((bsz,), ctx, dtype=torch.int64, device=CUDA)
    rws = torch.arange(bsz, device=CUDA)
    q = torch.randn(bsz, heads, d, dtype=torch.bfloat16, device=CUDA)
    out = torch.empty_like(q)
    for cache in ("fp8", "bf16"):
        if cache == "fp8":
            k = torch.randint(0, 0x70, (nblocks, bs, kvh, d), dtype=torch.uint8, device=CUDA).view(torch.float8_e4m3fn)
            v = torch.randint(0, 0x70, (nblocks, bs, kvh, d), dtype=torch.uint8, device=CUDA).view(torch.float8_e4m3fn)
            ks = torch.full((nblocks, kvh), 2.0**-8, device=CUDA)
            vs = ks.clone()
            elt = 1
        else:
            k = torch.randn(nblocks, bs, kvh, d, dtype=torch.bfloat16, device=CUDA)
            v = torch.randn_like(k)
            ks = vs = None
            elt = 2
        t_k = _time(lambda: kern.decode(q, out, k, v, rws, ctx_lens, tables, scale=d**-0.5, window=None,
                                        k_scales=ks, v_scales=vs), iters=20)
        t_one = _time(lambda: kern.decode(q, out, k, v, rws, ctx_lens, tables, scale=d**-0.5, window=None,
                                          k_scales=ks, v_scales=vs, partition_tokens=ctx), iters=20)

        kr, vr = (k, v) if cache == "bf16" else (k.view(torch.uint8), v.view(torch.uint8))

        def gather_sdpa():  # for fp8, the gather and a widening stand in for the dequantize (scales omitted)
            idx = tables.view(-1)
            kk, vv = kr[idx].to(torch.bfloat16), vr[idx].to(torch.bfloat16)
            kk = kk.view(bsz, ctx, kvh, d).transpose(1, 2)
            vv = vv.view(bsz, ctx, kvh, d).transpose(1, 2)
            return F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, enable_gqa=True)

        t_g = _time(gather_sdpa, iters=5)
        moved = 2 * bsz * ctx * kvh * d * elt
        rows.append([cache, t_k * 1e6, moved / t_k / 1e9, moved / t_k / peak, t_g / t_k, t_one / t_k])
        figs[f"decode_{cache}"] = {"us": t_k * 1e6, "gb_s": moved / t_k / 1e9, "roofline_frac": moved / t_k / peak,
                                   "vs_gather_sdpa": t_g / t_k, "vs_one_partition": t_one / t_k}
    return rows, figs


def _random_model(root: Path) -> Path:
    from services.modelkit import build_tiny_random

    return build_tiny_random(root / "llama-0.4b", arch="llama", seed=0, hidden=2048, intermediate=5632, layers=8,
                             heads=16, kv_heads=8, vocab_size=512, max_position_embeddings=1024, init_std=0.02)


PROFILE = os.environ.get("MPLEX_BENCH_CUDA_PROFILE", "1") == "1"


def _profile(engine, prompts, label: str) -> None:
    """Where a decode step's time goes: 256 sequences decoding, 12 steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from services.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 12
    print(f"\n== profile, {label}: 12 decode steps of 256 sequences, {wall * 1e3:.1f} ms/step under the profiler ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    try:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
    except Exception as exc:  # older torch names it self_cuda_time_total
        print(f"(device-time table unavailable: {exc!r})")
    while engine.has_unfinished():
        engine.step()


def engine_e2e(root: Path) -> tuple[list[list], dict]:
    from services.common.lora_format import content_id
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from services.engine.engine import LLMEngine
    from services.engine.sequence import AdapterRef, SamplingParams
    from services.modelkit import make_random_adapter

    model = _random_model(root)
    n_req, p_len, out_len = 256, 128, 128
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (p_len,), generator=g).tolist() for _ in range(n_req)]
    adapters = []
    for i in range(32):
        path = make_random_adapter(model, root / f"a{i}", rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                   lora_alpha=32, seed=i)
        adapters.append(AdapterRef(content_id(path), f"a{i}", str(path)))
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    rows, figs = [], {}
    runs = (("bf16 base", "auto", False, False), ("bf16 32 adapters", "auto", True, False),
            ("fp8 base", "fp8", False, False), ("fp8 32 adapters", "fp8", True, False),
            ("bf16 base, async", "auto", False, True), ("fp8 base, async", "fp8", False, True))
    for label, weight_dtype, mix, overlap in runs:
        engine = LLMEngine(EngineConfig(
            model_dir=model, device=CUDA, dtype="bfloat16", weight_dtype=weight_dtype, async_scheduling=overlap,
            cache=CacheConfig(memory_bytes=8 * 2**30),
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
            lora=LoraConfig(max_loras=32, max_cpu_loras=32, max_lora_rank=16)))
        # Warm-up at the run's batch sizes (a 256-row decode, a 4096-token prefill), adapters loaded.
        warm = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"w{i}", p, warm, adapter=adapters[i % 32] if mix else None)
        while engine.has_unfinished():
            engine.step()
            if engine.last_plan_empty:
                engine.wake.wait(0.005)
                engine.wake.clear()
        if PROFILE and not mix and not overlap:
            _profile(engine, prompts, label)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params, adapter=adapters[i % 32] if mix else None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens, steps0 = 0, engine.stats.steps
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None, o.error
                tokens += len(o.new_token_ids)
            if engine.last_plan_empty:  # adapters still loading off the step loop
                engine.wake.wait(0.005)
                engine.wake.clear()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        steps = engine.stats.steps - steps0
        rows.append([label, tokens / wall, wall / max(1, steps) * 1e3, steps])
        figs[f"engine_{label.replace(', ', '_').replace(' ', '_')}"] = {"output_tok_s": tokens / wall, "ms_per_step": wall / steps * 1e3}
        if engine.adapters is not None:
            engine.adapters.shutdown()
        del engine
        torch.cuda.empty_cache()
    # The peer: transformers generate in static batches (bf16, SDPA), the same prompts and lengths.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(CUDA).eval()
    best = 0.0
    for bs in (64, 256):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = 0
        with torch.inference_mode():
            for s in range(0, n_req, bs):
                ids = torch.tensor(prompts[s:s + bs], device=CUDA)
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                  min_new_tokens=out_len, do_sample=False, pad_token_id=0)
                tokens += (out.shape[1] - p_len) * ids.shape[0]
        torch.cuda.synchronize()
        tps = tokens / (time.perf_counter() - t0)
        rows.append([f"HF generate batch {bs}", tps, float("nan"), 0])
        best = max(best, tps)
    figs["hf_generate_best_tok_s"] = best
    return rows, figs


def main() -> None:
    if not torch.cuda.is_available():
        print("cuda bench: no CUDA device here; run it on a GPU machine (docs/engine.md, 'On a GPU')")
        return
    os.environ.pop("TRITON_INTERPRET", None)
    name = torch.cuda.get_device_name()
    peak = hbm_copy()
    print(f"device: {name}; torch {torch.__version__}; device-to-device copy {peak / 1e12:.2f} TB/s (read + write)")
    figures: dict = {"device": name, "torch": torch.__version__, "hbm_copy_tb_s": peak / 1e12}
    r, f = sgmv(peak)
    figures.update(f)
    print(table("SGMV (Triton, bf16): one projection's LoRA for a decode step (graph = kernels alone, in a CUDA graph)",
                ["case", "eager us", "host us", "graph us", "GB/s", "of copy bw", "x torch ref", "base qkv GEMM us",
                 "LoRA / base"], r))
    r, f = fp8()
    figures.update(f)
    print(table("FP8 weights: _scaled_mm vs bf16 GEMM, K = N = 8192", ["M", "bf16 TFLOP/s", "fp8 TFLOP/s", "speedup",
                "fp8_linear speedup", "in a graph"], r))
    r, f = decode_attention(peak)
    figures.update(f)
    print(table("Paged decode attention (Triton): 128 seqs x 2048 ctx, 32/8 heads, d 128", ["cache", "us", "KV GB/s",
                "of copy bw", "x gather+SDPA", "x one partition"], r))
    with tempfile.TemporaryDirectory() as tmp:
        r, f = engine_e2e(Path(tmp))
    figures.update(f)
    print(table("Engine end to end on CUDA: 256 requests x (128 in, 128 out), random 0.4B Llama",
                ["run", "output tok/s", "ms/step", "steps"], r))
    targets = [
        Target("SGMV at T=256, 64 adapters: fraction of copy bandwidth", figures["sgmv_T256_N64"]["roofline_frac"], 0.5),
        Target("FP8 _scaled_mm over bf16 GEMM at M=8192", figures["fp8_M8192"]["scaled_mm_speedup"], 1.5),
        Target("decode attention, fp8 cache: fraction of copy bandwidth", figures["decode_fp8"]["roofline_frac"], 0.5),
        Target("decode attention, bf16 cache: fraction of copy bandwidth", figures["decode_bf16"]["roofline_frac"], 0.5),
        Target("engine bf16 base over HF generate (best batch)",
               figures["engine_bf16_base"]["output_tok_s"] / figures["hf_generate_best_tok_s"], 2.0),
        Target("engine with 32 adapters over base (bf16)",
               figures["engine_bf16_32_adapters"]["output_tok_s"] / figures["engine_bf16_base"]["output_tok_s"], 0.8),
        Target("decode attention, fp8 cache: split over one partition", figures["decode_fp8"]["vs_one_partition"], 2.0),
    ]
    write_results("cuda", figures, targets)


if __name__ == "__main__":
    main()
