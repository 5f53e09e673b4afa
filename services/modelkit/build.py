"""Build the demo kit: tokenizer, base model, LoRA adapters and eval sets, into one directory.

Layout of a built kit (`out_dir`):
    base/                 HF model dir: config.json, model.safetensors, tokenizer files (chat template)
    adapters/<name>/      PEFT adapter: adapter_config.json + adapter_model.safetensors (nothing else)
    evals/base.jsonl      held-out {"prompt", "expected"} rows for the base model
    evals/<name>.jsonl    held-out rows for each adapter's task
    manifest.json         build key, hyper-parameters, per-stage losses/timings and eval scores

Everything is seeded and the thread count is fixed, so the same config builds the same weights.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from services.modelkit import corpus
from services.modelkit.config import AdapterSpec, KitConfig
from services.modelkit.evaluate import EvalItem, load_tokenizer, score, write_eval
from services.modelkit.tokenizer import save_hf_tokenizer, special_ids, train_tokenizer
from services.modelkit.train import encode_examples, train

log = logging.getLogger(__name__)


def _items(examples: list[corpus.Example]) -> list[EvalItem]:
    return [EvalItem(e.prompt, e.answer) for e in examples]


def build_demo(out_dir: Path, cfg: KitConfig, *, build_key: str, progress: bool = True) -> dict[str, Any]:
    """Build the whole kit into `out_dir` (which must be empty or absent); returns the manifest."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    t_all = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_dir, evals_dir = out_dir / "base", out_dir / "evals"
    evals_dir.mkdir(exist_ok=True)
    manifest: dict[str, Any] = {"build_key": build_key, "model_name": cfg.model_name, "config": asdict(cfg)}

    # -- tokenizer --------------------------------------------------------------------------------
    t0 = time.perf_counter()
    tok = train_tokenizer(
        corpus.tokenizer_corpus(cfg.seed, cfg.tokenizer.corpus_examples),
        vocab_size=cfg.tokenizer.vocab_size,
        min_frequency=cfg.tokenizer.min_frequency,
    )
    save_hf_tokenizer(tok, base_dir, model_max_length=cfg.model.max_position_embeddings)
    ids = special_ids(tok)
    manifest["tokenizer"] = {"vocab_size": tok.get_vocab_size(), "seconds": round(time.perf_counter() - t0, 2)}

    # -- base model -------------------------------------------------------------------------------
    base_eval = corpus.base_eval_set(cfg.seed)
    write_eval(evals_dir / "base.jsonl", _items(base_eval))
    n_train = cfg.base_train.steps * cfg.base_train.batch_size
    train_set = corpus.base_training(cfg.seed, n_train, exclude={e.prompt for e in base_eval})
    m = cfg.model
    torch.manual_seed(cfg.seed)
    lm_cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        initializer_range=m.initializer_range,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["<|end|>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    lm = LlamaForCausalLM(lm_cfg)
    data = encode_examples(tok, train_set, ids["<|end|>"])
    res = train(lm, list(lm.parameters()), data, cfg.base_train, pad_id=ids["<pad>"], desc="base model", progress=progress)
    lm.generation_config.pad_token_id = ids["<pad>"]
    lm.generation_config.eos_token_id = ids["<|end|>"]
    lm.generation_config.bos_token_id = ids["<s>"]
    lm.save_pretrained(base_dir, safe_serialization=True)
    hf_tok = load_tokenizer(base_dir)
    base_score = score(lm, hf_tok, _items(base_eval))
    manifest["base"] = {
        "params": sum(p.numel() for p in lm.parameters()),
        "final_loss": round(res.final_loss, 4),
        "seconds": round(res.seconds, 1),
        "eval_exact_match": round(base_score.exact_match, 4),
    }
    log.info("base model: loss %.3f, eval exact match %.2f", res.final_loss, base_score.exact_match)

    # -- adapters ---------------------------------------------------------------------------------
    manifest["adapters"] = {}
    for spec in cfg.adapters:
        manifest["adapters"][spec.name] = _build_adapter(
            spec, cfg, out_dir, base_dir, tok, ids, progress=progress,
            LoraConfig=LoraConfig, get_peft_model=get_peft_model,
        )
    manifest["seconds"] = round(time.perf_counter() - t_all, 1)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def _build_adapter(spec: AdapterSpec, cfg: KitConfig, out_dir: Path, base_dir: Path, tok, ids, *, progress: bool,
                   LoraConfig, get_peft_model) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    ev = corpus.adapter_eval_set(spec.task, cfg.eval_size, cfg.seed)
    write_eval(out_dir / "evals" / f"{spec.name}.jsonl", _items(ev))
    n = spec.train.steps * spec.train.batch_size
    examples = corpus.adapter_training(spec.task, cfg.seed, n, exclude={e.prompt for e in ev})
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    hf_tok = load_tokenizer(base_dir)
    base_only = score(base, hf_tok, _items(ev))
    torch.manual_seed(cfg.seed + 1)
    lora_cfg = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.target_modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lora_cfg)
    inner = peft_model.get_base_model()  # the LlamaForCausalLM with LoRA layers injected in place
    params = [p for p in peft_model.parameters() if p.requires_grad]
    data = encode_examples(tok, examples, ids["<|end|>"])
    res = train(inner, params, data, spec.train, pad_id=ids["<pad>"], desc=f"adapter {spec.name}", progress=progress)
    adapter_dir = out_dir / "adapters" / spec.name
    peft_model.peft_config["default"].base_model_name_or_path = cfg.model_name
    peft_model.save_pretrained(adapter_dir, safe_serialization=True)
    for extra in adapter_dir.iterdir():  # PEFT also writes a model card; the kit ships exactly the two files
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()
    tuned = score(peft_model, hf_tok, _items(ev))
    log.info("adapter %s: loss %.3f, exact match %.2f (base %.2f)", spec.name, res.final_loss,
             tuned.exact_match, base_only.exact_match)
    return {
        "task": spec.task,
        "rank": spec.rank,
        "target_modules": list(spec.target_modules),
        "final_loss": round(res.final_loss, 4),
        "seconds": round(res.seconds, 1),
        "eval_exact_match": round(tuned.exact_match, 4),
        "base_exact_match": round(base_only.exact_match, 4),
    }
