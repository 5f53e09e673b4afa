"""Triton paged decode attention over an fp8 (e4m3 + per-(block, kv head) scales) or a plain KV cache.

Grid: (sequence, kv head, context partition). A program holds the G query heads of its kv head and walks
its partition of the sequence's blocks through the block table (from the block holding position lo, under a
sliding window, to the last): one
block's keys and values are loaded once for the G heads, fp8 bytes decoded in registers (the midpoint
decode of kernels/kv_fp8.py by integer bit moves, no fp8 hardware needed), the block's scales folded into
the scores and the softmax weights, and an online softmax keeps a running max and sum per query head.
Scores and the weighted sum are broadcast products reduced with tl.sum in fp32 (decode is memory-bound;
tl.dot's 16-row minimum would mostly multiply padding for G <= 8).

Split context (flash-decoding): one program walking a 2,048-token context block by block leaves the GPU's
memory system mostly idle (measured on an H100: 9-22% of copy bandwidth for 128 sequences). With SPLIT, each
program covers PART tokens (a multiple of the block size) and writes its unnormalized partial (running max,
sum, weighted values) to scratch; `combine_kernel` merges a (sequence, kv head)'s partials in order. Partitions
past a sequence's context leave (-inf, 0, 0), which the merge ignores. Without SPLIT (one partition covers every
context) the program normalizes and writes the output itself. Host checks live in decode_attention.py; import
this module only after TRITON_INTERPRET is decided.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_fp8(c):
    """uint8 codes -> fp32 values at scale 1 (the midpoint of each code's truncation interval)."""
    c = c.to(tl.int32)
    mag = ((c & 0x7F) << 20) + (120 << 23) + (1 << 19)
    v = mag.to(tl.float32, bitcast=True)
    v = tl.where((c & 0x78) == 0, v * 2.0 - 0.015625, v)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def paged_decode_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, rows_ptr, ctx_ptr, tables_ptr, pm_ptr, pl_ptr, pacc_ptr,
    scale, window, part_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    hi = ctx
    if SPLIT:
        lo = tl.maximum(lo, part * part_tokens)
        hi = tl.minimum(ctx, (part + 1) * part_tokens)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK_SIZE)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), dtype=tl.float32)
    # Empty when this partition starts past the context (SPLIT): the partial stays (-inf, 0, 0).
    for j in range(lo // BLOCK_SIZE, tl.cdiv(hi, BLOCK_SIZE)):
        blk = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
        pos = j * BLOCK_SIZE + offs_t
        valid = (pos >= lo) & (pos < hi)
        kv_off = blk * stride_cb + offs_t[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0)
        if FP8:
            k = _decode_fp8(k) * tl.load(ks_ptr + blk * stride_sb + kvh)
            v = _decode_fp8(v) * tl.load(vs_ptr + blk * stride_sb + kvh)
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every visited block holds a visible position
        p = tl.exp(s - m_new[:, None])
        corr = tl.exp(m - m_new)
        l = l * corr + tl.sum(p, axis=1)
        acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if SPLIT:
        base = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + part
        tl.store(pm_ptr + base * GROUP_PAD + offs_g, m)
        tl.store(pl_ptr + base * GROUP_PAD + offs_g, l)
        tl.store(pacc_ptr + (base * GROUP_PAD + offs_g[:, None]) * D_PAD + offs_d[None, :], acc)
    else:
        o = acc / l[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def combine_kernel(
    out_ptr, rows_ptr, pm_ptr, pl_ptr, pacc_ptr, num_parts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """out[rows[b], heads of kv head] = the merge of the partitions' partials, in partition order."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), dtype=tl.float32)
    first = (b * tl.num_programs(1) + kvh) * num_parts
    for part in range(0, num_parts):
        base = first + part
        m_p = tl.load(pm_ptr + base * GROUP_PAD + offs_g)
        l_p = tl.load(pl_ptr + base * GROUP_PAD + offs_g)
        acc_p = tl.load(pacc_ptr + (base * GROUP_PAD + offs_g[:, None]) * D_PAD + offs_d[None, :])
        m_new = tl.maximum(m, m_p)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # both still empty: keep exp() away from -inf - -inf
        c_old = tl.exp(m - ref)
        c_p = tl.exp(m_p - ref)
        l = l * c_old + l_p * c_p
        acc = acc * c_old[:, None] + acc_p * c_p[:, None]
        m = m_new
    o = acc / l[:, None]
    heads = kvh * GROUP + offs_g
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])
