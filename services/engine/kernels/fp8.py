"""FP8 (e4m3) weights with per-output-channel scales, and the linear layer that consumes them.

quantize_fp8 stores each output row as float8_e4m3fn with scale = amax(row) / 448, so every row uses
the full e4m3 range: half the bytes of bf16 for ~2-3% relative weight error (see the tests/README).
fp8_linear runs torch._scaled_mm on GPUs with FP8 tensor cores (sm89+), quantizing activations per
token on the fly; elsewhere (CPU) it widens the FP8 weight exactly to x's dtype for the matmul and
applies the per-channel scale to the output. fp8_linear_ref is the fp32 definition both are tested
against. The embedding table is stored the same way (a row per token) and fp8_embedding widens only the
rows a batch looks up.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
Fp8Backend = Literal["auto", "dequant", "scaled_mm"]


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """W ~= weight.float() * scale[:, None]; weight [out, in] float8_e4m3fn, scale [out] fp32."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"Fp8Weight.weight must be a 2-D {FP8_DTYPE} tensor, got {self.weight.dtype} {tuple(self.weight.shape)}")
        if self.scale.dtype != torch.float32 or self.scale.shape != (self.weight.shape[0],):
            raise ValueError(f"Fp8Weight.scale must be fp32 [{self.weight.shape[0]}], got {self.scale.dtype} {tuple(self.scale.shape)}")
        if self.weight.device != self.scale.device:
            raise ValueError("Fp8Weight.weight and scale must be on the same device")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def quantize_fp8(w: torch.Tensor, amax: torch.Tensor | None = None) -> Fp8Weight:
    """Per-output-channel e4m3 quantization of a dense [out, in] weight; all-zero rows get scale 1. `amax`:
    each row's absolute maximum over the whole row when `w` holds only some of its columns (a
    tensor-parallel shard of a row-parallel weight), so the shard gets the unsharded weight's scales."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8 expects a 2-D floating-point weight, got {w.dtype} {tuple(w.shape)}")
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1) if amax is None else amax.float()
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quantize_fp8: the weight has NaN or Inf entries")
    # A zero row would give scale 0 and 0/0 below; any positive scale stores it exactly as zeros.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.contiguous(), scale.contiguous())


def fp8_embedding_ref(ids: torch.Tensor, w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The definition: rows of the dequantized table."""
    return w.dequantize(torch.float32)[ids].to(dtype)


