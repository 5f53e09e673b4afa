"""Tiny random Llama checkpoints and PEFT adapters written from scratch for the adapter-pipeline tests
(seconds to build; the trained demo kit is used where an adapter must really be good)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.common.lora_format import BaseDims

SPECIALS = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
WORDS = ("apple banana cat dog sun moon tree river house book car bird fish star cloud rain snow stone music "
         "bread milk chair table door window garden flower ocean mountain city road train boat red green blue").split()


def build_tiny_model(out: Path, *, hidden: int = 64, intermediate: int = 128, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|end|>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
    }))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than HF's init: outputs vary with the prompt instead of one token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return out


def dims_of(model_dir: Path) -> BaseDims:
    return BaseDims.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def tensor_name(layer: int, module: str, which: str) -> str:
    group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{group}.{module}.lora_{which}.weight"


def lora_tensors(dims: BaseDims, *, rank: int, targets: tuple[str, ...], seed: int = 0, b_std: float = 0.05,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    md = dims.module_dims()
    out = {}
    for layer in range(dims.num_layers):
        for module in targets:
            d_in, d_out = md[module]
            out[tensor_name(layer, module, "A")] = (torch.randn(rank, d_in, generator=g) * 0.2).to(dtype)
            out[tensor_name(layer, module, "B")] = (torch.randn(d_out, rank, generator=g) * b_std).to(dtype)
    return out


def write_adapter(out: Path, dims: BaseDims, *, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                  seed: int = 0, b_std: float = 0.05, alpha: float | None = None, config: dict | None = None,
                  tensors: dict[str, torch.Tensor] | None = None, base_name: str | None = None) -> Path:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors); `config` overrides fields."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
           "base_model_name_or_path": base_name, "use_rslora": False, "use_dora": False}
    cfg.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else lora_tensors(dims, rank=rank, targets=targets, seed=seed, b_std=b_std),
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
