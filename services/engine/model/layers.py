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


# Below this many multiply-adds a call (rows x out x in) oneDNN's per-call cost loses to F.linear: measured on the
# development VM (bench/gemm_bench.py), one decode row through a 384 x 256 projection took 2.5x as long packed,
# and packed won from ~0.75M multiply-adds on (256 x 256 from 12 rows, 384 x 256 from 8, 1376 x 256 from 3).
PACKED_MIN_MACS = 750_000


class Linear:
    """y = x W^T (+ b). W is a dense tensor, or an FP8 weight with per-output-channel scales; on the CPU a dense
    W may also be held prepacked for oneDNN (`pack`), used for calls with enough rows."""

    __slots__ = ("weight", "bias", "out_features", "packed", "packed_min_rows")

    def __init__(self, weight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed: torch.Tensor | None = None
        self.packed_min_rows = 0

    @property
    def is_fp8(self) -> bool:
        return not isinstance(self.weight, torch.Tensor)

    def pack(self) -> bool:
        """Also hold W in oneDNN's blocked layout for its matmul: torch's default fp32 CPU GEMM ran at 100-115
        GFLOP/s a core on the development VM (AMD, AVX-512) where oneDNN with a packed weight ran 235-260 on every
        projection shape of the serving model from 64 rows on (bench/gemm_bench.py), fp32-exact (a different
        summation order, as any GEMM's). Calls of fewer rows than `packed_min_rows` (PACKED_MIN_MACS) keep
        F.linear on the dense W, which is why both are held: on the CPU the weights take twice their bytes
        (`weight_bytes` counts both). Returns whether it packed (not for FP8, other dtypes or devices, or where
        oneDNN refuses)."""
        if self.packed is not None or not can_pack(self.weight):
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        except RuntimeError:  # this CPU or build has no oneDNN kernel for it: F.linear stays
            return False
        self.packed_min_rows = -(-PACKED_MIN_MACS // self.weight.numel())
        return True

    @property
    def packed_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] >= self.packed_min_rows:  # x: [rows, in]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if isinstance(self.weight, torch.Tensor):
            return F.linear(x, self.weight, self.bias)
        from services.engine.kernels.fp8 import fp8_linear

        return fp8_linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        if isinstance(self.weight, torch.Tensor):
            n = self.weight.numel() * self.weight.element_size() + self.packed_bytes
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
