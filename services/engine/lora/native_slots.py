"""Device-slot storage for the native CPU kernel: each slot's adapter at its exact rank, one buffer per slot.

A slot holds one contiguous fp32 buffer with, per (layer, group) the adapter targets: the group's A
matrices stacked ([sum of ranks, d_in], the parts' rows one after another) and then each part's Bt
[rank, part width] with the LoRA scale folded in. A table [slots, layers, modules, 3] gives the kernel
each module's A and Bt address and rank (rank 0: the slot's adapter skips the module; a free slot's
rows are all 0). The loader threads lay an adapter out this way when they read it (`pack`), and the host
tier keeps that form, so taking a slot on the step loop is one table-row write; the slot holds a
reference to the buffer, so no address in the table outlives its tensor (the host tier may drop the
adapter while a slot still serves it).

A step's segments split by work, rows x the adapter's rank: light ones (decode rows, and prefill chunks of
low-rank adapters) go to the C kernel in one call per group; heavy ones run as one mm for the group's
shrink plus one addmm per part at the adapter's exact rank. MKL wins only where a segment's work pays for
its ~20 torch calls a step: measured on 16 group applications of one segment, the C loop is faster up to
~256 rows at rank 4-8, ~128 at rank 16, ~48 at rank 32 and ~12 at rank 64 (docs/engine.md).
Same interface as CpuSlotStacks (cpu_slots.py), the torch path it replaces when the kernel builds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.kernels.sgmv_meta import SgmvMeta
from services.engine.kernels.sgmv_native import NativeSgmv
from services.engine.lora.weights import LoraWeights

LONG_WORK = 1536  # segments with rows x adapter rank above this run as MKL matmuls; the others in the C kernel


@dataclass(frozen=True, slots=True)
class _GroupWeights:
    """One (layer, group) of a slot's adapter, as views into the slot's buffer."""

    a: torch.Tensor  # [sum of the targeted parts' ranks, d_in]
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]  # (output offset, A row offset, rank, Bt [rank, size])


@dataclass(frozen=True, slots=True)
class _Slot:
    """An adapter's slot layout: shared by the host tier's entry and every slot that holds it."""

    buffer: torch.Tensor
    groups: dict[tuple[int, str], _GroupWeights]
    table_rows: torch.Tensor  # [layers, modules, 3] int64: A address, Bt address, rank


@dataclass(frozen=True, slots=True)
class NativePlan:
    """One step's segments, shared by every layer and group."""

    pos: torch.Tensor | None  # [T] int64 step position -> row; None when the batch is grouped by slot
    short: torch.Tensor  # [S, 3] int64 (start, end, slot) for the C kernel
    long: tuple[tuple[int, int, int, torch.Tensor | None], ...]  # (slot, start, end, explicit rows or None)


