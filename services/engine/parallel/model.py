"""The decoder as one tensor-parallel rank runs it: its shard of every weight, the collectives between.

Per layer two all-reduces (after o and after down, each carrying the LoRA delta of its layer, see
shard.py), one for the vocabulary-parallel embedding, and one gather of the vocabulary-parallel logits to
rank 0 for sampling. Everything else (norms, RoPE, attention over the rank's own heads and KV) is local.
"""
from __future__ import annotations

import torch

from services.engine.model.layers import Linear
from services.engine.model.llama import DecoderLayer, LlamaModel
from services.engine.parallel.comm import TpComm
from services.engine.parallel.shard import TpShard


class TpLlamaModel(LlamaModel):
    """`config` is the rank's local shape (its heads, KV heads and MLP part; the full vocabulary), so the
    model runner sizes this rank's KV cache for its own KV heads."""

    def __init__(self, shard: TpShard, comm: TpComm, embed, layers: list[DecoderLayer], norm: torch.Tensor,
                 lm_head: Linear, dtype: torch.dtype, device: str):
        super().__init__(shard.local_config, embed, layers, norm, lm_head, dtype, device)
        self.shard = shard
        self.comm = comm
        # gloo reduces fp32 (and a bf16 sum of partials would round twice): narrower dtypes are reduced in
        # fp32 on the CPU. NCCL reduces in the model's dtype, as vLLM does.
        self._reduce_fp32 = dtype != torch.float32 and comm.backend == "gloo"

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        lo, hi = self.shard.vocab_range
        mine = (input_ids >= lo) & (input_ids < hi)
        local = torch.where(mine, input_ids - lo, torch.zeros_like(input_ids))
        h = super().embed_tokens(local) * mine.unsqueeze(1).to(self.dtype)
        return self.reduce(h)  # each token's row comes from exactly one rank: the sum is exact

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self._reduce_fp32:
            return self.comm.all_reduce(partial.float()).to(self.dtype)
        return self.comm.all_reduce(partial.contiguous())

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[B, vocab] fp32 on rank 0 (each rank's vocabulary shard, gathered, padding dropped); None elsewhere."""
        local = self.lm_head(hidden).float().contiguous()
        full = self.comm.gather_cat(local, dim=-1)
        return None if full is None else full[:, : self.shard.model.vocab_size]
