"""Triton SGMV shrink/expand kernels (Punica / S-LoRA style) for many LoRA adapters in one batch.

Grid: (segment, token tile, output tile). A program whose segment is base-only (slot -1), whose
adapter does not target the module (rank 0), or whose rank tile starts beyond the adapter's own
rank exits at once, and expand's K-loop stops at the adapter's rank: the work is proportional to
each adapter's rank, not to the slot stack's R_max. Host-side checks live in sgmv.py; import this
module only after TRITON_INTERPRET is decided (triton reads it when the kernels are decorated).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sgmv_shrink_kernel(
    x_ptr, a_ptr, out_ptr, ranks_ptr, token_idx_ptr, seg_starts_ptr, seg_slots_ptr,
    h_in, r_max,
    stride_xt, stride_xh, stride_as, stride_ar, stride_ah, stride_ot, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[rows, r_tile] (=|+=) x[rows, :] @ A[slot, r_tile, :].T for one segment's token tile."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_r = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    # ranks are device data the host never reads (that would sync); clamp so a bad value cannot read out of bounds.
    rank = tl.minimum(tl.load(ranks_ptr + slot), r_max)
    r_start = pid_r * BLOCK_R
    if r_start >= rank:
        return
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    m_start = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    if m_start >= seg_end:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    rows = tl.load(token_idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(pid_k * BLOCK_K, h_in, BLOCK_K * SPLIT_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < h_in
        xt = tl.load(
            x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xh,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )
        at = tl.load(
            a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ah,
            mask=mask_r[None, :] & mask_k[:, None], other=0.0,
        )
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_r[None, :] * stride_or
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Split-K partial sums meet in an fp32 output (the wrapper only splits when out is fp32).
        tl.atomic_add(out_ptrs, acc, mask=mask)


@triton.jit
def sgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, ranks_ptr, token_idx_ptr, seg_starts_ptr, seg_slots_ptr,
    h_out, r_max, y_offset,
    stride_vt, stride_vr, stride_bs, stride_bh, stride_br, stride_yt, stride_yh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[rows, off + n_tile] += v[rows, :r] @ B[slot, n_tile, :r].T for one segment's token tile."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), r_max)
    if rank <= 0:
        return
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    m_start = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    if m_start >= seg_end:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    rows = tl.load(token_idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < h_out
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, rank, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        vt = tl.load(
            v_ptr + rows[:, None] * stride_vt + offs_k[None, :] * stride_vr,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )
        bt = tl.load(
            b_base + offs_n[None, :] * stride_bh + offs_k[:, None] * stride_br,
            mask=mask_n[None, :] & mask_k[:, None], other=0.0,
        )
        # An fp32 intermediate is rounded to B's dtype so half-precision adapters use tensor cores.
        vt = vt.to(bt.dtype)
        if UPCAST:
            vt = vt.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(vt, bt, acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (y_offset + offs_n)[None, :] * stride_yh
    mask = mask_m[:, None] & mask_n[None, :]
    # Each (row, col) belongs to exactly one program, so a plain read-modify-write is race-free.
    cur = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (cur.to(tl.float32) + acc).to(cur.dtype), mask=mask)
