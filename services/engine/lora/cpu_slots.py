"""Device-slot storage for the CPU: each projection group's adapters in rank-class stacks.

A slot's adapter gets, per group it targets, one entry in the stack of the smallest class whose width
holds its packed rank (the ranks of the group's targeted modules side by side; the widest layer counts
when rank_pattern varies by layer). Entries of *active* slots (pinned by running sequences) are kept in
a prefix [0, active) of their stack — a slot that becomes active or idle trades places with the entry
at the boundary — so a step's bmm spans only adapters that run, never idle cached ones. Stacks grow by
doubling up to the slot count, so memory follows the adapters actually installed. The math lives in
kernels/sgmv_cpu.py; this class owns the layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.kernels.sgmv_cpu import GroupPlan, lora_apply_classed, plan_group
from services.engine.kernels.sgmv_meta import SgmvMeta
from services.engine.lora.weights import LoraWeights

MIN_WIDTH = 4  # classes double from here: narrow adapters must not read (and multiply) 16 columns of padding


def class_widths(max_packed: int) -> tuple[int, ...]:
    """Powers of two from MIN_WIDTH up to (and ending at) the group's largest packed rank."""
    widths, w = [], min(MIN_WIDTH, max_packed)
    while w < max_packed:
        widths.append(w)
        w *= 2
    widths.append(max_packed)
    return tuple(widths)


@dataclass(slots=True)
class _Pool:
    """The entries of one (group, class); one tensor holds every layer."""

    width: int
    d_in: int
    d_out: int
    a: torch.Tensor | None = None  # [layers, cap, d_in, width] = A^T per entry
    b: torch.Tensor | None = None  # [layers, cap, width, d_out] = B^T per entry
    ranks: list[list[int]] = field(default_factory=list)  # per layer, per entry: packed rank (0 = none)
    owner: list[int | None] = field(default_factory=list)  # entry -> slot
    active: int = 0  # entries [0, active) belong to active slots

    @property
    def capacity(self) -> int:
        return len(self.owner)


