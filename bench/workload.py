"""Workload generators: realistic mixed prompts/outputs on the demo model, Poisson arrivals."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from services.common.prompting import PromptBuilder


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start (Poisson runs)


def _eval_prompts(kit) -> list[str]:
    prompts = []
    for path in [kit.base_eval, *(a.eval_path for a in kit.adapters.values())]:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
    return prompts


def mixed_workload(kit, n: int, seed: int = 0, max_len: int = 512) -> list[BenchRequest]:
    """Chat prompts from the demo tasks, some with long shared or unique context, and output lengths
    from short answers to long generations (long-tailed, like production traffic)."""
    rng = random.Random(seed)
    builder = PromptBuilder(kit.base_dir)
    questions = _eval_prompts(kit)
    filler_words = " ".join(q for q in questions[:200]).split()
    out: list[BenchRequest] = []
    for _ in range(n):
        q = rng.choice(questions)
        kind = rng.random()
        if kind < 0.5:
            messages = [{"role": "user", "content": q}]
        else:  # a longer context: a document excerpt before the question
            words = rng.randint(20, 220 if kind < 0.9 else 300)
            start = rng.randrange(0, max(1, len(filler_words) - words))
            doc = " ".join(filler_words[start : start + words])
            messages = [{"role": "system", "content": doc}, {"role": "user", "content": q}]
        ids = builder.chat_ids(messages)[: max_len - 64]
        r = rng.random()
        if r < 0.45:
            out_len = rng.randint(8, 32)
        elif r < 0.85:
            out_len = rng.randint(32, 128)
        else:
            out_len = rng.randint(128, 256)
        out_len = max(1, min(out_len, max_len - len(ids) - 1))
        out.append(BenchRequest(ids, out_len))
    return out


def with_poisson_arrivals(reqs: list[BenchRequest], rate: float, seed: int = 1) -> list[BenchRequest]:
    rng = random.Random(seed)
    t = 0.0
    timed = []
    for r in reqs:
        t += rng.expovariate(rate)
        timed.append(BenchRequest(r.prompt_ids, r.max_tokens, t))
    return timed
