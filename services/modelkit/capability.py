"""The base-capability set: what the demo base model does well, for the quality gate's no-regression check.

Larger than the kit's `evals/base.jsonl` (40 items) so that a tolerance of a few hundredths is more than a
handful of items: the knowledge tasks (facts, capitals, sums) asked again — knowledge is what the base was
trained on — and fresh lists for the list tasks (repeat, count), none of which the base saw in training or
in its own eval set. Generated from the corpus, deterministic; the platform ships the result as
`services/adapters/data/default_eval.jsonl` (regenerate: `python -m services.modelkit.capability`).

Not one of the kit's build sources (`kit._SOURCES`): changing this file does not rebuild the kit.
"""
from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from services.modelkit import corpus
from services.modelkit.config import DEMO_CONFIG, KitConfig

# task -> items; 200 in all (docs/adapters.md explains the size).
CAPABILITY_SIZES: dict[str, int] = {"fact": 20, "capital": 60, "add": 40, "repeat": 40, "count": 40}


def base_capability_set(cfg: KitConfig = DEMO_CONFIG, sizes: dict[str, int] | None = None) -> list[corpus.Example]:
    sizes = dict(CAPABILITY_SIZES if sizes is None else sizes)
    rng = random.Random(f"capability:{cfg.seed}")
    out: list[corpus.Example] = []
    for task, n in sizes.items():
        pool = list(_knowledge(task)) if task in ("fact", "capital", "add") else None
        if pool is not None:
            if n > len(pool):
                raise ValueError(f"{task}: only {len(pool)} distinct items")
            out.extend(rng.sample(pool, n))
    seen_lists = _seen_list_prompts(cfg)
    for task, n in sizes.items():
        if task in ("fact", "capital", "add"):
            continue
        make = corpus.BASE_TASKS[task][0]
        picked: dict[str, corpus.Example] = {}
        while len(picked) < n:
            ex = make(rng)
            if ex.prompt not in seen_lists and ex.prompt not in picked:
                picked[ex.prompt] = ex
        out.extend(picked.values())
    return out


def _knowledge(task: str) -> Iterator[corpus.Example]:
    if task == "fact":
        yield from (corpus.Example("fact", q, a) for q, a in corpus.FACTS)
    elif task == "capital":
        for country, city in corpus.CAPITALS:
            for q in corpus._CAPITAL_QUESTIONS:
                yield corpus.Example("capital", q.format(country), f"The capital of {country} is {city}.")
    else:
        for a in range(10):
            for b in range(10):
                yield corpus.Example("add", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")


def _seen_list_prompts(cfg: KitConfig) -> set[str]:
    """Prompts of the base model's training data and of its eval sets (what `build.build_demo` draws)."""
    held = corpus.base_held_out(cfg.seed, cfg.eval_size)
    n_train = cfg.base_train.steps * cfg.base_train.batch_size
    return held | {e.prompt for e in corpus.base_training(cfg.seed, n_train, exclude=held)}


def as_jsonl(examples: list[corpus.Example]) -> str:
    return "".join(json.dumps({"prompt": e.prompt, "expected": e.answer}, ensure_ascii=False) + "\n" for e in examples)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    text = as_jsonl(base_capability_set())
    if target is None:
        sys.stdout.write(text)
    else:
        target.write_text(text, encoding="utf-8")
