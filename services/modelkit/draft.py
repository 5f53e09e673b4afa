"""The kit's draft model for speculative decoding: the base model's first layers, embedding, final norm and
LM head, the layers and norm then trained on the base model's corpus (embedding and head frozen).

Starting from the base model's own early layers and head puts the draft's hidden states in the space the
head reads from the first step, so a short run suffices -- the kit's build time is what it is spent from.
It shares the base model's tokenizer (the engine refuses a draft model with another vocabulary).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.modelkit import corpus
from services.modelkit.config import DRAFT_DIR, DraftSpec
from services.modelkit.evaluate import EvalItem, load_tokenizer, score
from services.modelkit.tokenizer import special_ids
from services.modelkit.train import encode_examples, train


def build_draft(spec: DraftSpec, *, seed: int, eval_size: int, out_dir: Path, base_dir: Path, on_step) -> dict[str, Any]:
    """Train, save and score the draft model (runs in a kit worker process)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    ids = special_ids(tok)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = base.config.to_dict()
    cfg["num_hidden_layers"] = spec.num_layers
    draft = LlamaForCausalLM(type(base.config).from_dict(cfg))
    keep = {k: v for k, v in base.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < spec.num_layers}
    draft.load_state_dict(keep, strict=True)
    draft.generation_config = base.generation_config
    for p in (draft.model.embed_tokens.weight, draft.lm_head.weight):
        p.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    ev = corpus.base_eval_set(seed)
    n = spec.train.steps * spec.train.batch_size
    data = encode_examples(tok, corpus.base_training(seed, n, exclude=corpus.base_held_out(seed, eval_size)),
                           ids["<|end|>"])
    torch.manual_seed(seed + 2)
    res = train(draft, params, data, spec.train, pad_id=ids["<pad>"], desc="draft model", progress=False,
                on_step=on_step)
    path = out_dir / DRAFT_DIR
    draft.save_pretrained(path, safe_serialization=True)
    items = [EvalItem(e.prompt, e.answer) for e in ev]
    hf_tok = load_tokenizer(base_dir)
    drafted = score(draft, hf_tok, items)
    target = score(base, hf_tok, items)
    agree = sum(a == b for a, b in zip(drafted.answers, target.answers)) / len(items)
    return {
        "layers": spec.num_layers,
        "params": sum(p.numel() for p in draft.parameters()),
        "trained_params": sum(p.numel() for p in params),
        "final_loss": round(res.final_loss, 4),
        "seconds": round(res.seconds, 1),
        "eval_exact_match": round(drafted.exact_match, 4),
        "same_answer_as_base": round(agree, 4),
    }
