"""Pure-torch SGMV shrink/expand: the oracle for the Triton kernels and the engine's CPU execution path.

One matmul per adapter segment, never a loop over tokens: the adapter rows are gathered once into
slot-sorted order (contiguous per segment), multiplied segment by segment, and scattered back once.
Inputs are assumed validated by the wrappers in sgmv.py. Semantics match the Triton kernels: products
accumulate in fp32; expand rounds an fp32 intermediate to B's dtype first (the kernel's tensor-core
inputs), then adds the fp32 delta to y and rounds once to y's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.kernels.sgmv_meta import SgmvMeta


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def lora_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, meta: SgmvMeta, out: torch.Tensor
) -> torch.Tensor:
    """out[t, :r] = x[t] @ A[slot(t), :r].T; every other entry of out (slot -1 rows, cols >= r) is 0."""
    out.zero_()
    lo = meta.lora_start
    if lo == meta.num_tokens:
        return out
    rank_of = ranks.tolist()
    # Rows lo.. of the sorted order, gathered once (a view when the batch is already grouped).
    rows = None if meta.is_identity else meta.token_indices_sorted[lo:]
    xs = _f32(x[lo:] if rows is None else x.index_select(0, rows))
    dst = out[lo:] if rows is None else torch.zeros(len(rows), out.shape[1], dtype=out.dtype, device=out.device)
    for slot, start, end in meta.lora_segments():
        r = rank_of[slot]
        if r:
            dst[start - lo : end - lo, :r] = F.linear(xs[start - lo : end - lo], _f32(lora_a[slot, :r]))
    if rows is not None:
        out.index_copy_(0, rows, dst)
    return out


def lora_expand_ref(
    v: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor, meta: SgmvMeta, y: torch.Tensor, y_offset: int
) -> None:
    """y[t, off:off+H_out] += v[t, :r] @ B[slot(t), :, :r].T in place; slot -1 rows are untouched."""
    lo = meta.lora_start
    if lo == meta.num_tokens:
        return
    y_slice = y[:, y_offset : y_offset + lora_b.shape[1]]
    rank_of = ranks.tolist()
    rows = None if meta.is_identity else meta.token_indices_sorted[lo:]
    vs = _f32((v[lo:] if rows is None else v.index_select(0, rows)).to(lora_b.dtype))
    # Gather-add-scatter (rows are unique) rather than index_add_, whose strided-view path is ~20x slower.
    ys = y_slice[lo:] if rows is None else y_slice.index_select(0, rows)
    for slot, start, end in meta.lora_segments():
        r = rank_of[slot]
        if not r:
            continue
        seg = slice(start - lo, end - lo)
        delta = F.linear(vs[seg, :r], _f32(lora_b[slot, :, :r]))
        rows_y = ys[seg]
        if rows_y.dtype == torch.float32:
            rows_y.add_(delta)
        else:
            rows_y.copy_(rows_y.float().add_(delta))
    if rows is not None:
        y_slice.index_copy_(0, rows, ys)
