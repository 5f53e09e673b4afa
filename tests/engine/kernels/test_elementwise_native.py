"""The native library's elementwise passes (kernels/attention_cpu_native.c: RMSNorm with the residual add, RoPE
with the K/V write) against the torch ops the decoder runs without them (model/layers.py, model/rope.py,
model/attention.py): RoPE, the residual add and the cache rows bit for bit, RMSNorm to rounding; their
refusals. The engine's greedy tokens with them are checked against the torch path in test_attention_native.py
and against transformers in the oracle tests."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.config import RopeConfig
from services.engine.kernels import attention_native
from services.engine.model.attention import cacheable
from services.engine.model.layers import rms_norm
from services.engine.model.rope import RotaryEmbedding


@pytest.fixture(scope="module")
def lib():
    return attention_native.load()


def _wide(n: int, width: int, pad: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """[n, width] with a row stride of width + pad (a column window, as a fused projection's slice is)."""
    return (torch.randn(n, width + pad, generator=gen) * scale)[:, :width]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 70), hidden=st.integers(1, 300), pad=st.sampled_from([0, 3]), with_delta=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_add_rms_norm_is_the_residual_add_then_hfs_rmsnorm(lib, n, hidden, pad, with_delta, scale, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    h = _wide(n, hidden, pad, gen, scale)
    d = _wide(n, hidden, 0, gen, scale) if with_delta else None
    w = torch.randn(hidden, generator=gen)
    want_h = h + d if with_delta else h.clone()
    want_x = rms_norm(want_h, w, 1e-6)
    x = lib.add_rms_norm(h, d, w, 1e-6, threads)
    assert torch.equal(h, want_h), "the residual add is torch's, in place"
    torch.testing.assert_close(x, want_x, rtol=2e-6, atol=1e-6 * float(w.abs().max()))


def _rope(head_dim: int, max_pos: int) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, max_pos, torch.float32, "cpu")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), heads=st.integers(1, 5), kv_heads=st.integers(1, 3), half=st.integers(1, 20),
       pad=st.sampled_from([0, 7]), threads=st.sampled_from([1, 2]), poison=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rope_write_kv_is_torchs_rope_and_cache_write_bit_for_bit(lib, n, heads, kv_heads, half, pad, threads, poison,
                                                                   seed):
    gen = torch.Generator().manual_seed(seed)
    d = 2 * half
    rope = _rope(d, 64)
    qkv = _wide(n, (heads + 2 * kv_heads) * d, pad, gen)
    if poison:  # what cacheable turns into 0 in the cache (q keeps it)
        qkv[0, -1] = float("nan")
        qkv[n - 1, heads * d] = float("inf")
        qkv[n // 2, (heads + kv_heads) * d] = 3e18
    positions = torch.randint(0, 64, (n,), generator=gen)
    block_size, blocks = 4, (n + 3) // 4 + 3
    slots = torch.randperm(blocks * block_size, generator=gen)[:n]
    k_cache = torch.full((blocks, block_size, kv_heads, d), 9.5)
    v_cache = torch.full((blocks, block_size, kv_heads, d), 9.5)
    # what the torch forward does: rotate q|k heads, write cacheable(k), cacheable(v) into the slots
    cos, sin = rope.tables(positions)
    qk = rope.rotate(qkv[:, : (heads + kv_heads) * d].reshape(n, heads + kv_heads, d), cos, sin)
    v = qkv[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, kv_heads, d).index_copy_(0, slots, cacheable(qk[:, heads:]))
    want_v.view(-1, kv_heads, d).index_copy_(0, slots, cacheable(v))
    want_qkv = torch.cat([qk.reshape(n, -1), v.reshape(n, -1)], dim=1)

    lib.rope_write_kv(qkv, heads, kv_heads, d, positions, rope.cos, rope.sin_signed, k_cache, v_cache, slots, threads)
    torch.testing.assert_close(qkv, want_qkv, rtol=0, atol=0, equal_nan=True)  # the same bits (NaN as NaN)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("bad", ["position", "negative position", "slot", "negative slot"])
def test_rope_write_kv_refuses_an_index_out_of_range_and_writes_nothing(lib, bad):
    rope = _rope(8, 16)
    qkv = torch.randn(3, (2 + 2) * 8)
    positions, slots = torch.tensor([0, 5, 15]), torch.tensor([1, 2, 7])
    if bad == "position":
        positions[1] = 16
    elif bad == "negative position":
        positions[2] = -1
    elif bad == "slot":
        slots[0] = 8
    else:
        slots[1] = -3
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    before = qkv.clone()
    with pytest.raises(ValueError, match="refused"):
        lib.rope_write_kv(qkv, 2, 1, 8, positions, rope.cos, rope.sin_signed, k_cache, v_cache, slots, 1)
    assert torch.equal(qkv, before) and not k_cache.any() and not v_cache.any()


def test_the_passes_refuse_misshapen_operands(lib):
    with pytest.raises(ValueError, match="weight"):
        lib.add_rms_norm(torch.randn(2, 8), None, torch.randn(7), 1e-6, 1)
    with pytest.raises(ValueError, match="delta"):
        lib.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6, 1)
    with pytest.raises(ValueError, match="h must"):
        lib.add_rms_norm(torch.randn(8, 2).t(), None, torch.randn(8), 1e-6, 1)
    with pytest.raises(ValueError, match="h must"):
        lib.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), None, torch.randn(8), 1e-6, 1)
    rope = _rope(8, 16)
    with pytest.raises(ValueError, match="qkv must"):
        lib.rope_write_kv(torch.randn(3, 30), 2, 1, 8, torch.zeros(3, dtype=torch.int64), rope.cos, rope.sin_signed,
                          torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="k_cache"):
        lib.rope_write_kv(torch.randn(3, 32), 2, 1, 8, torch.zeros(3, dtype=torch.int64), rope.cos, rope.sin_signed,
                          torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(3, dtype=torch.int64), 1)
