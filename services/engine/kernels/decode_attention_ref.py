"""Pure-torch paged decode attention: the definition the Triton kernel (decode_attention_triton.py) is tested
against, and what it computes.

For sequence b (query row rows[b], ctx_lens[b] cached tokens including this step's) and query head h (kv
head h // (H // KVH)): out[rows[b], h] = softmax(scale * q . K[j] for j in [lo, ctx)) . V, with
lo = ctx - window under a sliding window (else 0) and K[j] / V[j] at cache[table[b][j // block_size],
j % block_size, kv head]. An fp8 cache is read through kv_fp8.dequantize (its scales per block and kv head).
"""
from __future__ import annotations

import torch

from services.engine.kernels.kv_fp8 import FP8_KV_DTYPE, dequantize


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    tables: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[int, torch.Tensor]:
    """{query row: [H, D] in `dtype`}: one sequence at a time, no batching, no online softmax."""
    if k_cache.dtype == FP8_KV_DTYPE:
        keys_all, values_all = dequantize(k_cache, k_scales, dtype), dequantize(v_cache, v_scales, dtype)
    else:
        keys_all, values_all = k_cache.to(dtype), v_cache.to(dtype)
    _, block_size, kv_heads, _ = k_cache.shape
    kv_of_head = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // kv_heads)
    out = {}
    for b in range(rows.shape[0]):
        ctx = int(ctx_lens[b])
        lo = max(0, ctx - window) if window else 0
        pos = torch.arange(lo, ctx, device=q.device)
        blocks = tables[b, pos // block_size]
        keys = keys_all[blocks, pos % block_size][:, kv_of_head]  # [L, H, D]
        values = values_all[blocks, pos % block_size][:, kv_of_head]
        scores = scale * torch.einsum("hd,lhd->hl", q[int(rows[b])].to(dtype), keys)
        out[int(rows[b])] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out
