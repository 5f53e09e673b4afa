"""The fp8 KV cache scheme (kernels/kv_fp8.py): codes, scales, round-trip bounds, the exactness that makes a
block's bytes independent of how its tokens were split over steps, and the native writer byte for byte."""
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.engine.kernels import attention_native
from services.engine.kernels.kv_fp8 import (FP8_KV_DTYPE, Fp8WritePlan, decode_codes, dequantize, quantize_trunc,
                                            scale_for, write_fp8_kv)

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
E4M3 = ALL_CODES.view(FP8_KV_DTYPE).float()  # torch's (standard) value of every code
GRID = E4M3[torch.isfinite(E4M3) & (E4M3 >= 0)].unique().sort().values  # 0 .. 448


def trunc_brute(y: torch.Tensor) -> torch.Tensor:
    """The largest e4m3 magnitude <= |y|, with y's sign: by search over the grid."""
    idx = torch.searchsorted(GRID, y.abs(), right=True) - 1
    return GRID[idx] * torch.where(y < 0, -1.0, 1.0)


def test_every_code_decodes_to_the_midpoint_of_its_interval():
    mid = decode_codes(ALL_CODES)
    assert torch.isfinite(mid).all()  # whatever byte a stale slot holds
    for c in range(256):
        mag = c & 0x7F
        if mag >= 0x7E:  # 448 and NaN: never written
            continue
        lo, hi = GRID[mag], GRID[mag + 1]
        sign = -1.0 if c & 0x80 else 1.0
        assert mid[c] == sign * (lo + hi) / 2, c


def test_truncation_matches_the_grid_and_stays_within_half_an_ulp():
    gen = torch.Generator().manual_seed(0)
    y = torch.cat([(torch.rand(50_000, generator=gen) * 2 - 1) * 447.99, torch.randn(20_000, generator=gen) * 0.02,
                   GRID[:-1], -GRID[:-1], torch.tensor([0.0, -0.0, 2.0**-10, 447.999])])
    codes = quantize_trunc(y)
    assert (codes & 0x7F).max() <= 0x7D  # |y| < 448 never reaches 448 (0x7E) or NaN (0x7F)
    lower = codes.view(FP8_KV_DTYPE).float()
    assert torch.equal(lower.abs(), trunc_brute(y).abs())
    mid = decode_codes(codes)
    half_ulp = mid.abs() - lower.abs()
    assert ((mid - y).abs() <= half_ulp).all()
    # Relative bound for normal values (3 mantissa bits: half an ulp <= 2^-4 of the value), absolute below.
    normal = y.abs() >= 2.0**-6
    assert ((mid - y).abs()[normal] <= y.abs()[normal] * 2.0**-4).all()
    assert ((mid - y).abs()[~normal] <= 2.0**-10).all()


@settings(max_examples=200, deadline=None)
@given(amax=st.floats(min_value=1e-37, max_value=1e37, allow_nan=False, allow_infinity=False))
def test_the_scale_is_the_smallest_power_of_two_that_fits(amax):
    a = torch.tensor([amax], dtype=torch.float32)
    s = scale_for(a)
    mantissa, _ = torch.frexp(s)
    assert mantissa.item() == 0.5  # a power of two
    assert a.item() < 448 * s.item()
    assert a.item() >= 224 * s.item() or s.item() == 2.0**-126  # the next smaller one would not fit


def test_scales_of_zero_and_non_finite_runs():
    s = scale_for(torch.tensor([0.0, float("nan"), float("inf")]))
    assert s.tolist() == [2.0**-126, 2.0**127, 2.0**127]


@settings(max_examples=200, deadline=None)
@given(x=st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), j=st.integers(1, 12),
       k=st.integers(-20, 20))
def test_truncation_at_power_of_two_scales_composes(x, j, k):
    """trunc onto the 2^j s grid of (trunc onto the s grid of x) == trunc onto the 2^j s grid of x: the
    grids are nested. This is what makes rescaling a block exact."""
    s, s2 = 2.0**k, 2.0 ** (k + j)
    y = torch.tensor([x], dtype=torch.float32)
    assume(abs(x) < 448 * s)
    once = quantize_trunc(y / s2)
    twice = quantize_trunc(quantize_trunc(y / s).view(FP8_KV_DTYPE).float() * (s / s2))
    assert torch.equal(once, twice)


