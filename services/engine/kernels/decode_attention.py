"""Paged decode attention on CUDA: the Triton kernel (decode_attention_triton.py) behind a checked entry
point with the native CPU kernel's interface (model/attention.py's DecodeKernel).

The engine uses it for decode rows when the KV cache is fp8: each sequence's keys and values are read in
place through its block table and dequantized in registers, instead of gathering a padded, dequantized
copy for SDPA. It also reads a plain fp32/fp16/bf16 cache. The torch reference beside it
(decode_attention_ref.py) is its test oracle. On CPU tensors it runs only under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import functools

import torch

from services.engine.kernels.kv_fp8 import FP8_KV_DTYPE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Context tokens per program (flash-decoding's split): contexts longer than this are cut into partitions that
# run in parallel and are merged by a second kernel; shorter ones take the one-kernel path.
PARTITION_TOKENS = 256


@functools.cache
def _kernels():
    # Imported on first use so that importing the engine never imports triton (and tests can set
    # TRITON_INTERPRET before the kernel is decorated).
    from services.engine.kernels import decode_attention_triton

    return decode_attention_triton


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().paged_decode_kernel, InterpretedFunction)


class TritonDecodeAttention:
    """`decode` is the checked entry point (the same contract as NativeAttention.decode)."""

    def decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        ctx_lens: torch.Tensor,
        tables: torch.Tensor,
        *,
        scale: float,
        window: int | None,
        num_threads: int = 1,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        partition_tokens: int = PARTITION_TOKENS,
    ) -> None:
        """out[rows[b]] = attention of q[rows[b]] over the first ctx_lens[b] cached tokens of sequence b.

        q, out [T, H, D] (fp32/fp16/bf16, one dtype) with unit head-dim stride (row and head strides free);
        caches [num_blocks, block_size, KVH, D] with unit inner stride, in q's dtype or float8_e4m3fn with
        k_scales, v_scales [num_blocks, KVH] fp32 (unit head stride); rows, ctx_lens [B] and tables
        [B, width] int64 on q's device, 1 <= ctx_lens[b] <= width * block_size. Block ids and rows are not
        bounds-checked on the device (that would sync): the engine's plan makes them. num_threads is unused.
        partition_tokens (a positive multiple of the block size): contexts that can be longer -- by the block
        table's width, known here without a sync -- are split into partitions of that many tokens."""
        fp8 = _check(q, out, k_cache, v_cache, rows, ctx_lens, tables, k_scales, v_scales)
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        if not isinstance(partition_tokens, int) or partition_tokens <= 0 or partition_tokens % block_size:
            raise ValueError(f"partition_tokens must be a positive multiple of block_size={block_size}, "
                             f"got {partition_tokens!r}")
        n = rows.shape[0]
        if n == 0:
            return
        group = q.shape[1] // kv_heads
        interpreted = not q.is_cuda
        if interpreted and not _interpreted():
            raise ValueError("the Triton decode kernel on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
        # The interpreter truncates fp32 -> bf16/fp16 casts instead of rounding: stage the result in fp32.
        dst = torch.empty(out.shape, dtype=torch.float32) if interpreted and out.dtype != torch.float32 else out
        if fp8:
            k_arg, v_arg, ks, vs = k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scales, v_scales
            stride_sb = k_scales.stride(0)
        else:
            k_arg, v_arg, ks, vs, stride_sb = k_cache, v_cache, k_cache, v_cache, 0  # scales unused
        parts = -(-tables.shape[1] * block_size // partition_tokens)
        group_pad, d_pad = triton_next_pow2(group), triton_next_pow2(head_dim)
        if parts > 1:
            pm = torch.empty(n, kv_heads, parts, group_pad, dtype=torch.float32, device=q.device)
            pl = torch.empty_like(pm)
            pacc = torch.empty(n, kv_heads, parts, group_pad, d_pad, dtype=torch.float32, device=q.device)
        else:
            pm = pl = pacc = dst  # unused
        shapes = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad)
        _kernels().paged_decode_kernel[(n, kv_heads, parts)](
            q, dst, k_arg, v_arg, ks, vs, rows, ctx_lens, tables, pm, pl, pacc,
            float(scale), int(window or 0), partition_tokens,
            q.stride(0), q.stride(1), dst.stride(0), dst.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, tables.stride(0),
            BLOCK_SIZE=block_size, FP8=fp8, HAS_WINDOW=bool(window), SPLIT=parts > 1, **shapes,
        )
        if parts > 1:
            _kernels().combine_kernel[(n, kv_heads)](dst, rows, pm, pl, pacc, parts, dst.stride(0), dst.stride(1),
                                                     **shapes)
        if dst is not out:
            sel = rows.long()
            out[sel] = dst[sel].to(out.dtype)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(q, out, k_cache, v_cache, rows, ctx_lens, tables, k_scales, v_scales) -> bool:
    """Raises ValueError naming the bad operand; returns True for an fp8 cache."""
    dev = q.device
    for name, t in (("q", q), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a 3-D fp32/fp16/bf16 tensor, got {_describe(t)}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a unit head-dim stride, got strides {t.stride()}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}")
    if q.shape != out.shape or q.dtype != out.dtype:
        raise ValueError(f"q {q.dtype} {tuple(q.shape)} and out {out.dtype} {tuple(out.shape)} differ")
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.device != dev:
            raise ValueError(f"{name} must be a 4-D tensor on {dev}, got {_describe(t)}")
        if t.dtype not in (q.dtype, FP8_KV_DTYPE):
            raise ValueError(f"{name} must be in q's dtype ({q.dtype}) or {FP8_KV_DTYPE}, got {t.dtype}")
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have a unit head-dim stride, got strides {t.stride()}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache {v_cache.dtype} "
                         f"{tuple(v_cache.shape)} differ in dtype, shape or strides")
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if head_dim != q.shape[2] or q.shape[1] % kv_heads:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)} (head width, heads per kv head)")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if fp8:
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (num_blocks, kv_heads)
                    or t.device != dev or t.stride(1) != 1):
                raise ValueError(f"{name} must be fp32 [{num_blocks}, {kv_heads}] on {dev} with a unit head stride, "
                                 f"got {_describe(t)}")
        if k_scales.stride() != v_scales.stride():
            raise ValueError("k_scales and v_scales must have the same strides")
    elif k_scales is not None or v_scales is not None:
        raise ValueError(f"scales are for an fp8 cache; this cache is {k_cache.dtype}")
    for name, t, dims in (("rows", rows, 1), ("ctx_lens", ctx_lens, 1), ("tables", tables, 2)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != dims or t.device != dev:
            raise ValueError(f"{name} must be a {dims}-D int64 tensor on {dev}, got {_describe(t)}")
    for name, t in (("rows", rows), ("ctx_lens", ctx_lens)):
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if tables.numel() and tables.stride(1) != 1:
        raise ValueError(f"tables must have a unit column stride, got strides {tables.stride()}")
    if not rows.shape[0] == ctx_lens.shape[0] == tables.shape[0]:
        raise ValueError(f"rows {rows.shape[0]}, ctx_lens {ctx_lens.shape[0]} and tables {tables.shape[0]} differ")
    return fp8


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} strides {t.stride()}" if isinstance(t, torch.Tensor) else type(t).__name__
