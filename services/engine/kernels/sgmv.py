"""LoRA SGMV entry points: validate operands, then run the Triton kernels (CUDA) or the torch reference (CPU).

Contract (T tokens, N slots, R = max rank of the slot stack):
  lora_shrink: out[t, :r] = x[t] @ A[s, :r].T with s = slot of token t and r = ranks[s]; every other
               entry (slot -1 rows, columns >= r, adapters with rank 0) is 0. out is fp32 by default:
               the rank-r intermediate stays at full precision and split-K can accumulate atomically.
  lora_expand: y[t, off:off+H_out] += v[t, :r] @ B[s, :, :r].T in place; slot -1 rows and rank-0
               adapters leave y untouched. The LoRA scale is already folded into B by the loader.
ranks[s] == 0 means slot s's adapter does not target this module. Products accumulate in fp32.
backend: "auto" (CUDA -> Triton, CPU -> torch), "torch", or "triton" (on CPU only under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools
from typing import Literal

import torch

from services.engine.kernels.sgmv_meta import SgmvMeta
from services.engine.kernels.sgmv_ref import lora_expand_ref, lora_shrink_ref

Backend = Literal["auto", "torch", "triton"]
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tile sizes. BLOCK_M is tl.dot's minimum; segments are short in decode, so bigger M tiles waste work.
SHRINK_BLOCK_M, SHRINK_BLOCK_K = 16, 64
EXPAND_BLOCK_M, EXPAND_BLOCK_N, EXPAND_BLOCK_K = 16, 64, 16


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    meta: SgmvMeta,
    out: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    split_k: int | None = None,
) -> torch.Tensor:
    """x [T, H_in], lora_a [N, R, H_in], ranks [N] int32 -> out [T, R] (fp32 unless out is given in x's dtype)."""
    _check_meta(meta)
    _check_matrix("x", x, dtypes=FLOAT_DTYPES)
    _check_stack("lora_a", lora_a, dtype=x.dtype, device=x.device)
    num_slots, r_max, h_in = lora_a.shape
    if x.shape != (meta.num_tokens, h_in):
        raise ValueError(f"x must be [num_tokens={meta.num_tokens}, H_in={h_in}] to match meta and lora_a, got {tuple(x.shape)}")
    _check_common(ranks, meta, num_slots, x.device)
    if out is None:
        out = torch.empty(meta.num_tokens, r_max, dtype=torch.float32, device=x.device)
    else:
        _check_matrix("out", out, dtypes=(x.dtype, torch.float32), device=x.device, writable=True)
        if out.shape != (meta.num_tokens, r_max):
            raise ValueError(f"out must be [num_tokens={meta.num_tokens}, R={r_max}], got {tuple(out.shape)}")
    if split_k is not None and (split_k < 1 or (split_k > 1 and out.dtype != torch.float32)):
        raise ValueError("split_k must be >= 1, and > 1 only with an fp32 out (partial sums are added atomically)")
    if _use_triton(backend, x):
        _shrink_triton(x, lora_a, ranks, meta, out, split_k)
    else:
        lora_shrink_ref(x, lora_a, ranks, meta, out)
    return out


def lora_expand(
    v: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    meta: SgmvMeta,
    y: torch.Tensor,
    *,
    y_offset: int = 0,
    backend: Backend = "auto",
) -> None:
    """v [T, R] (B's dtype or fp32), lora_b [N, H_out, R], y [T, H_total] in B's dtype; adds into y in place."""
    _check_meta(meta)
    _check_matrix("y", y, dtypes=FLOAT_DTYPES, writable=True)
    _check_stack("lora_b", lora_b, dtype=y.dtype, device=y.device)
    num_slots, h_out, r_max = lora_b.shape
    _check_matrix("v", v, dtypes=(y.dtype, torch.float32), device=y.device)
    if v.shape != (meta.num_tokens, r_max):
        raise ValueError(f"v must be [num_tokens={meta.num_tokens}, R={r_max}], got {tuple(v.shape)}")
    if y.shape[0] != meta.num_tokens:
        raise ValueError(f"y must have num_tokens={meta.num_tokens} rows, got {y.shape[0]}")
    if not isinstance(y_offset, int) or y_offset < 0 or y_offset + h_out > y.shape[1]:
        raise ValueError(f"y_offset={y_offset} with H_out={h_out} does not fit in y's {y.shape[1]} columns")
    _check_common(ranks, meta, num_slots, y.device)
    if _use_triton(backend, y):
        _expand_triton(v, lora_b, ranks, meta, y, y_offset)
    else:
        lora_expand_ref(v, lora_b, ranks, meta, y, y_offset)


# -- validation ----------------------------------------------------------------------------------


def _check_matrix(name, t, *, dtypes, device=None, writable=False) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {_describe(t)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if writable and t.numel() and (t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1])):
        # A row-major layout (possibly a column slice of a wider tensor) guarantees no two elements alias.
        raise ValueError(f"{name} must be row-major with unit column stride, got strides {t.stride()}")


