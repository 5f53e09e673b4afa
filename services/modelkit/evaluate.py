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
    system: str = ""  # a system message before the user's (the tool eval's tools block), or none
    tool: str | None = None  # the tool eval: the tool a right answer calls (None: it answers in text)

    def messages(self) -> list[dict[str, str]]:
        user = [{"role": "user", "content": self.prompt}]
        return [{"role": "system", "content": self.system}, *user] if self.system else user


@dataclass(frozen=True, slots=True)
class EvalScore:
    total: int
    correct: int
    answers: tuple[str, ...]

    @property
    def exact_match(self) -> float:
        return self.correct / self.total if self.total else 0.0


def write_eval(path: Path, items: Sequence[EvalItem]) -> None:
    rows = ({"prompt": i.prompt, "expected": i.expected} | ({"system": i.system, "tool": i.tool} if i.system else {})
            for i in items)
    lines = (json.dumps(row, ensure_ascii=False) for row in rows)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def read_eval(path: Path) -> list[EvalItem]:
    rows = (json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip())
    return [EvalItem(r["prompt"], r["expected"], r.get("system", ""), r.get("tool")) for r in rows]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"  # batched generation appends on the right
    return tok


@torch.inference_mode()
def greedy_chat(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[list[dict[str, str]]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers to conversations that end with a user turn, rendered with the tokenizer's chat template."""
    model.eval()
    out: list[str] = []
    for i in range(0, len(conversations), batch_size):
        chats = list(conversations[i : i + batch_size])
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


def score(model: nn.Module, tokenizer: PreTrainedTokenizerBase, items: Sequence[EvalItem], *,
          max_new_tokens: int = 32) -> EvalScore:
    answers = greedy_chat(model, tokenizer, [i.messages() for i in items], max_new_tokens=max_new_tokens)
    correct = sum(a == i.expected for a, i in zip(answers, items))
    return EvalScore(total=len(items), correct=correct, answers=tuple(answers))
