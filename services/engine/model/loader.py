"""Load a Hugging Face safetensors checkpoint directory into our decoder (optionally FP8 weights)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.config import ModelConfig
from services.engine.model.layers import Linear
from services.engine.model.llama import DecoderLayer, LlamaModel


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or tensors."""


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors weights (pickle checkpoints are not loaded)")
    return files


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(
    model_dir: Path, *, dtype: torch.dtype, device: str = "cpu", weight_dtype: str = "auto", pack: bool = False
) -> LlamaModel:
    """The checkpoint as our decoder; with `pack`, its projections also prepacked for the CPU's oneDNN GEMM
    (LlamaModel.pack_weights: a no-op off the CPU and for FP8)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    sd = read_state_dict(model_dir)

    def take(name: str) -> torch.Tensor:
        try:
            return sd.pop(name).to(device=device, dtype=dtype)
        except KeyError:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}") from None

    def proj(*names: str, bias: bool = False) -> Linear:
        w = torch.cat([take(f"{n}.weight") for n in names], dim=0).contiguous()
        b = torch.cat([take(f"{n}.bias") for n in names]).contiguous() if bias else None
        if weight_dtype == "fp8":
            from services.engine.kernels.fp8 import quantize_fp8

            return Linear(quantize_fp8(w), b)
        return Linear(w, b)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        layers.append(
            DecoderLayer(
                input_norm=take(f"{p}.input_layernorm.weight"),
                qkv=proj(f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj", bias=cfg.qkv_bias),
                o=proj(f"{p}.self_attn.o_proj"),
                post_norm=take(f"{p}.post_attention_layernorm.weight"),
                gate_up=proj(f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"),
                down=proj(f"{p}.mlp.down_proj"),
            )
        )
    embed = take("model.embed_tokens.weight")
    head = None if cfg.tie_word_embeddings or "lm_head.weight" not in sd else take("lm_head.weight")
    if weight_dtype == "fp8":
        # The embedding table and LM head too (per-row scales): on a small vocabulary model they are a
        # third of the weights, and leaving them wide would keep FP8 far from half the bytes.
        from services.engine.kernels.fp8 import quantize_fp8

        embed = quantize_fp8(embed)
        head = None if head is None else quantize_fp8(head)
    lm_head = Linear(embed if head is None else head)
    norm = take("model.norm.weight")
    sd.pop("lm_head.weight", None)
    leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise CheckpointError(f"checkpoint has tensors this decoder does not use: {leftovers[:5]}")
    model = LlamaModel(cfg, embed, layers, norm, lm_head, dtype, device)
    if pack:
        model.pack_weights()
    return model
