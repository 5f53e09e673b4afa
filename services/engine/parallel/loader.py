"""Load one tensor-parallel rank's shard of a safetensors checkpoint: each rank reads only its slices
(safe_open + get_slice reads just those bytes of the memory-mapped file), never a whole copy of the model.

FP8: column-parallel weights keep whole rows, so each row's per-channel scale is the unsharded one; a
row-parallel shard holds part of each row, and its rows' absolute maxima are all-reduced (max) across the
ranks first, so every rank quantizes with the unsharded weight's scales and TP=N stores exactly the FP8
weights TP=1 does.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from services.engine.model.layers import Linear
from services.engine.model.llama import DecoderLayer
from services.engine.model.loader import CheckpointError, _checkpoint_files
from services.engine.parallel.comm import TpComm
from services.engine.parallel.model import TpLlamaModel
from services.engine.parallel.shard import TpShard


class _Reader:
    """Slices of named tensors across the checkpoint's files, each file opened once."""

    def __init__(self, stack: contextlib.ExitStack, model_dir: Path, dtype: torch.dtype, device: str):
        self.where: dict[str, object] = {}
        for path in _checkpoint_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():
                self.where[name] = f
        self.dtype, self.device = dtype, device
        self.read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        f = self.where.get(name)
        if f is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        sl = f.get_slice(name)
        if rows is not None:
            t = sl[rows[0]:rows[1]]
        elif cols is not None:
            t = sl[:, cols[0]:cols[1]]
        else:
            t = sl[:]
        self.read.add(name)
        return t.to(device=self.device, dtype=self.dtype)


def load_shard(model_dir: Path, shard: TpShard, comm: TpComm, *, dtype: torch.dtype, device: str,
               weight_dtype: str = "auto") -> TpLlamaModel:
    """This rank's shard of the checkpoint as a TpLlamaModel. Every rank of the group calls it at once (the
    FP8 scales of row-parallel weights are agreed by an all-reduce)."""
    cfg = shard.model
    fp8 = weight_dtype == "fp8"
    with contextlib.ExitStack() as stack:
        rd = _Reader(stack, Path(model_dir), dtype, device)

        def column(prefix: str, modules: tuple[str, ...], bias: bool = False) -> Linear:
            ranges = [shard.out_range(m) for m in modules]
            w = torch.cat([rd.get(f"{prefix}.{m}.weight", rows=r) for m, r in zip(modules, ranges)]).contiguous()
            b = torch.cat([rd.get(f"{prefix}.{m}.bias", rows=r) for m, r in zip(modules, ranges)]) if bias else None
            return _linear(w, b, fp8)

        def row(prefix: str, module: str) -> Linear:
            if rd.has(f"{prefix}.{module}.bias"):
                raise CheckpointError(f"{prefix}.{module} has a bias: a row-parallel bias is not supported")
            w = rd.get(f"{prefix}.{module}.weight", cols=shard.in_range(module)).contiguous()
            if not fp8:
                return Linear(w)
            from services.engine.kernels.fp8 import quantize_fp8

            amax = w.detach().float().abs().amax(dim=1)
            comm.all_reduce(amax, dist.ReduceOp.MAX)
            return Linear(quantize_fp8(w, amax))

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            layers.append(DecoderLayer(
                input_norm=rd.get(f"{p}.input_layernorm.weight"),
                qkv=column(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"), bias=cfg.qkv_bias),
                o=row(f"{p}.self_attn", "o_proj"),
                post_norm=rd.get(f"{p}.post_attention_layernorm.weight"),
                gate_up=column(f"{p}.mlp", ("gate_proj", "up_proj")),
                down=row(f"{p}.mlp", "down_proj"),
            ))
        embed = _vocab_rows(rd, "model.embed_tokens.weight", shard)
        tied = cfg.tie_word_embeddings or not rd.has("lm_head.weight")
        head = None if tied else _vocab_rows(rd, "lm_head.weight", shard)
        norm = rd.get("model.norm.weight")
        leftovers = [k for k in rd.where if k not in rd.read and k != "lm_head.weight"
                     and not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise CheckpointError(f"checkpoint has tensors this decoder does not use: {leftovers[:5]}")
    if fp8:
        from services.engine.kernels.fp8 import quantize_fp8

        embed = quantize_fp8(embed)  # per-row scales: a vocabulary shard's rows are whole
        head = None if head is None else quantize_fp8(head)
    lm_head = Linear(embed if head is None else head)
    return TpLlamaModel(shard, comm, embed, layers, norm, lm_head, dtype, device)


def _linear(w: torch.Tensor, b: torch.Tensor | None, fp8: bool) -> Linear:
    if fp8:
        from services.engine.kernels.fp8 import quantize_fp8

        return Linear(quantize_fp8(w), b)
    return Linear(w, b)


def _vocab_rows(rd: _Reader, name: str, shard: TpShard) -> torch.Tensor:
    """This rank's vocabulary rows, padded with zero rows to the shard size (a padded row is never looked up
    and its logit is dropped before sampling)."""
    lo, hi = shard.vocab_range
    t = rd.get(name, rows=(lo, hi))
    pad = shard.vocab_shard - (hi - lo)
    if pad:
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
    return t.contiguous()