class CpuSlotStacks:
    def __init__(
        self,
        num_layers: int,
        slices: dict[str, list[tuple[str, int, int]]],
        dims: dict[str, tuple[int, int]],
        *,
        max_rank: int,
        max_slots: int,
        dtype: torch.dtype,
        device: str = "cpu",
    ):
        self.num_layers = num_layers
        self.slices = slices
        self.max_slots = max_slots
        self.dtype = dtype
        self.device = device
        self.pools: dict[str, list[_Pool]] = {}
        for group, parts in slices.items():
            d_in = dims[parts[0][0]][0]
            d_out = sum(size for _, _, size in parts)
            self.pools[group] = [_Pool(w, d_in, d_out, ranks=[[] for _ in range(num_layers)])
                                 for w in class_widths(max_rank * len(parts))]
        self._entries: list[dict[str, tuple[int, int]]] = [{} for _ in range(max_slots)]  # slot -> group -> (cls, entry)
        self._active = [False] * max_slots
        # group -> per layer (A stacks, B stacks, ranks) by class: a step indexes these 16 times, and a
        # tensor's __getitem__ costs a dispatch; rebuilt when a pool grows (its tensors are replaced).
        self._views: dict[str, list[tuple[list, list, list]]] = {}

    # -- install / evict -------------------------------------------------------------------------
    def install(self, slot: int, weights: LoraWeights) -> None:
        """Write an adapter's weights into idle entries for `slot` (whatever it held before is evicted)."""
        assert not self._active[slot], "an active slot cannot be overwritten"
        self.evict(slot)
        for group, parts in self.slices.items():
            per_layer = [[(weights.tensors[(layer, m)], off, size) for m, off, size in parts if (layer, m) in weights.tensors]
                         for layer in range(self.num_layers)]
            packed = [sum(a.shape[0] for (a, _), _, _ in layer_parts) for layer_parts in per_layer]
            if max(packed) == 0:
                continue
            pools = self.pools[group]
            cls = next(i for i, p in enumerate(pools) if p.width >= max(packed))
            pool = pools[cls]
            entry = self._alloc(pool, slot)
            at, bt = pool.a[:, entry], pool.b[:, entry]
            at.zero_()
            bt.zero_()
            for layer, layer_parts in enumerate(per_layer):
                col = 0
                for (a, b), off, size in layer_parts:
                    r = a.shape[0]
                    at[layer, :, col : col + r].copy_(a.t())
                    bt[layer, col : col + r, off : off + size].copy_(b.t())
                    col += r
                pool.ranks[layer][entry] = col
            self._entries[slot][group] = (cls, entry)

    def evict(self, slot: int) -> None:
        assert not self._active[slot], "an active slot cannot be evicted"
        for group, (cls, entry) in self._entries[slot].items():
            pool = self.pools[group][cls]
            pool.owner[entry] = None
            for layer in range(self.num_layers):
                pool.ranks[layer][entry] = 0
        self._entries[slot] = {}

    def _alloc(self, pool: _Pool, slot: int) -> int:
        free = [e for e in range(pool.active, pool.capacity) if pool.owner[e] is None]
        if not free:
            self._grow(pool)
            return self._alloc(pool, slot)
        pool.owner[free[0]] = slot
        return free[0]

    def _grow(self, pool: _Pool) -> None:
        old = pool.capacity
        new = min(self.max_slots, max(4, 2 * old))
        assert new > old, "a pool cannot need more entries than there are slots"
        # Uninitialised is fine: install zeroes an entry before use and free entries are never read.
        a = torch.empty(self.num_layers, new, pool.d_in, pool.width, dtype=self.dtype, device=self.device)
        b = torch.empty(self.num_layers, new, pool.width, pool.d_out, dtype=self.dtype, device=self.device)
        if old:
            a[:, :old].copy_(pool.a)
            b[:, :old].copy_(pool.b)
        pool.a, pool.b = a, b
        self._views.clear()
        for ranks in pool.ranks:
            ranks.extend([0] * (new - old))
        pool.owner.extend([None] * (new - old))

    # -- active prefix -------------------------------------------------------------------------------
    def activate(self, slot: int) -> None:
        """The slot's adapter runs from now on: move its entries into the active prefix."""
        assert not self._active[slot]
        self._active[slot] = True
        for group, (cls, entry) in list(self._entries[slot].items()):
            pool = self.pools[group][cls]
            self._swap(group, cls, entry, pool.active)
            pool.active += 1

    def deactivate(self, slot: int) -> None:
        """No running sequence uses the slot any more: move its entries out of the active prefix."""
        assert self._active[slot]
        self._active[slot] = False
        for group, (cls, entry) in list(self._entries[slot].items()):
            pool = self.pools[group][cls]
            pool.active -= 1
            self._swap(group, cls, entry, pool.active)

    def _swap(self, group: str, cls: int, i: int, j: int) -> None:
        if i == j:
            return
        pool = self.pools[group][cls]
        pool.a[:, [i, j]] = pool.a[:, [j, i]]
        pool.b[:, [i, j]] = pool.b[:, [j, i]]
        for ranks in pool.ranks:
            ranks[i], ranks[j] = ranks[j], ranks[i]
        pool.owner[i], pool.owner[j] = pool.owner[j], pool.owner[i]
        for e in (i, j):
            if pool.owner[e] is not None:
                self._entries[pool.owner[e]][group] = (cls, e)

    # -- one step ----------------------------------------------------------------------------------
    def plan(self, meta: SgmvMeta) -> dict[str, GroupPlan]:
        return {group: plan_group(meta, lambda slot, g=group: self._entries[slot].get(g)) for group in self.slices}

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, plans: dict[str, GroupPlan]) -> None:
        views = self._views.get(group)
        if views is None:
            pools = self.pools[group]
            views = self._views[group] = [
                ([None if p.a is None else p.a[layer] for p in pools], [None if p.b is None else p.b[layer] for p in pools],
                 [p.ranks[layer] for p in pools])
                for layer in range(self.num_layers)]
        a, b, ranks = views[layer]
        # Every layer of a group has the same shapes: checking the first layer's call checks them all.
        lora_apply_classed(x, y, a, b, ranks, plans[group], check=layer == 0)

    # -- views and checks ----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pools in self.pools.values() for p in pools
                   for t in (p.a, p.b) if t is not None)

    def check_integrity(self) -> None:
        for group, pools in self.pools.items():
            for cls, pool in enumerate(pools):
                for entry, slot in enumerate(pool.owner):
                    if slot is None:
                        assert entry >= pool.active and all(r[entry] == 0 for r in pool.ranks), (group, cls, entry)
                        continue
                    assert self._entries[slot].get(group) == (cls, entry), (group, cls, entry, slot)
                    assert self._active[slot] == (entry < pool.active), (group, cls, entry, slot)
        for slot, groups in enumerate(self._entries):
            for group, (cls, entry) in groups.items():
                assert self.pools[group][cls].owner[entry] == slot
