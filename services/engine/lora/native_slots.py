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

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.kernels.sgmv_meta import SgmvMeta
from services.engine.kernels.sgmv_native import NativeSgmv
from services.engine.lora.weights import LoraArrays, LoraModule, LoraWeights

LONG_WORK = 1536  # segments with rows x adapter rank above this run as MKL matmuls; the others in the C kernel


@dataclass(frozen=True, slots=True)
class _GroupWeights:
    """One (layer, group) of a slot's adapter, as views into the slot's buffer."""

    a: torch.Tensor  # [sum of the targeted parts' ranks, d_in]
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]  # (output offset, A row offset, rank, Bt [rank, size])


# Where one (layer, group) of an adapter sits in its buffer: A's offset, rows and width, and per targeted
# part (module index, output offset, output size, A row, rank, Bt offset). Offsets count floats.
_Placed = tuple[int, str, int, int, int, tuple[tuple[int, int, int, int, int, int], ...]]


class _Slot:
    """An adapter's slot layout: shared by the host tier's entry and every slot that holds it.

    The torch views of the buffer (per-group for the MKL path, per-module for `LoraWeights.tensors`) are
    made on first use: a load makes none, so the loader thread spends its time in numpy copies, not in
    a hundred small torch calls that hold the GIL the step loop needs."""

    __slots__ = ("buffer", "table_rows", "placed", "_groups")

    def __init__(self, buffer: torch.Tensor, table_rows: torch.Tensor, placed: tuple[_Placed, ...]):
        self.buffer = buffer
        self.table_rows = table_rows  # [layers, modules, 3] int64: A address, Bt address, rank
        self.placed = placed
        self._groups: dict[tuple[int, str], _GroupWeights] | None = None

    @property
    def groups(self) -> dict[tuple[int, str], _GroupWeights]:
        if self._groups is None:
            groups = {}
            for layer, group, a_at, a_rows, d_in, spans in self.placed:
                a = self.buffer[a_at : a_at + a_rows * d_in].view(a_rows, d_in)
                groups[(layer, group)] = _GroupWeights(a, tuple(
                    (off, row, r, self.buffer[b_at : b_at + r * size].view(r, size)) for _, off, size, row, r, b_at in spans))
            self._groups = groups
        return self._groups


