"""Small building blocks of the decoder: RMSNorm and projections that may hold FP8 weights."""
from __future__ import annotations

import time
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


# Packing is measured, not assumed: on the development VM (AMD Zen 5, AVX-512) oneDNN with a packed weight ran
# 1.6-2.4x torch's F.linear from 64 rows on and lost up to 3x at one row (its per-call cost); on an AVX2 EPYC VM it
# only tied from 64 rows on and lost below (bench/gemm_bench.py). `packed_min_rows` times both paths on a weight
# at these row counts, with the threads the engine will step with.
PACK_TRIAL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PACK_MIN_GAIN = 1.05  # packed must be this much faster (F.linear time / packed time) to be used
PACK_TRIAL_ROUNDS = 5
_MEASURED: dict[tuple, int | None] = {}  # (shape, bias, threads) -> packed_min_rows of that measurement


def _time_per_call(fn, x: torch.Tensor, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t) / calls


def packed_gains(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 rows=PACK_TRIAL_ROWS) -> dict[int, float]:
    """F.linear's time / the packed weight's, per row count: the fastest of interleaved rounds (another process
    on the machine only ever adds time), each round ~0.1 ms or more a side."""
    def dense(v):
        return F.linear(v, weight, bias)

    def onednn(v):
        return torch.ops.mkldnn._linear_pointwise(v, packed, bias, "none", [], "")

    gen = torch.Generator().manual_seed(0)
    gains = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, weight.shape[1], generator=gen)
            calls = max(2, int(2e6 / (m * weight.numel())))
            dense(x), onednn(x)  # first calls allocate and pick kernels
            t_dense, t_packed = [], []
            for _ in range(PACK_TRIAL_ROUNDS):
                t_dense.append(_time_per_call(dense, x, calls))
                t_packed.append(_time_per_call(onednn, x, calls))
            gains[m] = min(t_dense) / min(t_packed)
    return gains


def packed_min_rows(gains: dict[int, float]) -> int | None:
    """The fewest rows from which the packed weight won by PACK_MIN_GAIN at every trial row count (larger calls
    keep to it: prefill steps), or None where it never did -- then the weight is not held packed at all."""
    best = None
    for m in sorted(gains, reverse=True):
        if gains[m] < PACK_MIN_GAIN:
            break
        best = m
    return best


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

    def pack(self, min_rows: int | None = None) -> bool:
        """Also hold W in oneDNN's blocked layout for its matmul (fp32-exact: a different summation order, as any
        GEMM's), used for calls of `min_rows` rows or more; F.linear on the dense W below, which is why both are
        held (`weight_bytes` counts both). `min_rows` None: measured on this machine (packed_gains), and W is not
        packed where packing never wins. Returns whether it packed (not for FP8, other dtypes or devices, or where
        oneDNN refuses)."""
        if self.packed is not None or not can_pack(self.weight):
            return False
        key = (tuple(self.weight.shape), self.bias is not None, torch.get_num_threads())
        if min_rows is None and key in _MEASURED and _MEASURED[key] is None:
            return False  # this shape lost when measured here: no reorder to throw away
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        except RuntimeError:  # this CPU or build has no oneDNN kernel for it: F.linear stays
            return False
        if min_rows is None:
            if key not in _MEASURED:  # once a process: a test run builds many engines of one model
                _MEASURED[key] = packed_min_rows(packed_gains(self.weight, packed, self.bias))
            min_rows = _MEASURED[key]
            if min_rows is None:
                return False
        self.packed, self.packed_min_rows = packed, min_rows
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

    def rows(self, keep: torch.Tensor) -> "LoraHook":
        """The same step's hook over a subset of its rows (increasing indices): the forward's last layer runs
        past attention for the sampled rows only (LlamaModel.forward's `keep`)."""