def _check_stack(name, t, *, dtype, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(f"{name} must be a 3-D [slots, ...] tensor, got {_describe(t)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} to match the activations")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_meta(meta) -> None:
    if not isinstance(meta, SgmvMeta):
        raise ValueError(f"meta must be an SgmvMeta from build_sgmv_meta, got {type(meta).__name__}")


def _check_common(ranks: torch.Tensor, meta: SgmvMeta, num_slots: int, device: torch.device) -> None:
    if not isinstance(ranks, torch.Tensor) or ranks.shape != (num_slots,):
        raise ValueError(f"ranks must be a [{num_slots}] tensor (one rank per slot), got {_describe(ranks)}")
    if ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32, got {ranks.dtype}")
    if ranks.device != device or meta.token_indices_sorted.device != device:
        raise ValueError(f"ranks ({ranks.device}) and meta ({meta.token_indices_sorted.device}) must be on {device}")
    if meta.max_slot >= num_slots:
        raise ValueError(f"meta uses slot {meta.max_slot} but the weight stacks have only {num_slots} slots")


def _describe(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


# -- Triton launch -------------------------------------------------------------------------------


def _use_triton(backend: Backend, t: torch.Tensor) -> bool:
    if backend == "torch":
        return False
    if backend == "auto":
        return t.is_cuda
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if not t.is_cuda and not _interpreted():
        raise ValueError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return True


@functools.cache
def _kernels():
    # Imported on first use so that importing the engine never imports triton (and so tests can set
    # TRITON_INTERPRET before the kernels are decorated).
    from services.engine.kernels import sgmv_triton

    return sgmv_triton


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().sgmv_shrink_kernel, InterpretedFunction)


def _dot_flags(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(UPCAST, DOT_PRECISION) for the kernels' tl.dot.

    The interpreter's bf16 dot is wrong, so interpreted bf16 tiles are widened to fp32 (UPCAST).
    fp32 dots use "ieee" rather than TF32 so an fp32 engine matches the fp32 reference (and Hugging
    Face) closely; half-precision dots keep the backend's default.
    """
    upcast = dtype == torch.bfloat16 and _interpreted()
    precision = "ieee" if dtype == torch.float32 or upcast else None
    return upcast, precision


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_split_k(x: torch.Tensor, programs: int, h_in: int, out: torch.Tensor) -> int:
    # Decode batches give few (segment, tile) programs, each walking all of H_in: split the K loop
    # until the GPU is covered. Atomic partial sums need an fp32 out.
    if not x.is_cuda or out.dtype != torch.float32:
        return 1
    split = 1
    while split < 16 and programs * split < 2 * _num_sms(x.device.index or 0) and h_in // (split * 2) >= 256:
        split *= 2
    return split


def _shrink_triton(x, lora_a, ranks, meta: SgmvMeta, out, split_k: int | None) -> None:
    out.zero_()
    if meta.max_lora_seg_len == 0:
        return
    num_slots, r_max, h_in = lora_a.shape
    block_r = 16 if r_max <= 16 else 32
    m_tiles = _cdiv(meta.max_lora_seg_len, SHRINK_BLOCK_M)
    r_tiles = _cdiv(r_max, block_r)
    if split_k is None:
        split_k = _auto_split_k(x, meta.num_segments * m_tiles * r_tiles, h_in, out)
    upcast, precision = _dot_flags(x.dtype)
    # The interpreter also truncates fp32 -> bf16 casts instead of rounding: stage a bf16 result in fp32.
    dst = torch.zeros(out.shape, dtype=torch.float32, device=out.device) if upcast and out.dtype == torch.bfloat16 else out
    _kernels().sgmv_shrink_kernel[(meta.num_segments, m_tiles, r_tiles * split_k)](
        x, lora_a, dst, ranks, meta.token_indices_sorted, meta.seg_starts, meta.seg_slots,
        h_in, r_max,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), dst.stride(0), dst.stride(1),
        BLOCK_M=SHRINK_BLOCK_M, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K, SPLIT_K=split_k,
        UPCAST=upcast, DOT_PRECISION=precision,
    )
    if dst is not out:
        out.copy_(dst)


def _expand_triton(v, lora_b, ranks, meta: SgmvMeta, y, y_offset: int) -> None:
    if meta.max_lora_seg_len == 0:
        return
    num_slots, h_out, r_max = lora_b.shape
    upcast, precision = _dot_flags(lora_b.dtype)
    dst = y
    if upcast:
        # The interpreter truncates fp32 -> bf16 casts instead of rounding, so do the kernel's two
        # roundings (v to B's dtype, the sum to y's dtype) here with torch's round-to-nearest.
        v = v.to(torch.bfloat16)
        dst = y.float()
    grid = (meta.num_segments, _cdiv(meta.max_lora_seg_len, EXPAND_BLOCK_M), _cdiv(h_out, EXPAND_BLOCK_N))
    _kernels().sgmv_expand_kernel[grid](
        v, lora_b, dst, ranks, meta.token_indices_sorted, meta.seg_starts, meta.seg_slots,
        h_out, r_max, y_offset,
        v.stride(0), v.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), dst.stride(0), dst.stride(1),
        BLOCK_M=EXPAND_BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=EXPAND_BLOCK_K,
        UPCAST=upcast, DOT_PRECISION=precision,
    )
    if dst is not y:
        y.copy_(dst)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
