"""Random-weight checkpoints and PEFT adapters in seconds, for tests and benchmarks.

`build_tiny_random` writes a complete Hugging Face model directory (config, safetensors weights,
tokenizer with the demo chat template) for the architectures the engine supports; its weights are
drawn wider than HF's default init so greedy outputs depend on the prompt instead of collapsing to
one token. `make_random_adapter` writes a standard PEFT LoRA adapter for any base directory with
non-zero A *and* B (a freshly initialised PEFT adapter has B = 0 and would change nothing).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.common.lora_format import BaseDims
from services.modelkit.corpus import tokenizer_corpus
from services.modelkit.tokenizer import save_hf_tokenizer, special_ids, train_tokenizer

ARCHS = ("llama", "mistral", "qwen2")
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTN_MODULES + MLP_MODULES


def build_tiny_random(
    out_dir: Path | str,
    *,
    arch: str = "llama",
    seed: int = 0,
    hidden: int = 64,
    intermediate: int | None = None,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 512,
    sliding_window: int = 32,
    init_std: float = 0.08,
) -> Path:
    """A random `arch` checkpoint with a real BPE tokenizer; returns `out_dir`.

    The model's vocabulary is exactly the tokenizer's, so every id the model can emit decodes.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(tokenizer_corpus(seed, 1500), vocab_size=vocab_size, min_frequency=2)
    save_hf_tokenizer(tok, out, model_max_length=max_position_embeddings)
    ids = special_ids(tok)
    common: dict[str, Any] = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["<|end|>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    if rope_scaling is not None:
        # transformers 5 keeps theta and the scaling in one `rope_parameters` dict.
        common["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=sliding_window)
    else:
        cfg = Qwen2Config(**common, use_sliding_window=False)
    _save_random(cfg, out, seed=seed, init_std=init_std)
    return out


def _save_random(cfg: Any, out: Path, *, seed: int, init_std: float) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(out, safe_serialization=True)


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    # PEFT's rule: a pattern applies when it matches a dotted suffix of the module's full name.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def make_random_adapter(
    base_dir: Path | str,
    out_dir: Path | str,
    *,
    rank: int,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    lora_alpha: float | None = None,
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    init_scale: float = 1.0,
    layers: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    base_model_name_or_path: str | None = None,
) -> Path:
    """A PEFT LoRA adapter with random A and B for the model in `base_dir`; returns `out_dir`.

    The scale is chosen so the adapter visibly changes greedy outputs without swamping the base:
    A ~ N(0, 1/d_in), B ~ N(0, init_scale * 0.5 / r_eff) where r_eff undoes the LoRA scaling.
    """
    unknown = set(target_modules) - set(ALL_MODULES)
    if unknown or not target_modules:
        raise ValueError(f"target_modules must be a non-empty subset of {ALL_MODULES}, got {list(target_modules)}")
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    dims = BaseDims.from_hf_config(cfg).module_dims()
    n_layers = int(cfg["num_hidden_layers"])
    rank_pattern = dict(rank_pattern or {})
    alpha_pattern = dict(alpha_pattern or {})
    alpha = float(lora_alpha if lora_alpha is not None else 2 * rank)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers if layers is not None else range(n_layers):
        for module in target_modules:
            group = "self_attn" if module in ATTN_MODULES else "mlp"
            full = f"model.layers.{layer}.{group}.{module}"
            r = int(_pattern_value(rank_pattern, full, rank))
            a = float(_pattern_value(alpha_pattern, full, alpha))
            scaling = a / (r**0.5 if use_rslora else r)
            d_in, d_out = dims[module]
            prefix = f"base_model.model.{full}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(dtype)
            b_std = init_scale * 0.5 / (scaling * r**0.5)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, r, generator=g) * b_std).to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "layers_to_transform": list(layers) if layers is not None else None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
