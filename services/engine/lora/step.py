"""One step's LoRA application: the token->slot mapping becomes SGMV metadata once, used by every layer."""
from __future__ import annotations

import torch

from services.engine.kernels import build_sgmv_meta, lora_expand, lora_shrink
from services.engine.lora.manager import AdapterManager
from services.engine.lora.native_slots import NativeSlotTable


def slot_runs(rows) -> tuple[tuple[int, int, int], ...] | None:
    """(slot, first row, end row) of each run of rows sharing an adapter slot, from (slot, row count) pairs in row
    order, or None if a slot recurs after another (the rows are then not grouped by slot)."""
    runs: list[list[int]] = []
    row = 0
    for slot, n in rows:
        if runs and runs[-1][0] == slot:
            runs[-1][2] = row + n
        else:
            runs.append([slot, row, row + n])
        row += n
    if len({r[0] for r in runs}) != len(runs):
        return None
    return tuple(map(tuple, runs))


class StepLora:
    """Implements the model's LoraHook for one forward step."""

    def __init__(self, manager: AdapterManager, token_slots: torch.Tensor,
                 runs: tuple[tuple[int, int, int], ...] | None = None):
        self.manager = manager
        self.token_slots = token_slots
        cpu = manager.cpu
        if runs is not None and isinstance(cpu, NativeSlotTable):
            # The rows are grouped by slot already (the scheduler sorts them): the native kernel's segments
            # are those runs, with no sort of the token->slot map (~0.2 ms a step in Python and torch calls).
            self.meta = None
            self.cpu_plan = cpu.plan_runs(runs)
            return
        self.meta = build_sgmv_meta(token_slots)
        # CPU: the step's segments (native kernel) or each group's class grids (torch path), planned once
        # for all layers.
        self.cpu_plan = cpu.plan(self.meta) if cpu is not None else None

    def rows(self, keep: torch.Tensor) -> StepLora:
        """This step's LoRA over the rows `keep` (increasing) only: their slots, in runs where a slot does not
        recur after another (as the scheduler groups them), planned like a step of their own."""
        slots = self.token_slots.index_select(0, keep.to(self.token_slots.device))
        return StepLora(self.manager, slots, slot_runs((slot, 1) for slot in slots.tolist()))

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.cpu_plan is not None:
            self.manager.cpu.apply(layer, group, x, out, self.cpu_plan)
            return
        stacks = self.manager.stacks[layer]
        for module, offset, _ in self.manager.slices[group]:
            st = stacks[module]
            v = lora_shrink(x, st.a, st.ranks, self.meta)
            lora_expand(v, st.b, st.ranks, self.meta, out, y_offset=offset)
