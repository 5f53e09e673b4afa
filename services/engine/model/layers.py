"""Small building blocks of the decoder: RMSNorm and projections that may hold FP8 weights."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as Hugging Face's LlamaRMSNorm, so fp32 results are bitwise comparable.
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def can_pack(weight) -> bool:
    """A dense fp32 weight on the CPU, with torch's oneDNN linear ops present. (bf16: oneDNN refuses it on CPUs
    without avx_ne_convert or AVX-512 BW/VL/DQ, and torch's own bf16 GEMM is oneDNN's already.)"""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """y = x W^T (+ b). W is a dense tensor, or an FP8 weight with per-output-channel scales; on the CPU a dense
    W may be prepacked for oneDNN (`pack`)."""

    __slots__ = ("weight", "bias", "out_features", "packed")

    def __init__(self, weight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return not isinstance(self.weight, torch.Tensor)

    def pack(self, keep_dense: bool = False) -> bool:
        """Reorder W into oneDNN's blocked layout for its matmul: torch's default fp32 CPU GEMM ran at 100-115
        GFLOP/s a core on the development VM (AMD, AVX-512) where oneDNN with a packed weight ran 235-265 on
        every projection shape of the serving model, M = 4..2048 rows (equal at 1 row), fp32-exact (a different
        summation order, as any GEMM's). The dense W is then dropped (kept as a shape-only meta tensor, so the
        weight costs its bytes once) unless `keep_dense` (a tied LM head whose W is also the embedding table).
        Returns whether it packed (not for FP8, other dtypes or devices, or where oneDNN refuses)."""
        if self.packed is not None or not can_pack(self.weight):
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        except RuntimeError:  # this CPU or build has no oneDNN kernel for it: F.linear stays
            return False
        if not keep_dense:
            self.weight = torch.empty_like(self.weight, device="meta")
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if isinstance(self.weight, torch.Tensor):
            return F.linear(x, self.weight, self.bias)
        from services.engine.kernels.fp8 import fp8_linear

        return fp8_linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        if isinstance(self.weight, torch.Tensor):
            n = self.weight.numel() * self.weight.element_size()
        else:
            n = self.weight.weight.numel() * self.weight.weight.element_size()
            n += self.weight.scale.numel() * self.weight.scale.element_size()
        if self.bias is not None:
            n += self.bias.numel() * self.bias.element_size()
        return n


class LoraHook(Protocol):
    """Adds the LoRA delta of every token's adapter to a projection's output, in place.

    `module` is one of "qkv", "o", "gate_up", "down"; fused outputs hold their slices side by side.
    """

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None: ...
