"""The Triton paged decode attention (kernels/decode_attention_triton.py), interpreted on the CPU, against
the float64 torch reference (decode_attention_ref.py): fp8 caches with per-(block, kv head) scales and
plain fp32/bf16 caches; GQA, odd head widths, sliding windows, shared and padded block tables; and the
host wrapper's refusals."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.kernels.decode_attention import TritonDecodeAttention
from services.engine.kernels.decode_attention_ref import paged_decode_attention_ref

SENTINEL = 7.25
KERNEL = TritonDecodeAttention()


@st.composite
def cases(draw):
    kv_heads = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from([1, 4, 8]))
    max_ctx = 4 * block_size + 3
    n = draw(st.integers(1, 3))
    ctx = draw(st.lists(st.integers(1, max_ctx), min_size=n, max_size=n))
    return dict(
        kv_heads=kv_heads, group=draw(st.integers(1, 5)), head_dim=draw(st.sampled_from([1, 5, 8, 13, 24])),
        block_size=block_size, ctx=ctx, window=draw(st.one_of(st.none(), st.integers(1, max(ctx) + 2))),
        cache=draw(st.sampled_from(["fp8", "fp8", "float32", "bfloat16"])), extra_rows=draw(st.integers(0, 2)),
        q_pad=draw(st.sampled_from([0, 3])), share=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        # context partitions of 1 or 2 blocks (split + merge), or the default (one partition here)
        part=draw(st.sampled_from([None, 1, 2])),
    )


def partition(c) -> dict:
    return {} if c.get("part") is None else {"partition_tokens": c["part"] * c["block_size"]}


def build(c):
    gen = torch.Generator().manual_seed(c["seed"])
    bs, kvh, d = c["block_size"], c["kv_heads"], c["head_dim"]
    heads = kvh * c["group"]
    ctx = torch.tensor(c["ctx"])
    need = ((ctx + bs - 1) // bs).tolist()
    num_blocks = max(need) + 3
    width = max(need) + 1
    shape = (num_blocks, bs, kvh, d)
    dtype = torch.float32 if c["cache"] == "fp8" else getattr(torch, c["cache"])
    if c["cache"] == "fp8":
        k = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
        v = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
        k_scales = torch.ldexp(torch.ones(num_blocks, kvh), torch.randint(-12, -4, (num_blocks, kvh), generator=gen))
        v_scales = torch.ldexp(torch.ones(num_blocks, kvh), torch.randint(-10, -5, (num_blocks, kvh), generator=gen))
    else:
        k, v = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
        k_scales = v_scales = None
    tables = torch.zeros(len(need), width, dtype=torch.int64)
    for b, nb in enumerate(need):
        tables[b, :nb] = torch.randperm(num_blocks, generator=gen)[:nb]
    if c["share"] and len(need) > 1:  # two sequences sharing a prefix block (a prefix-cache hit)
        tables[1, 0] = tables[0, 0]
    n_rows = len(need) + c["extra_rows"]
    rows = torch.randperm(n_rows, generator=gen)[: len(need)].contiguous()
    q_full = torch.randn(n_rows, heads * d + c["q_pad"], generator=gen).to(dtype)
    q = q_full[:, : heads * d].view(n_rows, heads, d)  # row stride wider than H * D
    return q, k, v, k_scales, v_scales, rows, ctx, tables


@settings(max_examples=60, deadline=None)
@given(c=cases())
def test_decode_matches_the_float64_reference(c):
    q, k, v, k_scales, v_scales, rows, ctx, tables = build(c)
    scale = 1 / math.sqrt(c["head_dim"])
    out = torch.full(q.shape, SENTINEL, dtype=q.dtype)
    KERNEL.decode(q, out, k, v, rows, ctx, tables, scale=scale, window=c["window"], k_scales=k_scales,
                  v_scales=v_scales, **partition(c))
    want = paged_decode_attention_ref(q, k, v, rows, ctx, tables, scale=scale, window=c["window"], k_scales=k_scales,
                                      v_scales=v_scales)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2  # bf16 out: one rounding of the fp32 result
    for r, w in want.items():
        torch.testing.assert_close(out[r].double(), w, atol=tol, rtol=tol, msg=lambda m: f"row {r}: {m}")
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == SENTINEL).all(), "the kernel wrote rows it was not given"


def test_fp8_kernel_matches_the_native_kernel_on_written_caches():
    """The two fp8 readers on the same cache, written through the scheme's writer: within fp32 rounding."""
    from services.engine.kernels import attention_native
    from services.engine.kernels.kv_fp8 import Fp8WritePlan, write_fp8_kv

    gen = torch.Generator().manual_seed(5)
    bs, kvh, group, d, ctx = 4, 2, 3, 24, [1, 7, 13]
    k = torch.zeros(12, bs, kvh, d, dtype=torch.float8_e4m3fn)
    v = torch.zeros_like(k)
    ks, vs = torch.zeros(12, kvh), torch.zeros(12, kvh)
    tables = torch.tensor([[0, 0, 0, 0], [1, 2, 0, 0], [3, 4, 5, 6]])
    for b, n in enumerate(ctx):
        pos = torch.arange(n)
        slots = tables[b, pos // bs] * bs + pos % bs
        plan = Fp8WritePlan.build(slots, bs)
        write_fp8_kv(k, ks, torch.randn(n, kvh, d, generator=gen) * 4, plan)
        write_fp8_kv(v, vs, torch.randn(n, kvh, d, generator=gen), plan)
    q = torch.randn(3, kvh * group, d, generator=gen)
    outs = []
    for kernel in (KERNEL, attention_native.load()):
        out = torch.zeros_like(q)
        kernel.decode(q, out, k, v, torch.arange(3), torch.tensor(ctx), tables, scale=0.2, window=None,
                      num_threads=1, k_scales=ks, v_scales=vs)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_the_wrapper_refuses_bad_operands():
    c = dict(kv_heads=2, group=2, head_dim=8, block_size=4, ctx=[3, 9], window=None, cache="fp8", extra_rows=0,
             q_pad=0, share=False, seed=1)
    q, k, v, ks, vs, rows, ctx, tables = build(c)
    ok = dict(q=q, k=k, v=v, ks=ks, vs=vs, rows=rows, ctx=ctx, tables=tables)

    def refused(match, **kw):
        a = {**ok, **kw}
        out = torch.full(a["q"].shape, SENTINEL, dtype=a["q"].dtype)
        with pytest.raises(ValueError, match=match):
            KERNEL.decode(a["q"], out, a["k"], a["v"], a["rows"], a["ctx"], a["tables"], scale=0.3, window=None,
                          k_scales=a["ks"], v_scales=a["vs"])
        assert (out == SENTINEL).all()

    refused("q must be a 3-D", q=q.double())
    refused("unit head-dim stride", q=q.transpose(1, 2).contiguous().transpose(1, 2))
    refused("k_scales must be fp32", ks=None)
    refused("v_scales must be fp32", vs=vs[:, :1])
    refused("k_scales must be fp32", ks=ks.half())
    refused("differ in dtype, shape or strides", v=torch.randn(v.shape))
    refused("scales are for an fp8 cache", k=torch.randn(k.shape), v=torch.randn(v.shape))
    refused("in q's dtype", k=torch.randn(k.shape).half(), v=torch.randn(v.shape).half(), ks=None, vs=None)
    refused("do not fit q", q=torch.randn(q.shape[0], 3, 8))  # 3 query heads over 2 kv heads
    refused("power of two", k=k[:, :3], v=v[:, :3])
    refused("int64", rows=rows.int())
    refused("int64", tables=tables.float())
    refused("differ", ctx=ctx[:1])
    refused("contiguous", rows=torch.arange(4)[::2])
    refused("unit column stride", tables=tables.t().contiguous().t())
    for bad in (0, 6, -4, 4.0):
        out = torch.full(q.shape, SENTINEL, dtype=q.dtype)
        with pytest.raises(ValueError, match="partition_tokens must be a positive multiple"):
            KERNEL.decode(q, out, k, v, rows, ctx, tables, scale=0.3, window=None, k_scales=ks, v_scales=vs,
                          partition_tokens=bad)
    # And the call itself works, also with no sequences.
    out = torch.zeros_like(q)
    KERNEL.decode(q, out, k, v, rows, ctx, tables, scale=0.3, window=None, k_scales=ks, v_scales=vs)
    KERNEL.decode(q, out, k, v, rows[:0], ctx[:0], tables[:0], scale=0.3, window=None, k_scales=ks, v_scales=vs)


@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernel_compiles_for_cuda(arch, tmp_path):
    """No GPU here, but Triton can still lower the kernel to cubin: catches what the interpreter lets through."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "compile_cuda_decode_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # PYTHONPATH: a script's sys.path starts at its own folder, so `services` would otherwise come from
    # wherever the environment installed the project, not from this checkout.
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": repo}
    res = subprocess.run([sys.executable, script, str(arch)], env=env, cwd=repo, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(res.stdout.splitlines()) == 5


def test_the_engine_decodes_through_the_triton_kernel_to_the_native_kernels_tokens(demo_kit):
    """The engine's CUDA decode path (DecodeGroup -> TritonDecodeAttention, fp8 cache written by torch), run
    interpreted on the CPU, against the native CPU path: the same greedy tokens (both read the same fp8
    bytes; their fp32 sums differ only by rounding)."""
    from services.engine.sequence import SamplingParams
    from tests.engine.conftest import make_engine, run_all
    from tests.engine.test_kv_fp8_engine import _prompts

    # Three prompts, six tokens: every interpreted kernel call costs seconds, in proportion to the cache blocks it
    # reads (the whole prompts, 82/142/21 tokens, made this the suite's longest test: 172 s alone). Mixed lengths,
    # a partial last block and several decode steps per sequence are what the comparison needs.
    prompts = [p[:n] for p, n in zip(_prompts(demo_kit, n=3, seed=3), (29, 14, 21))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [{"id": f"r{i}", "prompt": p, "params": params} for i, p in enumerate(prompts)]
    native = make_engine(demo_kit.base_dir, kv_dtype="fp8", block_size=8)
    triton_engine = make_engine(demo_kit.base_dir, kv_dtype="fp8", block_size=8, cpu_attention="torch")
    triton_engine.runner.attention_kernel = KERNEL  # what LLMEngine picks on CUDA for an fp8 cache
    assert run_all(triton_engine, reqs) == run_all(native, reqs)
