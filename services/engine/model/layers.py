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


class Linear:
    """y = x W^T (+ b). W is a dense tensor, or an FP8 weight with per-output-channel scales."""

    __slots__ = ("weight", "bias", "out_features")

    def __init__(self, weight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]

    @property
    def is_fp8(self) -> bool:
        return not isinstance(self.weight, torch.Tensor)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
