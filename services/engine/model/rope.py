"""Rotary position embeddings (default, linear, llama3, yarn), numerically matching Hugging Face."""
from __future__ import annotations

import math

import torch

from services.engine.config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin post-scaling factor for a rope config."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    base_inv = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return base_inv, 1.0
    if rope.rope_type == "linear":
        return base_inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(base_inv, rope, max_positions), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_positions)
    raise AssertionError(rope.rope_type)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    old_ctx = rope.original_max_position_embeddings or max_positions
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings or max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position (same float ops as HF, so bitwise equal)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: str):
        inv_freq, scale = inv_freq_and_scale(rope, head_dim, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)
        half = head_dim // 2
        # rotate_half(x) * sin = [-x2, x1] * [s1, s2] = [x2, x1] * [-s1, s2], product for product (a sign flip is
        # exact): the halves swapped times this table is HF's term bit for bit, with no negation or cat per call.
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos and signed sin rows [T, 1, d]: gathered once a forward, for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] (q and k heads side by side: one call for both) -> x cos + rotate_half(x) sin."""
        t, heads, d = x.shape
        swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
        return x * cos + swapped * sin_signed
