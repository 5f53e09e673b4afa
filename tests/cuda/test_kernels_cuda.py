"""The Triton SGMV and paged decode kernels compiled for the GPU, and the FP8 weight GEMM through `_scaled_mm`,
against the same oracles the CPU suites use (tests/engine/kernels run the same kernels interpreted)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from services.engine.kernels import build_sgmv_meta, fp8_linear, fp8_linear_ref, lora_expand, lora_shrink, quantize_fp8
from services.engine.kernels.decode_attention import TritonDecodeAttention
from services.engine.kernels.decode_attention_ref import paged_decode_attention_ref
from tests.engine.kernels.test_decode_attention_triton import SENTINEL, build, cases, partition
from tests.engine.kernels.test_sgmv_kernels import CASES, DTYPES, check_case, clean, make_case, oracle_expand, oracle_shrink

CUDA = "cuda"


# -- SGMV ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_sgmv_compiled_matches_the_per_token_oracle(name, dtype):
    """Every case of the interpreted suite (mixed ranks, rank 0, base rows, NaN past each rank, multi-tile)."""
    check_case(CASES[name], dtype, "triton", device=CUDA)


@pytest.mark.parametrize("split_k", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sgmv_at_model_shapes(dtype, split_k):
    """A decode step's shapes (H 2048, ranks 8..64 over 24 adapters, 200 tokens): shrink with and without split
    K (fp32 atomics) and the automatic choice, expand into a fused projection's slice."""
    n, r_max, h_in, h_out = 24, 64, 2048, 1024
    ranks = [(8, 16, 32, 64, 0)[i % 5] for i in range(n)]
    slots = torch.randint(-1, n, (200,), generator=torch.Generator().manual_seed(3))
    x, a, b, rk, sl = make_case(200, n, r_max, h_in, h_out, ranks, slots, dtype)
    meta = build_sgmv_meta(sl.to(CUDA))
    v = lora_shrink(x.to(CUDA), a.to(CUDA), rk.to(CUDA), meta, split_k=split_k).cpu()
    torch.testing.assert_close(v, oracle_shrink(x, clean(a), rk, sl), rtol=2e-4, atol=2e-4)
    y0 = torch.randn(200, 3 * h_out, generator=torch.Generator().manual_seed(4)).to(dtype)
    y = y0.clone().to(CUDA)
    lora_expand(v.to(CUDA), b.to(CUDA), rk.to(CUDA), meta, y, y_offset=h_out)
    want = oracle_expand(v, clean(b), rk, sl, y0, h_out)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.cpu(), want, rtol=tol, atol=tol)


# -- paged decode attention -------------------------------------------------------------------------------------

KERNEL = TritonDecodeAttention()


def _on(device, *ts):
    return [t.to(device) if t is not None else None for t in ts]


def _check_decode(q, k, v, ks, vs, rows, ctx, tables, scale, window, tol, **kw):
    qd, kd, vd, ksd, vsd, rowsd, ctxd, tablesd = _on(CUDA, q, k, v, ks, vs, rows, ctx, tables)
    out = torch.full(qd.shape, SENTINEL, dtype=q.dtype, device=CUDA)
    KERNEL.decode(qd, out, kd, vd, rowsd, ctxd, tablesd, scale=scale, window=window, k_scales=ksd, v_scales=vsd, **kw)
    out = out.cpu()
    want = paged_decode_attention_ref(q, k, v, rows, ctx, tables, scale=scale, window=window, k_scales=ks, v_scales=vs)
    for r, w in want.items():
        torch.testing.assert_close(out[r].double(), w, atol=tol, rtol=tol, msg=lambda m: f"row {r}: {m}")
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == SENTINEL).all(), "the kernel wrote rows it was not given"


@settings(max_examples=25, deadline=None)
@given(c=cases())
def test_decode_compiled_matches_the_float64_reference(c):
    q, k, v, ks, vs, rows, ctx, tables = build(c)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    _check_decode(q, k, v, ks, vs, rows, ctx, tables, 1 / math.sqrt(c["head_dim"]), c["window"], tol, **partition(c))