def fp8_embedding(ids: torch.Tensor, w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Embedding lookup in an FP8 table [vocab, hidden] with per-row scales: only the looked-up rows are
    widened, so the table stays at one byte per element (a tied LM head reads the same table)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32/int64, got {ids.dtype}")
    rows = w.weight.index_select(0, ids.reshape(-1))
    out = _widen_e4m3(rows).float() * (w.scale.index_select(0, ids.reshape(-1)) * _WIDEN_SCALE)[:, None]
    return out.to(dtype).reshape(*ids.shape, w.shape[1])


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: dequantize to fp32, fp32 matmul, result in x's dtype."""
    y = x.float() @ w.dequantize(torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *, backend: Fp8Backend = "auto"
) -> torch.Tensor:
    """y = x W^T (+ bias) in x's dtype for x [..., in] and an FP8 weight [out, in]."""
    out_f, in_f = w.shape
    if x.shape[-1] != in_f:
        raise ValueError(f"x has {x.shape[-1]} features, the FP8 weight expects {in_f}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_linear expects fp32/fp16/bf16 activations, got {x.dtype}")
    if x.device != w.weight.device:
        raise ValueError(f"x is on {x.device}, the FP8 weight on {w.weight.device}")
    if bias is not None and bias.shape != (out_f,):
        raise ValueError(f"bias must be [{out_f}], got {tuple(bias.shape)}")
    if backend == "auto":
        backend = "scaled_mm" if _scaled_mm_ok(x, w) else "dequant"
    if backend == "dequant":
        y = _linear_dequant(x, w)
    elif backend == "scaled_mm":
        if in_f % 16 or out_f % 16:
            raise ValueError(f"the scaled_mm backend needs in/out features divisible by 16, got {in_f}/{out_f}")
        x2 = x.reshape(-1, in_f)
        y = _linear_scaled_mm(x2, w).reshape(*x.shape[:-1], out_f) if x2.shape[0] else _linear_dequant(x, w)
    else:
        raise ValueError(f"backend must be 'auto', 'dequant' or 'scaled_mm', got {backend!r}")
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def _linear_dequant(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    # The per-channel scale commutes with the matmul, so it goes on the [T, out] result rather than
    # on the [out, in] weight; the weight only needs widening, done by bit moves (see _widen_e4m3).
    wide = _widen_e4m3(w.weight)
    scale = w.scale * _WIDEN_SCALE
    if x.dtype == torch.float32:
        return F.linear(x, wide.float()).mul_(scale)
    return (F.linear(x, wide.to(x.dtype)).float() * scale).to(x.dtype)


_WIDEN_SCALE = 256.0  # _widen_e4m3 yields weight / 256


def _widen_e4m3(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float16 equal to q / 256, exactly, via integer bit moves.

    Placing e4m3's 7 exponent+mantissa bits at the bottom of fp16's exponent and top of its mantissa
    gives 2^(e-15)(1+m/8) for normal codes and (m/8)2^-14 for subnormal ones, i.e. the e4m3 value
    (bias 7) times 2^-8. This is ~3x faster on the CPU than torch's element-wise fp8 conversion.
    The NaN code (0x7F) would read as 480/256, but quantize_fp8 clamps to +-448 and never emits it.
    """
    u = q.view(torch.uint8).to(torch.int16)
    return (((u & 0x7F) << 7) | ((u & 0x80) << 8)).view(torch.float16)


def _scaled_mm_ok(x: torch.Tensor, w: Fp8Weight) -> bool:
    if not x.is_cuda or w.shape[0] % 16 or w.shape[1] % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def _rowwise_ok(x: torch.Tensor) -> bool:
    # Fused per-row scales are a bf16-output feature of the SM90 (and CPU) kernels.
    if x.dtype != torch.bfloat16:
        return False
    return not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (9, 0)


def quantize_rows(x2: torch.Tensor, *, backend: Literal["auto", "torch", "triton"] = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K] row-major, fp32 scales [M, 1]) with x ~ codes * scale per row; zero rows
    stay 0. On CUDA one Triton kernel (kernels/fp8_quant_triton.py), else torch; the same arithmetic."""
    if backend == "torch" or (backend == "auto" and not x2.is_cuda):
        return quantize_rows_torch(x2)
    m, k = x2.shape
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    staged = not x2.is_cuda  # the interpreter (tests): its fp8 casts are wrong, so torch casts a staged fp32 copy
    if staged and not _quant_interpreted():
        raise ValueError("the Triton row quantization on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    xq = torch.empty((m, k), dtype=torch.float32 if staged else FP8_DTYPE, device=x2.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    if m:
        _quant_kernels().quantize_rows_kernel[(m,)](x2, xq, scale, k, x2.stride(0), xq.stride(0), FP8_MAX=FP8_MAX,
                                                    BLOCK=min(1024, max(16, 1 << (k - 1).bit_length())), STAGED=staged)
    return (xq.to(FP8_DTYPE) if staged else xq), scale


def quantize_rows_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x2.float()
    x_scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)  # [M, 1]; zero rows stay 0
    return (x32 / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), x_scale


@functools.cache
def _quant_kernels():
    from services.engine.kernels import fp8_quant_triton

    return fp8_quant_triton


def _quant_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_quant_kernels().quantize_rows_kernel, InterpretedFunction)


def _linear_scaled_mm(x2: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """FP8 x FP8 GEMM with dynamic per-token activation scales and the weight's per-channel scales."""
    xq, x_scale = quantize_rows(x2)  # row-major [M, K], as _scaled_mm wants
    wt = w.weight.t()  # column-major [K, N], as _scaled_mm wants for its second operand
    if _rowwise_ok(x2):
        return _scaled_mm(xq, wt, x_scale, w.scale.view(1, -1), torch.bfloat16)
    # Portable form: unit per-tensor scales in the GEMM, both scale vectors applied to the fp32 result.
    one = torch.ones((), dtype=torch.float32, device=x2.device)
    y = _scaled_mm(xq, wt, one, one, torch.float32)
    return (y * x_scale * w.scale).to(x2.dtype)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm; on the CPU, where oneDNN has no FP8 GEMM for the ISA it may use, the same product in
    fp32. torch sends CPU fp8 GEMMs to oneDNN by what the CPU can do (an AMX Xeon), but oneDNN may be capped
    below that (ONEDNN_MAX_CPU_ISA=AVX2, as the test suite pins it: services/common/cpu_paths.py), and then
    has no primitive for it. Every e4m3 code is exact in fp32, so the fallback is the scaled GEMM's arithmetic
    with fp32 accumulation."""
    try:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    except RuntimeError as exc:
        if a.device.type != "cpu" or "primitive descriptor" not in str(exc):
            raise
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
