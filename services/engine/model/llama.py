"""The Llama-family decoder (Llama, Mistral, Qwen2 shapes) over a flattened, paged batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.config import ModelConfig
from services.engine.kernels.fp8 import Fp8Weight, fp8_embedding
from services.engine.model.attention import AttnMetadata, ElementwiseOps, LayerKV, paged_attention
from services.engine.model.layers import Linear, LoraHook, rms_norm
from services.engine.model.rope import RotaryEmbedding


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: Linear  # fused [q; k; v]
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # fused [gate; up]
    down: Linear


class LlamaModel:
    """Weights plus a forward over flattened tokens; K/V live in caches owned by the model runner."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor | Fp8Weight,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: Linear,
        dtype: torch.dtype,
        device: str,
    ):
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.device = device
        self.rope = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, dtype, device)
        self.scale = config.head_dim**-0.5

    def pack_weights(self, min_rows: int | None = None) -> int:
        """Prepack the dense projections and the LM head for the CPU's oneDNN GEMM too (Linear.pack) where it pays:
        `min_rows` None: measured on this machine, once per projection shape. Returns how many were packed (0 off
        the CPU, for FP8 weights, without oneDNN, or where it never won)."""
        projs = self.projections().values()
        for lin in projs:
            lin.pack(min_rows)  # measured once a process per shape (Linear.pack)
        return sum(lin.packed is not None for lin in projs)

    def projections(self) -> dict[str, Linear]:
        """Every projection by name ("layers.0.qkv", ..., "lm_head")."""
        out = {f"layers.{i}.{name}": getattr(layer, name) for i, layer in enumerate(self.layers)
               for name in ("qkv", "o", "gate_up", "down")}
        out["lm_head"] = self.lm_head
        return out

    def packing(self) -> str:
        """What pack_weights decided, for the engine's log: "qkv from 64 rows, o off, ..." (layer 0 and the head)."""
        projs = self.projections()
        if not any(lin.packed is not None for lin in projs.values()):
            return "off"
        return ", ".join(f"{name.rsplit('.', 1)[-1]} " + (f"from {lin.packed_min_rows} rows" if lin.packed is not None else "off")
                         for name, lin in projs.items() if name.startswith("layers.0.") or name == "lm_head")

    def num_params(self) -> int:
        def n(w) -> int:
            return (w.weight if isinstance(w, Fp8Weight) else w).numel()

        total = n(self.embed) + self.norm.numel()
        for layer in self.layers:
            total += sum(n(lin.weight) + (lin.bias.numel() if lin.bias is not None else 0)
                         for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += layer.input_norm.numel() + layer.post_norm.numel()
        if self.lm_head.weight is not self.embed:
            total += n(self.lm_head.weight)
        return total

    def weight_bytes(self) -> int:
        embed = self.embed.nbytes if isinstance(self.embed, Fp8Weight) else self.embed.numel() * self.embed.element_size()
        total = embed + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            total += sum(lin.weight_bytes() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * layer.input_norm.element_size()
        if self.lm_head.weight is not self.embed:
            total += self.lm_head.weight_bytes()
        else:  # a tied head's packed copy of the table, if any
            total += self.lm_head.packed_bytes
        return total

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnMetadata,
        kv_caches: list[LayerKV],
        lora: LoraHook | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden] -- or, given `keep` (increasing row
        indices, as the step's sampled rows are), those rows' only [len(keep), hidden]: the last layer writes
        every row's K/V, then attends (where a decode kernel attends the rows: paged_attention's `wanted`) and
        runs its o projection, MLP and the final norm for the kept rows alone -- a prompt chunk's other rows have
        no logits, and no later layer reads them (`_kept`)."""
        if attn.elementwise is not None:
            return self._forward_native(attn.elementwise, input_ids, positions, attn, kv_caches, lora, keep)
        cfg = self.config
        h = self.embed_tokens(input_ids)
        tables = self.rope.tables(positions)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = self._project(i, "qkv", layer.qkv, x, lora)
            kept = i == last and keep is not None and keep.shape[0] < h.shape[0]
            a = self._attend_torch(qkv, kv_caches[i], attn, tables, keep if kept else None)
            if kept:
                if keep.shape[0] == 0:  # a step of prompt chunks that sample nothing: its K/V was all it had to give
                    return h.new_empty((0, h.shape[1]))
                h, a, lora = self._kept(keep, h, a, lora)
            h = h + self.reduce(self._project(i, "o", layer.o, a, lora))
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            h = h + self.reduce(self._mlp(i, layer, x, lora))
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def _forward_native(self, ops: ElementwiseOps, input_ids: torch.Tensor, positions: torch.Tensor,
                        attn: AttnMetadata, kv_caches: list[LayerKV], lora: LoraHook | None,
                        keep: torch.Tensor | None = None) -> torch.Tensor:
        """The forward above with its elementwise work in native passes (CPU, fp32): the residual add fused into
        the next RMSNorm (h is updated in place), RoPE on q and k in place in the qkv output with the K/V rows
        written to the cache in the same pass (an fp8 cache keeps torch's RoPE and its writer). The same
        operations as the torch path; only RMSNorm's sum of squares differs in rounding
        (tests/engine/kernels/test_elementwise_native.py, test_attention_native.py, the oracle tests)."""
        cfg, eps, nt = self.config, self.config.rms_norm_eps, attn.num_threads
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed_tokens(input_ids)  # a new tensor: updated in place below
        delta = None
        tables = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(h, delta, layer.input_norm, eps, nt)
            qkv = self._project(i, "qkv", layer.qkv, x, lora)
            cache = kv_caches[i]
            kept = i == last and keep is not None and keep.shape[0] < h.shape[0]
            if cache.is_fp8:
                tables = tables or self.rope.tables(positions)
                a = self._attend_torch(qkv, cache, attn, tables, keep if kept else None)
            else:
                ops.rope_write_kv(qkv, nh, nkv, hd, positions, self.rope.cos, self.rope.sin_signed, cache.k, cache.v,
                                  attn.slot_mapping, nt)
                a = paged_attention(qkv[:, : cfg.q_size].view(-1, nh, hd), None, None, cache, attn, self.scale,
                                    keep if kept else None).view(-1, cfg.q_size)
            if kept:
                if keep.shape[0] == 0:  # a step of prompt chunks that sample nothing: its K/V was all it had to give
                    return h.new_empty((0, h.shape[1]))
                h, a, lora = self._kept(keep, h, a, lora)  # h holds this layer's input residual (updated above)
            x = ops.add_rms_norm(h, self.reduce(self._project(i, "o", layer.o, a, lora)), layer.post_norm, eps, nt)
            delta = self.reduce(self._mlp(i, layer, x, lora))
        return ops.add_rms_norm(h, delta, self.norm, eps, nt)

    @staticmethod
    def _kept(keep: torch.Tensor, h: torch.Tensor, a: torch.Tensor, lora: LoraHook | None):
        """The last layer's residual, attention output and LoRA hook cut to the kept rows. Everything after the
        last attention is row-wise (projections, RMSNorm, the MLP, LoRA deltas), so a kept row's hidden state is
        what the whole batch would give it, up to the GEMM's blocking over fewer rows (the oracle tests hold it
        to HF's greedy tokens)."""
        return h.index_select(0, keep), a.index_select(0, keep), (lora.rows(keep) if lora is not None else None)

    @staticmethod
    def _project(i: int, name: str, lin: Linear, x: torch.Tensor, lora: LoraHook | None) -> torch.Tensor:
        """A projection of layer i with its LoRA delta added in place."""
        y = lin(x)
        if lora is not None:
            lora.apply(i, name, x, y)
        return y

    def _attend_torch(self, qkv: torch.Tensor, cache: LayerKV, attn: AttnMetadata,
                      tables: tuple[torch.Tensor, torch.Tensor], wanted: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE on q and k in torch (cos / signed sin rows of the step: rope.tables), the K/V write and attention:
        [T, q_size]."""
        cfg = self.config
        qk, v = qkv.split((cfg.q_size + cfg.kv_size, cfg.kv_size), dim=-1)
        qk = self.rope.rotate(qk.view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), *tables)
        q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        return paged_attention(q, k, v.contiguous(), cache, attn, self.scale, wanted).view(-1, cfg.q_size)

    def _mlp(self, i: int, layer: DecoderLayer, x: torch.Tensor, lora: LoraHook | None) -> torch.Tensor:
        """down(silu(gate) * up) of layer i (LoRA deltas included), before the tensor-parallel reduce."""
        gate, up = self._project(i, "gate_up", layer.gate_up, x, lora).chunk(2, dim=-1)
        return self._project(i, "down", layer.down, F.silu(gate).mul_(up), lora)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, Fp8Weight):
            return fp8_embedding(input_ids, self.embed, self.dtype)
        return F.embedding(input_ids, self.embed)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output (o, down, LoRA delta included) made whole: the identity on one
        device; the sum over ranks under tensor parallelism (parallel/model.py)."""
        return partial

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
