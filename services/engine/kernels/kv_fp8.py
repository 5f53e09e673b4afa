"""FP8 (e4m3) paged KV cache: the quantization scheme, its torch write path, and dequantizing reads.

A layer's K (and V) cache is [num_blocks, block_size, kv_heads, head_dim] float8_e4m3fn beside a scale
tensor [num_blocks, kv_heads] fp32: one scale per (block, kv head), indexed by block id in dim 0 like the
cache itself, so a block copy or swap moves both alike.

The scheme, chosen so that a block's bytes depend only on the tokens in it -- never on how they were
split over steps (chunked prefill, decode, recompute after preemption) nor on what else ran in the batch:

- **Scale**: s = 2^k, the smallest power of two with amax < 448 s, amax over the values (of that kv head)
  written to the block so far. A new token that raises amax past the scale raises it (to a power of two).
- **Value**: x is stored as the e4m3 code of x / s *truncated toward zero* (the largest e4m3 magnitude
  <= |x/s|), and read as the midpoint of its interval, e4m3(c) + ulp(c)/2 with c's sign. That is
  round-to-nearest onto the midpoint grid: the same half-ulp bound as round-to-nearest, no bias.
- **Rescale**: when a block's scale rises from s to s' = 2^j s, its earlier codes are truncated again onto
  the coarser grid. At power-of-two scales the e4m3 grids are nested (2E is a subset of E within range),
  and truncation toward zero onto nested grids composes: trunc_s'(trunc_s(x)) == trunc_s'(x). So a block
  written token by token holds exactly the bytes of the same block written at once (round-to-nearest
  would not: rounding twice differs from rounding once at ties).

The e4m3 "NaN" code and 448 are never written (|x/s| < 448 truncates to at most 416). Decoding uses
integer bit moves, never torch's fp8 conversion (whose round trip would read codes as their lower bound).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
MAX_EXP = 127  # scale exponents are clamped to [MIN_EXP, MAX_EXP]; non-finite amax gives MAX_EXP
MIN_EXP = -126  # an all-zero run gets the smallest scale, so it never dominates a later max


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """k with 2^k the smallest power of two such that amax < 448 * 2^k (int32, same shape).

    amax = m 2^e with m in [0.5, 1) and 448 = 0.875 * 2^9: amax < 448 2^k holds for k = e - 9 when
    m < 0.875, else for k = e - 8. Exact integer arithmetic, so the C writer computes the same k.
    """
    a = amax.float()
    m, e = torch.frexp(a)
    k = e - 9 + (m >= 0.875).to(torch.int32)
    k = torch.where(a > 0, k, torch.full_like(k, MIN_EXP))
    k = torch.where(torch.isfinite(a), k, torch.full_like(k, MAX_EXP))
    return k.clamp_(MIN_EXP, MAX_EXP)


def scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale for a run of values with this amax (fp32, same shape)."""
    k = scale_exponent(amax)
    return torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)


def quantize_trunc(y: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of fp32 y (|y| < 448) truncated toward zero onto the e4m3 grid."""
    bits = y.float().contiguous().view(torch.int32)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    e32 = mag >> 23
    # |y| >= 2^-6 (e4m3 normal): e4m3 exponent = e32 - 127 + 7, and the top 3 mantissa bits (truncated).
    normal = (((e32 - 120) << 3) | ((mag >> 20) & 7)).clamp_(max=0x7E)
    # |y| < 2^-6 (subnormal): multiples of 2^-9, truncated.
    sub = (y.float().abs() * 512).to(torch.int32).clamp_(0, 7)
    return (torch.where(e32 >= 121, normal, sub) | sign).to(torch.uint8)


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 value a code stands for at scale 1: the midpoint of its truncation interval.

    Bit moves: e4m3's 7 exponent+mantissa bits at the bottom of fp16's exponent and top of its mantissa
    give the code's value / 256 (as in kernels/fp8.py), and the next mantissa bit adds half an ulp --
    for subnormal codes too (fp16's subnormal grid continues e4m3's). Never NaN or Inf, whatever the byte.
    """
    u = codes.view(torch.uint8).to(torch.int16)
    half = ((u & 0x7F) << 7) | ((u & 0x80) << 8) | 0x40
    return half.view(torch.float16).float() * 256.0


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [n, block_size, kv_heads, D] with scales [n, kv_heads] -> values [n, block_size, kv_heads, D]."""
    return (decode_codes(codes) * scales[:, None, :, None]).to(dtype)


def gather_dequant(cache: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `block_ids` (any shape, flattened) of an fp8 cache, dequantized: [len, block_size, H, D]."""
    flat = block_ids.reshape(-1)
    # Gathered as bytes: indexing ops do not all take fp8 dtypes on every device.
    return dequantize(cache.view(torch.uint8).index_select(0, flat), scales.index_select(0, flat), dtype)


@dataclass(slots=True)
class Fp8WritePlan:
    """How a step's new tokens fall into cache blocks; the same for every layer, K and V, so built once.

    Tokens of one block are consecutive rows of the flattened batch (one sequence's positions in order),
    so the step's writes are runs: run r covers rows with run_of_row == r, in block run_block[r]; a run
    starting at offset 0 (`fresh`) starts its block afresh (the block's old scale belongs to a former
    owner)."""

    slot_mapping: torch.Tensor  # [T]
    run_of_row: torch.Tensor  # [T]
    run_block: torch.Tensor  # [U]
    fresh: torch.Tensor  # [U] bool

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_size: int) -> "Fp8WritePlan":
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        starts = torch.ones_like(blocks, dtype=torch.bool)
        starts[1:] = blocks[1:] != blocks[:-1]
        run_of_row = torch.cumsum(starts, 0) - 1
        return cls(slot_mapping, run_of_row, blocks[starts], (slot_mapping[starts] % block_size) == 0)


def write_fp8_kv(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, plan: Fp8WritePlan) -> None:
    """Write rows x [T, kv_heads, D] into their slots of an fp8 cache, updating the blocks' scales.

    The definition of the scheme above, and the write path everywhere the native CPU writer is not used.
    A block whose scale rises is re-truncated whole (slots past its fill hold bytes nobody reads)."""
    if x.shape[0] == 0:
        return
    _, block_size, heads, dim = cache.shape
    codes = cache.view(torch.uint8)
    n_runs = plan.run_block.shape[0]
    amax = torch.zeros(n_runs, heads, dtype=torch.float32, device=x.device)
    row_amax = x.detach().abs().amax(-1).float()
    amax.scatter_reduce_(0, plan.run_of_row[:, None].expand(-1, heads), row_amax, "amax")
    old = torch.where(plan.fresh[:, None], torch.zeros((), device=x.device), scales.index_select(0, plan.run_block))
    new = torch.maximum(old, scale_for(amax))
    grown_run, grown_head = ((new > old) & ~plan.fresh[:, None]).nonzero(as_tuple=True)
    if grown_run.numel():
        blk = plan.run_block[grown_run]
        ratio = (old[grown_run, grown_head] / new[grown_run, grown_head])[:, None, None]  # 2^-j, exact
        lower = codes[blk, :, grown_head].view(FP8_KV_DTYPE).float()  # [G, block_size, D]: interval lower bounds
        codes[blk, :, grown_head] = quantize_trunc(lower * ratio)
    scales.index_copy_(0, plan.run_block, new)
    y = x.float() / new.index_select(0, plan.run_of_row)[:, :, None]
    codes.view(-1, heads, dim).index_copy_(0, plan.slot_mapping, quantize_trunc(y))