def _fill_plan(block_size: int, rng: random.Random, n_blocks: int):
    """Blocks written by a few sequences over several steps: a list of steps, each a list of slots."""
    fills = {b: 0 for b in rng.sample(range(n_blocks), min(4, n_blocks))}
    order = list(fills)
    steps = []
    while any(f < block_size for f in fills.values()):
        slots = []
        for b in order:  # each sequence writes one run per step (one block here)
            if fills[b] < block_size and rng.random() < 0.7:
                n = rng.randint(1, block_size - fills[b])
                slots += [b * block_size + fills[b] + i for i in range(n)]
                fills[b] += n
        if slots:
            steps.append(slots)
    return steps


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4, 16]), heads=st.integers(1, 3),
       dim=st.sampled_from([1, 5, 8, 24]))
def test_a_block_holds_the_same_bytes_however_its_tokens_were_split(seed, block_size, heads, dim):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_blocks = 6
    steps = _fill_plan(block_size, rng, n_blocks)
    slots = [s for step in steps for s in step]
    # Magnitudes spread over orders of magnitude so that later tokens raise their block's scale.
    values = {s: torch.randn(heads, dim, generator=gen) * float(torch.exp(torch.randn((), generator=gen) * 3))
              for s in slots}

    def written(batches):
        cache = torch.randint(0, 256, (n_blocks, block_size, heads, dim), dtype=torch.uint8, generator=gen)
        cache = cache.view(FP8_KV_DTYPE)
        scales = torch.rand(n_blocks, heads, generator=gen) * 1e3  # stale: a fresh block must ignore them
        for batch in batches:
            sm = torch.tensor(batch)
            write_fp8_kv(cache, scales, torch.stack([values[s] for s in batch]), Fp8WritePlan.build(sm, block_size))
        blocks = sorted({s // block_size for s in slots})
        return cache.view(torch.uint8).view(-1, heads, dim)[slots], scales[blocks]

    # Sorted by block, each block's tokens in one write: the reference.
    whole = written([sorted(slots)])
    stepwise = written(steps)
    token_by_token = written([[s] for s in slots])
    assert torch.equal(whole[0], stepwise[0]) and torch.equal(whole[1], stepwise[1])
    assert torch.equal(whole[0], token_by_token[0]) and torch.equal(whole[1], token_by_token[1])


def test_written_values_round_trip_within_half_an_ulp_of_their_blocks_scale():
    gen = torch.Generator().manual_seed(3)
    block_size, heads, dim = 8, 2, 16
    cache = torch.zeros(4, block_size, heads, dim, dtype=FP8_KV_DTYPE)
    scales = torch.zeros(4, heads)
    x = torch.randn(2 * block_size, heads, dim, generator=gen) * torch.logspace(-2, 2, 2 * block_size)[:, None, None]
    slots = torch.cat([torch.arange(8, 16), torch.arange(24, 32)])
    for t in range(x.shape[0]):  # decode-like: one token per step
        write_fp8_kv(cache, scales, x[t : t + 1], Fp8WritePlan.build(slots[t : t + 1], block_size))
    back = dequantize(cache, scales).reshape(-1, heads, dim)[slots]
    s = scales[slots // block_size][:, :, None]  # each value's block scale
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)).all()
    for b in (1, 3):  # the scale fits the block's amax per head, tightly
        amax = x[(slots // block_size) == b].abs().amax(dim=(0, 2))
        assert (amax < 448 * scales[b]).all() and (amax >= 224 * scales[b]).all()


def test_a_block_restarted_at_offset_zero_drops_its_old_scale():
    """A block freed and reused (or recomputed after preemption) starts afresh: the old owner's scale is
    not carried over (it would make the new contents coarser than the same tokens elsewhere)."""
    block_size, heads, dim = 4, 1, 8
    cache = torch.zeros(2, block_size, heads, dim, dtype=FP8_KV_DTYPE)
    scales = torch.zeros(2, heads)
    big, small = torch.full((block_size, heads, dim), 1000.0), torch.full((block_size, heads, dim), 0.01)
    slots = torch.arange(block_size)
    write_fp8_kv(cache, scales, big, Fp8WritePlan.build(slots, block_size))
    write_fp8_kv(cache, scales, small, Fp8WritePlan.build(slots, block_size))
    assert scales[0, 0] == scale_for(torch.tensor(0.01))
    torch.testing.assert_close(dequantize(cache, scales)[0], small, rtol=2**-4, atol=0)


@pytest.fixture(scope="module")
def native():
    return attention_native.load()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4, 16]), heads=st.integers(1, 3),
       dim=st.sampled_from([1, 5, 8, 24, 33]), threads=st.sampled_from([1, 2]), pad=st.sampled_from([0, 7]))
