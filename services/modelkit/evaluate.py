"""Greedy chat generation with transformers (the oracle path) and exact-match scoring of eval files."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class EvalItem:
    prompt: str  # the user message
    expected: str  # the exact assistant answer


@dataclass(frozen=True, slots=True)
class EvalScore:
    total: int
    correct: int
    answers: tuple[str, ...]

    @property
    def exact_match(self) -> float:
        return self.correct / self.total if self.total else 0.0


def write_eval(path: Path, items: Sequence[EvalItem]) -> None:
    lines = (json.dumps({"prompt": i.prompt, "expected": i.expected}, ensure_ascii=False) for i in items)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def read_eval(path: Path) -> list[EvalItem]:
    rows = (json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip())
    return [EvalItem(r["prompt"], r["expected"]) for r in rows]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"  # batched generation appends on the right
    return tok


@torch.inference_mode()
def greedy_chat(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers to single-turn user prompts, rendered with the tokenizer's chat template."""
    model.eval()
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chats = [[{"role": "user", "content": p}] for p in prompts[i : i + batch_size]]
        enc = tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        gen = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = gen[:, enc["input_ids"].shape[1] :]
        out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return out


def score(model: nn.Module, tokenizer: PreTrainedTokenizerBase, items: Sequence[EvalItem]) -> EvalScore:
    answers = greedy_chat(model, tokenizer, [i.prompt for i in items])
    correct = sum(a == i.expected for a, i in zip(answers, items))
    return EvalScore(total=len(items), correct=correct, answers=tuple(answers))
