"""Per-token (row) FP8 quantization of activations in one Triton kernel: what `_scaled_mm` needs before every
FP8 projection. The torch form (kernels/fp8.py, `quantize_rows_torch`) is five element-wise passes over the
activations (widen, abs, amax, divide + clamp, cast) and their launches; on an H100 it made `fp8_linear` 0.24-0.29x a
bf16 GEMM at decode sizes. One program per row: a pass for the row's amax, a pass writing the e4m3 codes. Same
arithmetic as the torch form (scale = max(amax / 448, 1e-12); x / scale clamped to +-448, rounded to nearest even).
Import only after TRITON_INTERPRET is decided.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
                         STAGED: tl.constexpr):
    """STAGED (the interpreter only, whose fp8 casts are wrong): q_ptr is fp32 and gets the clamped quotient,
    which the host casts."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + r * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + r, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + r * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        if STAGED:
            tl.store(q_ptr + r * stride_q + k0 + offs, q, mask=k0 + offs < K)
        else:
            tl.store(q_ptr + r * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=k0 + offs < K)
