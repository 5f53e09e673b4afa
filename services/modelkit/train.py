"""Training loop shared by the base model (full fine-tune) and the adapters (LoRA): answer-only loss."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from torch import nn
from tqdm.auto import tqdm

from services.modelkit.config import TrainConfig
from services.modelkit.corpus import Example
from services.modelkit.tokenizer import render_chat


@dataclass(frozen=True, slots=True)
class Encoded:
    ids: list[int]  # prompt + answer + <|end|>
    prompt_len: int


@dataclass(frozen=True, slots=True)
class TrainResult:
    steps: int
    final_loss: float  # mean answer-token loss over the last 10% of steps
    seconds: float


def encode_examples(tok: Tokenizer, examples: Sequence[Example], end_id: int) -> list[Encoded]:
    # Prompt and answer are encoded apart: the answer's tokens are then exactly the tokens a model
    # emits after the generation prompt, which is the contract at inference.
    prompts = tok.encode_batch([render_chat(e.messages(), add_generation_prompt=True) for e in examples], add_special_tokens=False)
    answers = tok.encode_batch([e.answer for e in examples], add_special_tokens=False)
    return [Encoded(p.ids + a.ids + [end_id], len(p.ids)) for p, a in zip(prompts, answers)]


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's examples packed into rows: `ids`, `positions` and `targets` [rows, width]; `loss_mask`
    marks the positions whose target is an answer token."""

    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor


def collate(batch: Sequence[Encoded], pad_id: int) -> Batch:
    """Pack a step's examples into as few rows as hold them (first-fit, longest first), rows as wide as
    the longest example.

    Padding every example to the longest one made 30% of a base-model step's tokens pads (its corpus
    mixes short and long tasks). An adapter's examples are of similar lengths, so most of its rows still
    hold one example. (Rows twice as wide packed more, but the one kit built with them had weaker demo
    adapters.) Position ids restart at 0 for every example, which transformers reads as packed sequences
    and masks block-diagonally, so no example attends to another:
    the same computation as one row per example, on fewer rows. The pads filling a row's tail continue its
    last example's positions and come after it, so causal attention keeps them out of every real token.
    """
    width = max(len(e.ids) for e in batch)
    rows: list[list[Encoded]] = []
    fill: list[int] = []
    for e in sorted(batch, key=lambda e: -len(e.ids)):  # stable: equal lengths keep the data order
        row = next((r for r, used in enumerate(fill) if used + len(e.ids) <= width), None)
        if row is None:
            rows.append([])
            fill.append(0)
            row = len(rows) - 1
        rows[row].append(e)
        fill[row] += len(e.ids)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, examples in enumerate(rows):
        at = 0
        for e in examples:
            n = len(e.ids)
            seq = torch.tensor(e.ids)
            ids[r, at : at + n] = seq
            positions[r, at : at + n] = torch.arange(n)
            targets[r, at : at + n - 1] = seq[1:]
            loss_mask[r, at + e.prompt_len - 1 : at + n - 1] = True  # predicting the answer and <|end|>
            at += n
        positions[r, at:] = torch.arange(n, n + width - at)
    return Batch(ids, positions, targets, loss_mask)


def batch_loss(lm: nn.Module, b: Batch) -> torch.Tensor:
    """Mean cross-entropy over the batch's answer tokens. Only answer positions go through the LM head:
    cheaper, and the prompt is not what we teach."""
    # use_cache=False: with a cache transformers would not read the restarting positions as packing.
    hidden = lm.model(input_ids=b.ids, position_ids=b.positions, use_cache=False).last_hidden_state
    return nn.functional.cross_entropy(lm.lm_head(hidden[b.loss_mask]), b.targets[b.loss_mask])


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    lm: nn.Module,
    params: list[nn.Parameter],
    data: Sequence[Encoded],
    cfg: TrainConfig,
    *,
    pad_id: int,
    desc: str,
    progress: bool,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train `params` of a `*ForCausalLM` (LoRA layers, if any, already injected) on `data` in order.
    `on_step(step, recent loss)` reports progress instead of a bar (used by worker processes, whose
    parent draws the bars).
    """
    assert len(data) >= cfg.steps * cfg.batch_size, "training data shorter than steps * batch_size"
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    lm.train()
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc=desc, unit="step", disable=not progress or on_step is not None, leave=True,
               dynamic_ncols=True)
    try:
        for step in range(cfg.steps):
            loss = batch_loss(lm, collate(data[step * cfg.batch_size : (step + 1) * cfg.batch_size], pad_id))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % 10 == 0 or step == cfg.steps - 1:
                recent = sum(losses[-10:]) / len(losses[-10:])
                bar.set_postfix(loss=f"{recent:.3f}")
                if on_step is not None:
                    on_step(step + 1, recent)
            bar.update(1)
    finally:
        bar.close()
    lm.eval()
    tail = losses[-max(1, cfg.steps // 10) :]
    return TrainResult(steps=cfg.steps, final_loss=sum(tail) / len(tail), seconds=time.perf_counter() - start)
