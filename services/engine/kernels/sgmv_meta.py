"""Per-step SGMV metadata: the batch's tokens grouped into segments that share one adapter slot.

Built once per step from the token->slot mapping and shared by every layer and module. The device
tensors feed the Triton kernels; the host copies let the CPU path and the launch grid avoid a device
sync on every kernel call (building the metadata costs one small device->host copy per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SgmvMeta:
    """Segments of the batch that share an adapter slot.

    token_indices_sorted[seg_starts[i]:seg_starts[i+1]] are the rows of segment i, all using slot
    seg_slots[i] (ascending slot order; stable, so rows keep their batch order within a slot).
    A segment with slot -1 holds base-only rows, which the kernels skip.
    """

    token_indices_sorted: torch.Tensor  # [T] int64, on the device of token_slots
    seg_starts: torch.Tensor  # [S+1] int32, on the device of token_slots
    seg_slots: torch.Tensor  # [S] int32, on the device of token_slots
    num_tokens: int
    # Host copies (plain ints) so the CPU path and the grid computation never read device memory.
    starts_host: tuple[int, ...]  # [S+1]
    slots_host: tuple[int, ...]  # [S]
    max_lora_seg_len: int  # longest segment with slot >= 0 (0 when no token uses an adapter)
    max_slot: int  # largest slot id in the batch (-1 when none)
    is_identity: bool  # token_indices_sorted == arange(T): every segment is a contiguous row range

    @property
    def num_segments(self) -> int:
        return len(self.slots_host)

    @property
    def lora_start(self) -> int:
        """Position in token_indices_sorted where the adapter rows begin (slot -1 sorts first)."""
        return self.starts_host[1] if self.slots_host and self.slots_host[0] < 0 else 0

    def lora_segments(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) of every segment that uses an adapter, in token_indices_sorted order."""
        s = self.starts_host
        return [(slot, s[i], s[i + 1]) for i, slot in enumerate(self.slots_host) if slot >= 0]


def build_sgmv_meta(token_slots: torch.Tensor) -> SgmvMeta:
    """Group the tokens of one step by adapter slot. token_slots: [T] integer, -1 = base model only."""
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    device = token_slots.device
    # The mapping is a few hundred ints: sorting it on the host is cheaper than a device sort followed
    # by the device->host copy the launch grid needs anyway, and it yields the host copies for free.
    slots = token_slots.detach().to("cpu", torch.int64)
    num_tokens = slots.numel()
    if num_tokens and int(slots.min()) < -1:
        raise ValueError(f"token_slots must be >= -1 (-1 = no adapter), got {int(slots.min())}")
    order = torch.argsort(slots, stable=True)
    seg_slot_vals, counts = torch.unique_consecutive(slots[order], return_counts=True)
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    lora_counts = counts[seg_slot_vals >= 0]
    return SgmvMeta(
        token_indices_sorted=order.to(device, non_blocking=True),
        seg_starts=starts.to(device=device, dtype=torch.int32, non_blocking=True),
        seg_slots=seg_slot_vals.to(device=device, dtype=torch.int32, non_blocking=True),
        num_tokens=num_tokens,
        starts_host=tuple(starts.tolist()),
        slots_host=tuple(seg_slot_vals.tolist()),
        max_lora_seg_len=int(lora_counts.max()) if lora_counts.numel() else 0,
        max_slot=int(seg_slot_vals[-1]) if seg_slot_vals.numel() else -1,
        is_identity=bool(torch.equal(order, torch.arange(num_tokens))),
    )
