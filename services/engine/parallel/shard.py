"""Which part of every weight one tensor-parallel rank holds (Megatron-style), and the same for LoRA.

Column-parallel projections (q/k/v, gate/up) split their output rows: a rank holds whole attention heads
and whole KV heads (with GQA, each KV head stays with the query heads that read it), and an equal part of
the MLP. Row-parallel ones (o, down) split their input columns; their partial outputs are summed by one
all-reduce each. The embedding and the LM head split the vocabulary (the last shard padded when it does
not divide). LoRA follows its base layer (S-LoRA): column-parallel layers split B by output rows with A
whole; row-parallel ones split A by input columns with B whole, so that each rank's x_part A_part^T B^T is
a partial sum of the full delta and rides in the layer's own all-reduce.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.engine.config import ModelConfig
from services.engine.lora.weights import LoraArrays, LoraModule

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class TpShard:
    """Rank `rank` of `size` over a model of shape `model` (the whole model's config)."""

    model: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size

    # -- the rank's shapes ----------------------------------------------------------------------------
    @property
    def local_config(self) -> ModelConfig:
        """The shapes this rank computes with: its heads, KV heads and MLP part; the full vocabulary (the
        logits are gathered before sampling) and hidden size (activations are whole between layers)."""
        m = self.model
        n = self.size
        return dataclasses.replace(m, num_heads=m.num_heads // n, num_kv_heads=m.num_kv_heads // n,
                                   intermediate_size=m.intermediate_size // n)

    @property
    def vocab_shard(self) -> int:
        """Rows of the embedding / LM head each rank holds (the last one padded)."""
        return -(-self.model.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows this rank holds (end - start < vocab_shard on a padded rank)."""
        s = self.vocab_shard
        return min(self.rank * s, self.model.vocab_size), min((self.rank + 1) * s, self.model.vocab_size)

    def out_range(self, module: str) -> tuple[int, int]:
        """[start, end) of the output rows of a column-parallel module this rank holds."""
        m, r = self.model, self.rank
        full = {"q_proj": m.q_size, "k_proj": m.kv_size, "v_proj": m.kv_size,
                "gate_proj": m.intermediate_size, "up_proj": m.intermediate_size}[module]
        part = full // self.size
        return r * part, (r + 1) * part

    def in_range(self, module: str) -> tuple[int, int]:
        """[start, end) of the input columns of a row-parallel module this rank holds."""
        m, r = self.model, self.rank
        part = {"o_proj": m.q_size, "down_proj": m.intermediate_size}[module] // self.size
        return r * part, (r + 1) * part

    def module_dims(self, dims: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """(in, out) of every LoRA-capable projection as this rank computes it."""
        out = {}
        for module, (d_in, d_out) in dims.items():
            if module in COLUMN_PARALLEL:
                lo, hi = self.out_range(module)
                out[module] = (d_in, hi - lo)
            else:
                lo, hi = self.in_range(module)
                out[module] = (hi - lo, d_out)
        return out

    # -- LoRA ---------------------------------------------------------------------------------------------
    def slice_lora(self, arrays: LoraArrays) -> LoraArrays:
        """This rank's part of a validated adapter (numpy views; the slot packer copies them)."""
        mods = []
        for m in arrays.modules:
            if m.module in COLUMN_PARALLEL:
                lo, hi = self.out_range(m.module)
                mods.append(LoraModule(m.layer, m.module, m.a, m.b[lo:hi], m.scale))
            else:
                lo, hi = self.in_range(m.module)
                mods.append(LoraModule(m.layer, m.module, m.a[:, lo:hi], m.b, m.scale))
        return dataclasses.replace(arrays, modules=tuple(mods))
