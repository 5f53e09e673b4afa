"""SGMV shrink/expand: Triton kernels (interpreted) and the torch reference against a per-token oracle.

The oracle gathers every token's own adapter and contracts with einsum: no segments, no sorting,
so it checks the segment machinery rather than repeating it.
"""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.kernels import build_sgmv_meta, lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# -- oracle and factories ------------------------------------------------------------------------


def oracle_shrink(x, a, ranks, slots):
    """fp32 [T, R]: token t's row of x against its own adapter's first r rows of A; zero elsewhere."""
    used = slots.clamp(min=0).long()
    r_tok = torch.where(slots >= 0, ranks.long()[used], 0)
    keep = torch.arange(a.shape[1])[None, :] < r_tok[:, None]  # [T, R]
    return torch.einsum("th,trh->tr", x.float(), a[used].float()) * keep


def oracle_expand(v, b, ranks, slots, y, y_offset):
    used = slots.clamp(min=0).long()
    r_tok = torch.where(slots >= 0, ranks.long()[used], 0)
    keep = torch.arange(b.shape[2])[None, :] < r_tok[:, None]
    delta = torch.einsum("tr,tor->to", v.to(b.dtype).float() * keep, b[used].float())
    out = y.clone()
    sl = out[:, y_offset : y_offset + b.shape[1]]
    touched = r_tok > 0
    sl[touched] = (sl[touched].float() + delta[touched]).to(y.dtype)
    return out


