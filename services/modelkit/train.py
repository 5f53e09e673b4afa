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
from services.modelkit.tokenizer import render_prompt


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
    prompts = tok.encode_batch([render_prompt(e.prompt) for e in examples], add_special_tokens=False)
    answers = tok.encode_batch([e.answer for e in examples], add_special_tokens=False)
    return [Encoded(p.ids + a.ids + [end_id], len(p.ids)) for p, a in zip(prompts, answers)]


def collate(batch: Sequence[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, next-token targets and the mask of positions whose target is an answer token.

    Right padding needs no attention mask under causal attention: real positions never see pads.
    """
    width = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    lengths = torch.tensor([len(e.ids) for e in batch])
    starts = torch.tensor([e.prompt_len - 1 for e in batch])
    for row, e in enumerate(batch):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
    targets = torch.roll(ids, -1, dims=1)
    pos = torch.arange(width)
    mask = (pos[None, :] >= starts[:, None]) & (pos[None, :] < lengths[:, None] - 1)
    return ids, targets, mask


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

    Only answer positions go through the LM head: cheaper, and the prompt is not what we teach.
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
            ids, targets, mask = collate(data[step * cfg.batch_size : (step + 1) * cfg.batch_size], pad_id)
            hidden = lm.model(input_ids=ids, use_cache=False).last_hidden_state
            logits = lm.lm_head(hidden[mask])
            loss = nn.functional.cross_entropy(logits, targets[mask])
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
