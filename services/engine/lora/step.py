"""One step's LoRA application: the token->slot mapping becomes SGMV metadata once, used by every layer."""
from __future__ import annotations

import torch

from services.engine.kernels import build_sgmv_meta, lora_expand, lora_shrink
from services.engine.lora.manager import AdapterManager


class StepLora:
    """Implements the model's LoraHook for one forward step."""

    def __init__(self, manager: AdapterManager, token_slots: torch.Tensor):
        self.manager = manager
        self.meta = build_sgmv_meta(token_slots)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        stacks = self.manager.stacks[layer]
        if self.manager.fused:  # one packed stack per group (CPU)
            st = stacks[group]
            lora_expand(lora_shrink(x, st.a, st.ranks, self.meta), st.b, st.ranks, self.meta, out)
            return
        for module, offset, _ in self.manager.slices[group]:
            st = stacks[module]
            v = lora_shrink(x, st.a, st.ranks, self.meta)
            lora_expand(v, st.b, st.ranks, self.meta, out, y_offset=offset)