@pytest.mark.parametrize("part", [256, 2048])
@pytest.mark.parametrize("cache", ["fp8", "bfloat16"])
def test_decode_at_model_shapes(cache, part):
    """head_dim 128, GQA 4, block 16, contexts up to 1,500 tokens over shuffled blocks; split into partitions
    of 256 tokens (the default) and in one."""
    g = torch.Generator().manual_seed(11)
    bs, kvh, group, d = 16, 4, 4, 128
    ctx = torch.tensor([1, 17, 300, 1500, 777, 64])
    need = ((ctx + bs - 1) // bs).tolist()
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(need), max(need), dtype=torch.int64)
    at = 0
    for b_, nb in enumerate(need):
        tables[b_, :nb] = perm[at:at + nb]
        at += nb
    shape = (num_blocks, bs, kvh, d)
    if cache == "fp8":
        k, v = (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for _ in range(2))
        for codes in (k, v):
            codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes: the writer never emits them
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
        ks = torch.ldexp(torch.ones(num_blocks, kvh), torch.randint(-12, -6, (num_blocks, kvh), generator=g))
        vs = torch.ldexp(torch.ones(num_blocks, kvh), torch.randint(-10, -6, (num_blocks, kvh), generator=g))
        q = torch.randn(len(need), kvh * group, d, generator=g)
        tol = 1e-5
    else:
        k = torch.randn(shape, generator=g).bfloat16()
        v = torch.randn(shape, generator=g).bfloat16()
        ks = vs = None
        q = torch.randn(len(need), kvh * group, d, generator=g).bfloat16()
        tol = 1e-2
    _check_decode(q, k, v, ks, vs, torch.arange(len(need)), ctx, tables, 1 / math.sqrt(d), None, tol,
                  partition_tokens=part)


# -- FP8 weights through _scaled_mm ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 37, 512])
def test_fp8_scaled_mm_matches_the_definition(dtype, m):
    """The engine's FP8 GEMM on sm89+: dynamic per-token activation scales (the rowwise bf16 kernel on sm90, unit
    scales + fp32 epilogue otherwise). Against the definition (weights dequantized, fp32 matmul) it adds one
    e4m3 rounding of the activations: relative error a few percent, and the same as the dequant path's
    to that much."""
    from services.engine.kernels.fp8 import _scaled_mm_ok

    g = torch.Generator().manual_seed(m)
    w = quantize_fp8((torch.randn(768, 1024, generator=g) / 32).to(CUDA))
    x = torch.randn(m, 1024, generator=g).to(dtype).to(CUDA)
    assert _scaled_mm_ok(x, w), "sm89+ must take the _scaled_mm path"
    y = fp8_linear(x, w)
    assert y.dtype == dtype and y.shape == (m, 768)
    ref = fp8_linear_ref(x, w).float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel
    dq = fp8_linear(x, w, backend="dequant").float()
    assert ((dq - ref).norm() / ref.norm()).item() < 0.01  # dequant path: only the output rounding
    bias = torch.randn(768, generator=g).to(dtype).to(CUDA)
    torch.testing.assert_close(fp8_linear(x, w, bias).float(), y.float() + bias.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_row_quantization_equals_torch(dtype):
    from services.engine.kernels.fp8 import quantize_rows

    x = (torch.randn(300, 4096) * torch.logspace(-3, 3, 300)[:, None]).to(dtype).to(CUDA)
    x[7] = 0
    q, s = quantize_rows(x)  # CUDA: the Triton kernel
    q_t, s_t = quantize_rows(x, backend="torch")
    assert torch.equal(s, s_t) and torch.equal(q.view(torch.uint8), q_t.view(torch.uint8))


def test_fp8_zero_rows_stay_zero():
    w = quantize_fp8(torch.randn(64, 128).to(CUDA))
    x = torch.randn(5, 128, dtype=torch.bfloat16, device=CUDA)
    x[2] = 0
    y = fp8_linear(x, w)
    assert torch.isfinite(y).all() and (y[2] == 0).all()