def make_case(t, n, r_max, h_in, h_out, ranks, slots, dtype, seed=0, poison=True):
    """Random operands. With poison, weights past each slot's rank (all of a rank-0 slot) are NaN:
    a kernel that reads beyond an adapter's own rank turns its output NaN. Oracles take clean().

    The stacks and ranks are views one slot into larger buffers whose slot "-1" holds real weights
    and rank r_max, so a kernel that used slot -1 as an index would visibly change base-only rows.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h_in, generator=g).to(dtype)
    a = (torch.randn(n + 1, r_max, h_in, generator=g) / h_in**0.5).to(dtype)[1:]
    b = (torch.randn(n + 1, h_out, r_max, generator=g) / r_max**0.5).to(dtype)[1:]
    if poison:
        for s, r in enumerate(ranks):
            a[s, r:] = float("nan")
            b[s, :, r:] = float("nan")
    rank_buf = torch.tensor([r_max, *ranks], dtype=torch.int32)
    return x, a, b, rank_buf[1:], torch.as_tensor(slots, dtype=torch.int64)


def clean(w):
    return torch.nan_to_num(w, nan=0.0)


def random_slots(t, n, seed):
    return torch.randint(-1, n, (t,), generator=torch.Generator().manual_seed(seed))


# name: (T, N, R_max, H_in, H_out, ranks, slots). Sizes are chosen off the block sizes (64/16/32).
CASES = {
    "mixed_ranks": (37, 5, 24, 100, 70, [24, 0, 8, 17, 3], random_slots(37, 5, 1)),
    "multi_tile": (40, 3, 40, 130, 150, [33, 9, 40], torch.tensor([0] * 35 + [1, 2, -1, 1, 2])[torch.randperm(40, generator=torch.Generator().manual_seed(2))]),
    "single_token": (1, 4, 16, 33, 20, [4, 16, 7, 1], [2]),
    "all_base": (9, 3, 8, 40, 24, [8, 8, 8], [-1] * 9),
    "untargeted_only": (6, 3, 8, 40, 24, [8, 0, 8], [1] * 6),
    "one_adapter_in_order": (20, 2, 16, 48, 32, [5, 16], [1] * 20),
    "no_tokens": (0, 2, 8, 16, 16, [8, 4], []),
}


def expand_tol(dtype):
    # Accumulation order differs from the oracle's, so y may land one rounding step away.
    return {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}[dtype]


def check_case(case, dtype, backend, meta=None, device="cpu"):
    """The kernels on `device` (tests/cuda runs them compiled on a GPU) against the oracle on the CPU."""
    t, n, r_max, h_in, h_out, ranks, slots = case
    x, a, b, ranks, slots = make_case(t, n, r_max, h_in, h_out, ranks, slots, dtype)
    on = {k: w.to(device) for k, w in dict(x=x, a=a, b=b, ranks=ranks, slots=slots).items()}
    meta = meta or build_sgmv_meta(on["slots"])
    v = lora_shrink(on["x"], on["a"], on["ranks"], meta, backend=backend).cpu()
    want_v = oracle_shrink(x, clean(a), ranks, slots)
    assert v.dtype == torch.float32 and v.shape == (t, r_max)
    torch.testing.assert_close(v, want_v, rtol=1e-5, atol=1e-5)
    assert bool((v[want_v == 0] == 0).all())  # base rows, columns past the rank: exact zeros

    # Expand gets a v that is dense everywhere (base rows, columns past the rank): the contract says
    # those entries are ignored, and a zero v would hide a kernel that does not ignore them.
    g = torch.Generator().manual_seed(9)
    v = torch.randn(t, r_max, generator=g)
    y0 = torch.randn(t, h_out + 13, generator=g).to(dtype)
    y = y0.clone().to(device)
    lora_expand(v.to(device), on["b"], on["ranks"], meta, y, y_offset=7, backend=backend)
    y = y.cpu()
    want_y = oracle_expand(v, clean(b), ranks, slots, y0, 7)
    rtol, atol = expand_tol(dtype)
    torch.testing.assert_close(y, want_y, rtol=rtol, atol=atol)
    r_tok = torch.where(slots >= 0, ranks.long()[slots.clamp(min=0)], 0)
    untouched = r_tok == 0
    assert torch.equal(y[untouched], y0[untouched])  # base-only and untargeted rows: bit-identical
    assert torch.equal(y[:, :7], y0[:, :7]) and torch.equal(y[:, 7 + h_out :], y0[:, 7 + h_out :])


# -- correctness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_per_token_oracle(name, dtype, backend):
    check_case(CASES[name], dtype, backend)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 24).flatmap(
        lambda t: st.tuples(
            st.lists(st.integers(-1, 4), min_size=t, max_size=t),  # slots
            st.lists(st.integers(0, 12), min_size=5, max_size=5),  # ranks (R_max = 12)
            st.integers(1, 40),  # H_in
            st.integers(1, 40),  # H_out
            st.sampled_from(DTYPES),
        )
    )
)
def test_reference_matches_oracle_on_random_batches(args):
    slots, ranks, h_in, h_out, dtype = args
    check_case((len(slots), 5, 12, h_in, h_out, ranks, slots), dtype, "torch")


def with_empty_segments(meta, extra_slots):
    """The same grouping with zero-length segments inserted (kernels must skip them, not misread bounds)."""
    starts, slots = list(meta.starts_host), list(meta.slots_host)
    for pos, slot in extra_slots:
        starts.insert(pos, starts[pos])
        slots.insert(pos, slot)
    return dataclasses.replace(
        meta,
        seg_starts=torch.tensor(starts, dtype=torch.int32),
        seg_slots=torch.tensor(slots, dtype=torch.int32),
        starts_host=tuple(starts),
        slots_host=tuple(slots),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_segments_are_skipped(backend):
    case = CASES["mixed_ranks"]
    meta = with_empty_segments(build_sgmv_meta(torch.as_tensor(case[6])), [(0, 4), (2, 2), (4, 0)])
    assert meta.starts_host.count(meta.starts_host[2]) >= 2
    check_case(case, torch.float32, backend, meta=meta)


def test_triton_equals_reference_bf16_with_upcast():
    from services.engine.kernels.sgmv import _dot_flags

    assert _dot_flags(torch.bfloat16) == (True, "ieee")  # interpreted: bf16 tiles are widened before tl.dot
    t, n, r_max, h_in, h_out, ranks, slots = CASES["multi_tile"]
    x, a, b, ranks, slots = make_case(t, n, r_max, h_in, h_out, ranks, slots, torch.bfloat16, seed=5)
    meta = build_sgmv_meta(slots)
    v_tri = lora_shrink(x, a, ranks, meta, backend="triton")
    v_ref = lora_shrink_ref(x, a, ranks, meta, torch.empty(t, r_max))
    torch.testing.assert_close(v_tri, v_ref, rtol=1e-5, atol=1e-5)
    y_tri, y_ref = torch.zeros(t, h_out, dtype=torch.bfloat16), torch.zeros(t, h_out, dtype=torch.bfloat16)
    lora_expand(v_ref, b, ranks, meta, y_tri, backend="triton")
    lora_expand_ref(v_ref, b, ranks, meta, y_ref, 0)
    torch.testing.assert_close(y_tri, y_ref, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_operands_and_fused_output(backend):
    """x and v as column slices of wider tensors; q/k/v-style slices of one fused y updated in place."""
    t, n, r_max, h_in = 19, 3, 16, 72
    outs = (40, 24, 24)
    g = torch.Generator().manual_seed(3)
    ranks = torch.tensor([16, 6, 0], dtype=torch.int32)
    slots = torch.randint(-1, n, (t,), generator=g)
    meta = build_sgmv_meta(slots)
    x_wide = torch.randn(t, h_in + 5, generator=g)
    x = x_wide[:, 5:]  # row stride h_in + 5
    y = torch.randn(t, sum(outs), generator=g)
    want = y.clone()
    offset = 0
    for h_out in outs:
        a = torch.randn(n, r_max, h_in, generator=g) / h_in**0.5
        b = torch.randn(n, h_out, r_max, generator=g) / r_max**0.5
        v_wide = torch.zeros(t, r_max + 3)
        v = lora_shrink(x, a, ranks, meta, out=v_wide[:, 3:], backend=backend)
        assert v.data_ptr() == v_wide[:, 3:].data_ptr()
        lora_expand(v, b, ranks, meta, y, y_offset=offset, backend=backend)
        want = oracle_expand(oracle_shrink(x, a, ranks, slots), b, ranks, slots, want, offset)
        offset += h_out
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_out_is_overwritten_in_x_dtype(backend):
    t, n, r_max, h_in, h_out, ranks, slots = CASES["mixed_ranks"]
    x, a, _, ranks, slots = make_case(t, n, r_max, h_in, h_out, ranks, slots, torch.float16)
    out = torch.full((t, r_max), 7.0, dtype=torch.float16)  # stale values must not survive
    got = lora_shrink(x, a, ranks, build_sgmv_meta(slots), out=out, backend=backend)
    assert got is out
    torch.testing.assert_close(out.float(), oracle_shrink(x, clean(a), ranks, slots), rtol=1e-3, atol=1e-3)


def test_split_k_matches_single_pass():
    t, n, r_max, h_in, h_out, ranks, slots = CASES["multi_tile"]
    x, a, _, ranks, slots = make_case(t, n, r_max, h_in, h_out, ranks, slots, torch.float32)
    meta = build_sgmv_meta(slots)
    split = lora_shrink(x, a, ranks, meta, backend="triton", split_k=3)
    torch.testing.assert_close(split, oracle_shrink(x, clean(a), ranks, slots), rtol=1e-5, atol=1e-5)


# -- validation ----------------------------------------------------------------------------------


def valid_operands():
    t, n, r_max, h_in, h_out = 6, 3, 8, 16, 12
    x, a, b, ranks, slots = make_case(t, n, r_max, h_in, h_out, [8, 4, 0], [0, 1, -1, 2, 0, 1], torch.float32)
    return dict(x=x, a=a, b=b, ranks=ranks, meta=build_sgmv_meta(slots), v=torch.zeros(t, r_max), y=torch.zeros(t, h_out))


SHRINK_BAD = {
    "x 1-D": (dict(x=torch.zeros(16)), "x must be a 2-D"),
    "x int": (dict(x=torch.zeros(6, 16, dtype=torch.int32)), "x must have dtype"),
    "x rows": (dict(x=torch.zeros(5, 16)), "num_tokens=6"),
    "x features": (dict(x=torch.zeros(6, 15)), "H_in=16"),
    "a dtype": (dict(a=torch.zeros(3, 8, 16, dtype=torch.float16)), "lora_a has dtype"),
    "a 2-D": (dict(a=torch.zeros(8, 16)), "lora_a must be a 3-D"),
    "ranks int64": (dict(ranks=torch.zeros(3, dtype=torch.int64)), "ranks must be int32"),
    "ranks length": (dict(ranks=torch.zeros(4, dtype=torch.int32)), r"ranks must be a \[3\]"),
    "slot beyond stack": (dict(meta=build_sgmv_meta(torch.tensor([0, 1, 5, 0, 0, 0]))), "only 3 slots"),
    "out shape": (dict(out=torch.zeros(6, 7)), "out must be"),
    "out dtype": (dict(out=torch.zeros(6, 8, dtype=torch.float16)), "out must have dtype"),
    "out transposed": (dict(out=torch.zeros(8, 6).t()), "unit column stride"),
    "backend": (dict(backend="cuda"), "backend must be"),
    "meta not built": (dict(meta=torch.tensor([0, 1])), "SgmvMeta"),
    "split_k half out": (dict(x=torch.zeros(6, 16, dtype=torch.float16), a=torch.zeros(3, 8, 16, dtype=torch.float16), out=torch.zeros(6, 8, dtype=torch.float16), split_k=2), "split_k"),
}


@pytest.mark.parametrize("bad", list(SHRINK_BAD))
def test_shrink_rejects(bad):
    ops = valid_operands()
    change, match = SHRINK_BAD[bad]
    args = {"x": ops["x"], "a": ops["a"], "ranks": ops["ranks"], "meta": ops["meta"], "out": None, "backend": "torch", "split_k": None}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        lora_shrink(args["x"], args["a"], args["ranks"], args["meta"], args["out"], backend=args["backend"], split_k=args["split_k"])


EXPAND_BAD = {
    "v shape": (dict(v=torch.zeros(6, 9)), "v must be"),
    "v dtype": (dict(v=torch.zeros(6, 8, dtype=torch.float64)), "v must have dtype"),
    "b dtype vs y": (dict(b=torch.zeros(3, 12, 8, dtype=torch.bfloat16)), "lora_b has dtype"),
    "y rows": (dict(y=torch.zeros(5, 12)), "num_tokens=6 rows"),
    "y too narrow": (dict(y=torch.zeros(6, 11)), "does not fit"),
    "offset overflow": (dict(y=torch.zeros(6, 20), y_offset=9), "does not fit"),
    "negative offset": (dict(y_offset=-1), "does not fit"),
    "y column stride": (dict(y=torch.zeros(12, 6).t()), "unit column stride"),
    "y broadcast rows": (dict(y=torch.zeros(1, 12).expand(6, 12)), "unit column stride"),
    "ranks int64": (dict(ranks=torch.zeros(3, dtype=torch.int64)), "ranks must be int32"),
    "meta not built": (dict(meta=None), "SgmvMeta"),
}


@pytest.mark.parametrize("bad", list(EXPAND_BAD))
def test_expand_rejects(bad):
    ops = valid_operands()
    change, match = EXPAND_BAD[bad]
    args = {"v": ops["v"], "b": ops["b"], "ranks": ops["ranks"], "meta": ops["meta"], "y": ops["y"], "y_offset": 0}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        lora_expand(args["v"], args["b"], args["ranks"], args["meta"], args["y"], y_offset=args["y_offset"], backend="torch")


def test_triton_on_cpu_without_interpreter_is_refused():
    code = (
        "import torch\n"
        "from services.engine.kernels import build_sgmv_meta, lora_shrink\n"
        "meta = build_sgmv_meta(torch.tensor([0]))\n"
        "try:\n"
        "    lora_shrink(torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.ones(1, dtype=torch.int32), meta, backend='triton')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "refused:" in res.stdout and "TRITON_INTERPRET=1" in res.stdout


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_cuda(arch, tmp_path):
    """No GPU here, but Triton can still lower the kernels to cubin: catches what the interpreter lets through."""
    script = os.path.join(os.path.dirname(__file__), "compile_cuda_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    res = subprocess.run([sys.executable, script, str(arch)], env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == (6 if arch >= 89 else 5)
    assert all("tensor cores: True" in line for line in lines if "bf16" in line or "fp16" in line)