class _SlotViews(Mapping):
    """`LoraWeights.tensors` of a packed adapter: (A, B) views into its buffer, made on first access."""

    def __init__(self, layout: _Slot, modules: list[str]):
        self._layout, self._modules, self._views = layout, modules, None

    def _all(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        if self._views is None:
            views, groups = {}, self._layout.groups
            for layer, group, *_, spans in self._layout.placed:
                gw = groups[(layer, group)]
                for (mi, *_), (_, row, r, bt) in zip(spans, gw.parts):
                    views[(layer, self._modules[mi])] = (gw.a[row : row + r], bt.t())
            self._views = views
        return self._views

    def __getitem__(self, key):
        return self._all()[key]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return sum(len(p[5]) for p in self._layout.placed)


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
        self._rank = [0] * max_slots  # the largest rank of each slot's adapter (0: free)
        self.modules = [m for parts in slices.values() for m, _, _ in parts]
        self.part_modules = {group: [self.modules.index(m) for m, _, _ in parts] for group, parts in slices.items()}
        self.parts = {group: torch.tensor([[mi, off, size] for mi, (_, off, size) in zip(self.part_modules[group], parts)],
                                          dtype=torch.int64) for group, parts in slices.items()}
        self.table = torch.zeros(max_slots, num_layers, len(self.modules), 3, dtype=torch.int64)
        self._slots: list[_Slot | None] = [None] * max_slots
        self._active = [False] * max_slots
        self.dtype = torch.float32

    # -- install / evict -------------------------------------------------------------------------
    def pack(self, weights: LoraArrays | LoraWeights) -> LoraWeights:
        """The adapter laid out for a slot: one fp32 buffer and its table rows. Reads only the table's fixed
        shape, so the loader threads run it, straight from the file's arrays (`read_lora`): one numpy copy
        per A, one scaled transposing copy per B, and one finiteness check over the whole buffer. A
        LoraWeights (B already scaled) is accepted too. `tensors` of the result are views into the buffer."""
        if isinstance(weights, LoraWeights):
            one = np.float32(1.0)
            weights = LoraArrays(weights.content_id, weights.name, weights.max_rank, tuple(
                LoraModule(layer, m, a.float().numpy(), b.float().numpy(), one)
                for (layer, m), (a, b) in sorted(weights.tensors.items())))
        mods = {(m.layer, m.module): m for m in weights.modules}
        placed: list[_Placed] = []
        at = 0
        for layer in range(self.num_layers):
            for group, parts in self.slices.items():
                present = [(mi, off, size, mods[(layer, m)]) for (m, off, size), mi in zip(parts, self.part_modules[group])
                           if (layer, m) in mods]
                if not present:
                    continue
                d_in = present[0][3].a.shape[1]
                a_at, a_rows = at, sum(m.a.shape[0] for *_, m in present)
                at += a_rows * d_in
                spans, row = [], 0
                for mi, off, size, m in present:
                    r = m.a.shape[0]
                    spans.append((mi, off, size, row, r, at))
                    row += r
                    at += r * size
                placed.append((layer, group, a_at, a_rows, d_in, tuple(spans)))
        buf = np.empty(at, np.float32)
        base = buf.ctypes.data
        rows = np.zeros((self.num_layers, len(self.modules), 3), np.int64)
        with np.errstate(over="ignore"):  # a scale that overflows a weight to Inf is refused below
            for layer, group, a_at, _, d_in, spans in placed:
                for mi, off, size, row, r, b_at in spans:
                    m = mods[(layer, self.modules[mi])]
                    start = a_at + row * d_in
                    buf[start : start + r * d_in].reshape(r, d_in)[...] = m.a
                    np.multiply(m.b.T, m.scale, out=buf[b_at : b_at + r * size].reshape(r, size))
                    rows[layer, mi] = (base + start * 4, base + b_at * 4, r)
        if not np.isfinite(buf).all():
            weights.refuse_nonfinite()
        layout = _Slot(torch.from_numpy(buf), torch.from_numpy(rows), tuple(placed))
        return LoraWeights(weights.content_id, weights.name, weights.max_rank, _SlotViews(layout, self.modules),
                           slot_layout=layout)

    def install(self, slot: int, weights: LoraWeights) -> None:
        """Give `slot` the adapter's packed buffer (whatever it held is evicted): a table-row write when the
        loader packed it already (`pack`), else it is packed here."""
        assert not self._active[slot], "an active slot cannot be overwritten"
        self.evict(slot)
        layout = weights.slot_layout if isinstance(weights.slot_layout, _Slot) else self.pack(weights).slot_layout
        self.table[slot] = layout.table_rows
        self._rank[slot] = weights.max_rank
        self._slots[slot] = layout

    def evict(self, slot: int) -> None:
        assert not self._active[slot], "an active slot cannot be evicted"
        self.table[slot].zero_()  # before the buffer goes: no address in the table outlives its tensor
        self._rank[slot] = 0
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
        slot_rank = torch.tensor(self._rank, dtype=torch.int64)
        work = (end - start) * slot_rank[slots.clamp(min=0)]
        light = (work <= self.long_work) | (slots < 0)
        short = segs[(slots >= 0) & light].contiguous()
        long = []
        if not bool(light.all()):  # rare in decode: only then walk the segments in Python
            for slot, start_, end_ in meta.lora_segments():
                if (end_ - start_) * self._rank[slot] <= self.long_work:
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

    def plan_runs(self, runs: tuple[tuple[int, int, int], ...]) -> NativePlan:
        """The plan for a batch whose rows are grouped by slot: `runs` are its (slot, start, end) row
        ranges, each slot once (-1: base-model rows). Same split by work as `plan`."""
        short, long = [], []
        rank, limit = self._rank, self.long_work
        for slot, start, end in runs:
            if slot < 0:
                continue
            if (end - start) * rank[slot] <= limit:
                short.append((start, end, slot))
            else:
                long.append((slot, start, end, None))
        segs = torch.tensor(short, dtype=torch.int64) if short else torch.empty(0, 3, dtype=torch.int64)
        return NativePlan(None, segs, tuple(long))

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
