"""SGMV on the CPU in pure torch, batched by rank class: a handful of ops per step, whatever the adapters.

On the CPU a small matmul costs its dispatch (~2-5 us), not its FLOPs, so a per-segment loop over 40
adapters x 16 projections per step spends most of the step dispatching. Here a group's slot weights live
in rank-class stacks (see lora/cpu_slots.py): A^T as [entries, in, width] and B^T as [entries, width,
out], width a power of two >= the adapter's packed rank (zero padding, at most 2x). A step then needs, per
projection group: one gather of the short segments' rows (decode) into per-class grids, two bmm per class,
one index_add back; and one mm + addmm at the adapter's exact rank per long segment (prefill chunks, hot
adapters). The stacks are contiguous, so no weight is copied per step.

Semantics match lora_shrink_ref + lora_expand_ref (sgmv_ref.py), the tested oracle: y[t] += x[t] A^T B^T
for the slot of token t; rows with slot -1, or whose slot's adapter skips this group, are untouched.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.engine.kernels.sgmv_meta import SgmvMeta

SHORT_ROWS = 4  # segments with at most this many rows join their class's grid; longer ones run alone


@dataclass(frozen=True, slots=True)
class ClassBatch:
    """The short segments of one rank class: a [n, rows] grid (entries 0..n-1) at `offset` in the cells."""

    cls: int
    n: int
    rows: int
    offset: int


@dataclass(frozen=True, slots=True)
class LongSegment:
    """A segment too long for a grid: one exact-rank mm pair on its own."""

    cls: int
    entry: int
    start: int  # rows x[start:end] when `rows` is None (the batch is grouped by slot, the usual case)
    end: int
    rows: torch.Tensor | None = None  # explicit row indices otherwise


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """How one projection group applies every token's LoRA delta in one step (shared by all layers).

    The class grids are laid out one after another as `cells`: cell i reads x[gather[i]] and adds into
    y[scatter[i]]. Cells no token fills are listed in `pads`; they are zeroed before the matmuls and add
    exact zeros into row 0."""

    num_tokens: int
    batches: tuple[ClassBatch, ...] = ()
    long: tuple[LongSegment, ...] = ()
    gather: torch.Tensor | None = None  # [cells] int64
    scatter: torch.Tensor | None = None  # [cells] int64
    pads: torch.Tensor | None = None  # [pads] int64, None when every cell holds a token

    @property
    def cells(self) -> int:
        return 0 if self.gather is None else self.gather.numel()

    @property
    def is_empty(self) -> bool:
        return not self.batches and not self.long


def plan_group(
    meta: SgmvMeta,
    entry_of: Callable[[int], tuple[int, int] | None],
    *,
    short_rows: int = SHORT_ROWS,
) -> GroupPlan:
    """Sort the step's adapter segments into class grids and long segments.

    entry_of(slot) -> (class index, entry in that class's stacks), or None when the slot's adapter
    does not target this group."""
    if short_rows < 1:
        raise ValueError(f"short_rows must be >= 1, got {short_rows}")
    order = None if meta.is_identity else meta.token_indices_sorted.tolist()
    short: dict[int, list[tuple[int, int, int]]] = {}
    long: list[LongSegment] = []
    for slot, start, end in meta.lora_segments():
        where = entry_of(slot)
        if where is None:
            continue
        cls, entry = where
        if end - start <= short_rows:
            short.setdefault(cls, []).append((entry, start, end))
            continue
        rows = None
        if order is not None:
            seg = order[start:end]
            if seg == list(range(seg[0], seg[0] + len(seg))):
                start, end = seg[0], seg[0] + len(seg)
            else:
                rows = torch.tensor(seg, dtype=torch.int64)
        long.append(LongSegment(cls, entry, start, end, rows))
    if not short:
        return GroupPlan(meta.num_tokens, (), tuple(long))
    batches, gather, pads = [], [], []
    for cls in sorted(short):
        segs = short[cls]
        n = max(e for e, _, _ in segs) + 1
        rows = max(end - start for _, start, end in segs)
        offset = len(gather)
        cells = [-1] * (n * rows)
        for entry, start, end in segs:
            for j in range(end - start):
                cells[entry * rows + j] = start + j if order is None else order[start + j]
        pads += [offset + i for i, row in enumerate(cells) if row < 0]
        gather += cells
        batches.append(ClassBatch(cls, n, rows, offset))
    idx = torch.tensor(gather, dtype=torch.int64).clamp_(min=0)
    return GroupPlan(meta.num_tokens, tuple(batches), tuple(long), gather=idx, scatter=idx,
                     pads=torch.tensor(pads, dtype=torch.int64) if pads else None)


def lora_apply_classed(
    x: torch.Tensor,
    y: torch.Tensor,
    a_stacks: Sequence[torch.Tensor | None],
    b_stacks: Sequence[torch.Tensor | None],
    ranks: Sequence[Sequence[int]],
    plan: GroupPlan,
    *,
    check: bool = True,
) -> None:
    """y += LoRA delta of every planned token, in place.

    x [T, in], y [T, out] (row-major); a_stacks[c] [cap, in, width_c] = A^T per entry, b_stacks[c]
    [cap, width_c, out] = B^T per entry (scale folded in, zero beyond the entry's rank); ranks[c][e] =
    entry e's packed rank in this layer (long segments use exactly that many columns). `check=False` skips
    validating shapes, dtypes and strides: for callers that checked the same operands' shapes already."""
    if plan.is_empty:
        return
    if check:
        _check(x, y, a_stacks, b_stacks, plan)
    d_in, d_out = x.shape[1], y.shape[1]
    if plan.batches:
        grid = x.index_select(0, plan.gather)
        if plan.pads is not None:
            grid.index_fill_(0, plan.pads, 0)
        delta = y.new_empty(plan.cells, d_out)
        for b in plan.batches:
            cells = slice(b.offset, b.offset + b.n * b.rows)
            v = torch.bmm(grid[cells].view(b.n, b.rows, d_in), a_stacks[b.cls][: b.n])
            torch.bmm(v, b_stacks[b.cls][: b.n], out=delta[cells].view(b.n, b.rows, d_out))
        y.index_add_(0, plan.scatter, delta)
    for s in plan.long:
        r = ranks[s.cls][s.entry]
        if r == 0:
            continue
        a = a_stacks[s.cls][s.entry, :, :r]
        bt = b_stacks[s.cls][s.entry, :r]
        if s.rows is None:
            y[s.start : s.end].addmm_(x[s.start : s.end].mm(a), bt)
        else:
            y.index_add_(0, s.rows, x.index_select(0, s.rows).mm(a).mm(bt))


def _check(x, y, a_stacks, b_stacks, plan: GroupPlan) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != plan.num_tokens or y.shape[0] != plan.num_tokens:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must both have the plan's {plan.num_tokens} rows")
    if y.stride(1) != 1 or (y.shape[0] > 1 and y.stride(0) < y.shape[1]):
        raise ValueError(f"y must be row-major with unit column stride, got strides {y.stride()}")
    if x.dtype != y.dtype:
        raise ValueError(f"x ({x.dtype}) and y ({y.dtype}) must share a dtype")
    for b in plan.batches:
        if b.n > a_stacks[b.cls].shape[0]:
            raise ValueError(f"class {b.cls} grid spans {b.n} entries but its stack holds {a_stacks[b.cls].shape[0]}")
    for c in {b.cls for b in plan.batches} | {s.cls for s in plan.long}:
        a, b = a_stacks[c], b_stacks[c]
        if a is None or b is None:
            raise ValueError(f"class {c} has no stacks")
        if a.dim() != 3 or b.dim() != 3 or a.shape[1] != x.shape[1] or b.shape[2] != y.shape[1] or a.shape[2] != b.shape[1]:
            raise ValueError(f"class {c} stacks {tuple(a.shape)} / {tuple(b.shape)} do not fit x {tuple(x.shape)} -> y {tuple(y.shape)}")
        if a.dtype != x.dtype or b.dtype != x.dtype:
            raise ValueError(f"class {c} stacks must be {x.dtype}, got {a.dtype} / {b.dtype}")