class NativeSlotTable:
    def __init__(
        self,
        num_layers: int,
        slices: dict[str, list[tuple[str, int, int]]],
        *,
        max_slots: int,
        kernel: NativeSgmv,
        long_work: int = LONG_WORK,
    ):
        self.num_layers = num_layers
        self.slices = slices
        self.kernel = kernel
        self.long_work = long_work
        self.slot_rank = torch.zeros(max_slots, dtype=torch.int64)  # the largest rank of each slot's adapter
        self.modules = [m for parts in slices.values() for m, _, _ in parts]
        self.parts = {group: torch.tensor([[self.modules.index(m), off, size] for m, off, size in parts], dtype=torch.int64)
                      for group, parts in slices.items()}
        self.table = torch.zeros(max_slots, num_layers, len(self.modules), 3, dtype=torch.int64)
        self._slots: list[_Slot | None] = [None] * max_slots
        self._active = [False] * max_slots
        self.dtype = torch.float32

    # -- install / evict -------------------------------------------------------------------------
    def pack(self, weights: LoraWeights) -> LoraWeights:
        """The adapter laid out for a slot: one fp32 buffer, its table rows and per-group views. Reads only
        the table's fixed shape, so the loader threads run it; `weights.tensors` become views into the
        buffer (the host tier keeps one copy of the weights, not two)."""
        pieces: list[torch.Tensor] = []
        placed: list[tuple[int, str, list[tuple[int, int, int, int, int, int]]]] = []  # per (layer, group)
        at = 0
        for layer in range(self.num_layers):
            for group, parts in self.slices.items():
                present = [(self.modules.index(m), off, size, *weights.tensors[(layer, m)])
                           for m, off, size in parts if (layer, m) in weights.tensors]
                if not present:
                    continue
                a_at = at
                pieces += [a.reshape(-1) for _, _, _, a, _ in present]
                at += sum(a.numel() for _, _, _, a, _ in present)
                spans, row = [], 0
                for mi, off, size, a, b in present:
                    pieces.append(b.t().reshape(-1))
                    spans.append((mi, off, size, row, a.shape[0], at))
                    row += a.shape[0]
                    at += b.numel()
                placed.append((layer, group, [(a_at, row, present[0][3].shape[1])] + spans))
        buffer = torch.cat(pieces).to(self.dtype) if pieces else torch.empty(0, dtype=self.dtype)
        assert buffer.numel() == at
        base, item = buffer.data_ptr(), buffer.element_size()
        rows = [[[0, 0, 0] for _ in self.modules] for _ in range(self.num_layers)]
        groups: dict[tuple[int, str], _GroupWeights] = {}
        tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, group, ((a_at, a_rows, d_in), *spans) in placed:
            a_cat = buffer[a_at : a_at + a_rows * d_in].view(a_rows, d_in)
            parts = []
            for mi, off, size, row, r, b_at in spans:
                rows[layer][mi] = [base + (a_at + row * d_in) * item, base + b_at * item, r]
                bt = buffer[b_at : b_at + r * size].view(r, size)
                parts.append((off, row, r, bt))
                tensors[(layer, self.modules[mi])] = (a_cat[row : row + r], bt.t())
            groups[(layer, group)] = _GroupWeights(a_cat, tuple(parts))
        layout = _Slot(buffer, groups, torch.tensor(rows, dtype=torch.int64))
        return LoraWeights(weights.content_id, weights.name, weights.max_rank, tensors, slot_layout=layout)

    def install(self, slot: int, weights: LoraWeights) -> None:
        """Give `slot` the adapter's packed buffer (whatever it held is evicted): a table-row write when the
        loader packed it already (`pack`), else it is packed here."""
        assert not self._active[slot], "an active slot cannot be overwritten"
        self.evict(slot)
        layout = weights.slot_layout if isinstance(weights.slot_layout, _Slot) else self.pack(weights).slot_layout
        self.table[slot] = layout.table_rows
        self.slot_rank[slot] = weights.max_rank
        self._slots[slot] = layout

    def evict(self, slot: int) -> None:
        assert not self._active[slot], "an active slot cannot be evicted"
        self.table[slot].zero_()  # before the buffer goes: no address in the table outlives its tensor
        self.slot_rank[slot] = 0
        self._slots[slot] = None

    def activate(self, slot: int) -> None:
        """Nothing moves: the kernel reads only the segments' own slots, so idle slots cost nothing."""
        assert not self._active[slot]
        self._active[slot] = True

    def deactivate(self, slot: int) -> None:
        assert self._active[slot]
        self._active[slot] = False

    # -- one step ----------------------------------------------------------------------------------
    def plan(self, meta: SgmvMeta) -> NativePlan:
        order = None if meta.is_identity else meta.token_indices_sorted
        starts = meta.seg_starts.to("cpu", torch.int64)
        slots = meta.seg_slots.to("cpu", torch.int64)
        start, end = starts[:-1], starts[1:]
        segs = torch.stack((start, end, slots), 1)
        work = (end - start) * self.slot_rank[slots.clamp(min=0)]
        light = (work <= self.long_work) | (slots < 0)
        short = segs[(slots >= 0) & light].contiguous()
        long = []
        if not bool(light.all()):  # rare in decode: only then walk the segments in Python
            for slot, start_, end_ in meta.lora_segments():
                if (end_ - start_) * int(self.slot_rank[slot]) <= self.long_work:
                    continue
                rows = None
                if order is not None:
                    seg = order[start_:end_]
                    first = int(seg[0])
                    if bool((seg.diff() == 1).all()):
                        start_, end_ = first, first + (end_ - start_)
                    else:
                        rows = seg
                long.append((slot, start_, end_, rows))
        pos = None if order is None else order.to("cpu", torch.int64).contiguous()
        return NativePlan(pos, short, tuple(long))

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, plan: NativePlan) -> None:
        if plan.short.shape[0]:
            self.kernel.group(x, y, plan.pos, plan.short, self.table, layer, self.parts[group],
                              num_threads=torch.get_num_threads(), check=layer == 0)
        for slot, start, end, rows in plan.long:
            held = self._slots[slot]
            gw = None if held is None else held.groups.get((layer, group))
            if gw is None:
                continue
            if rows is None:
                v = x[start:end].mm(gw.a.t())
                for off, row, r, bt in gw.parts:
                    y[start:end, off : off + bt.shape[1]].addmm_(v[:, row : row + r], bt)
            else:
                v = x.index_select(0, rows).mm(gw.a.t())
                for off, row, r, bt in gw.parts:
                    y[:, off : off + bt.shape[1]].index_add_(0, rows, v[:, row : row + r].mm(bt))

    # -- views and checks ----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self._slots if s is not None)

    def check_integrity(self) -> None:
        for slot, held in enumerate(self._slots):
            if held is None:
                assert not self.table[slot].any(), f"free slot {slot} has table entries"
                assert not self._active[slot], f"free slot {slot} is active"
                continue
            lo = held.buffer.data_ptr()
            hi = lo + held.buffer.numel() * held.buffer.element_size()
            entries = self.table[slot].view(-1, 3).tolist()
            for a_ptr, b_ptr, r in entries:
                if r:
                    assert lo <= a_ptr < hi and lo <= b_ptr < hi, f"slot {slot} table points outside its buffer"
                else:
                    assert a_ptr == 0 and b_ptr == 0, f"slot {slot} has an address without a rank"
            ranks = sum(1 for *_, r in entries if r)
            assert ranks == sum(len(gw.parts) for gw in held.groups.values()), f"slot {slot} table/weights disagree"