def test_the_native_writer_writes_the_bytes_of_the_torch_writer(native, seed, block_size, heads, dim, threads, pad):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_blocks = 6
    steps = _fill_plan(block_size, rng, n_blocks)
    shape = (n_blocks, block_size, heads, dim)
    stale = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(FP8_KV_DTYPE)
    stale_scales = torch.rand(n_blocks, heads, generator=gen)
    ours = [stale.clone(), stale_scales.clone(), stale.clone(), stale_scales.clone()]
    theirs = [t.clone() for t in ours]
    for step in steps:
        n = len(step)
        sm = torch.tensor(step)
        mag = torch.exp(torch.randn(n, 1, 1, generator=gen) * 3)
        # k and v as column windows of wider rows (as they come out of the fused qkv projection)
        k = (torch.randn(n, heads * dim + pad, generator=gen) * mag[:, :, 0])[:, pad:].view(n, heads, dim)
        v = torch.randn(n, heads, dim, generator=gen)
        native.write_fp8(ours[0], ours[1], ours[2], ours[3], k, v, sm, num_threads=threads)
        plan = Fp8WritePlan.build(sm, block_size)
        write_fp8_kv(theirs[0], theirs[1], k, plan)
        write_fp8_kv(theirs[2], theirs[3], v, plan)
    slots = [s for step in steps for s in step]
    blocks = sorted({s // block_size for s in slots})
    for a, b in ((ours[0], theirs[0]), (ours[2], theirs[2])):
        assert torch.equal(a.view(torch.uint8).view(-1, heads, dim)[slots], b.view(torch.uint8).view(-1, heads, dim)[slots])
    for a, b in ((ours[1], theirs[1]), (ours[3], theirs[3])):
        assert torch.equal(a[blocks], b[blocks])


def test_the_native_writer_refuses_what_it_cannot_write_safely(native):
    block_size, heads, dim = 4, 2, 8
    cache = torch.zeros(3, block_size, heads, dim, dtype=FP8_KV_DTYPE)
    scales = torch.zeros(3, heads)
    x = torch.randn(3, heads, dim)

    def refused(match, slots, **kw):
        args = dict(k_cache=cache.clone(), k_scales=scales.clone(), v_cache=cache.clone(), v_scales=scales.clone(),
                    k=x[: len(slots)], v=x[: len(slots)])
        args.update(kw)
        before = [t.clone() for t in (args["k_cache"], args["k_scales"])]
        with pytest.raises(ValueError, match=match):
            native.write_fp8(args["k_cache"], args["k_scales"], args["v_cache"], args["v_scales"], args["k"], args["v"],
                             torch.tensor(slots, dtype=torch.int64), num_threads=2)
        assert torch.equal(args["k_cache"].view(torch.uint8), before[0].view(torch.uint8))
        assert torch.equal(args["k_scales"], before[1])

    refused("slot is outside", [0, 12])
    refused("slot is outside", [-1])
    refused("written by two runs", [0, 4, 1])  # block 0 twice: two sequences writing one block in a step
    refused("written by two runs", [0, 2])  # a run's slots must follow each other
    refused("fp32", [0], k=x[:1].double())
    refused("packed heads", [0], k=torch.randn(1, dim, heads).transpose(1, 2))
    refused("contiguous 4-D", [0], k_cache=torch.zeros(3, block_size, heads, dim))
    refused("k_scales must be", [0], k_scales=torch.zeros(3, heads + 1))
    refused("k_scales must be", [0], k_scales=torch.zeros(3, heads, dtype=torch.float64))
