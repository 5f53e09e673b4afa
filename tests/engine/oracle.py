"""The correctness oracle: Hugging Face greedy generation (fp32), and the tie rule for comparing to it.

A divergence is accepted only where the reference's top-2 logit gap at that step is below TIE_GAP:
there, float summation order alone may flip the argmax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

TIE_GAP = 1e-4
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@dataclass
class Reference:
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at every generated step


@dataclass
class Verdict:
    identical: bool
    step: int | None = None  # first divergent step
    gap: float | None = None

    @property
    def acceptable(self) -> bool:
        return self.identical or (self.gap is not None and self.gap < TIE_GAP)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, adapter: str | None = None, eos=None) -> Reference:
    ids = torch.tensor([prompt])
    kwargs = {"adapter_names": [adapter or "__base__"]} if adapter is not None or hasattr(model, "peft_config") else {}
    if eos is not None:
        kwargs["eos_token_id"] = eos
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return Reference(tokens, gaps)


def compare(got: list[int], ref: Reference) -> Verdict:
    for k, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            return Verdict(False, k, ref.gaps[k])
    if len(got) == len(ref.tokens):
        return Verdict(True)
    k = min(len(got), len(ref.tokens))  # one stopped (EOS) where the other went on
    return Verdict(False, k, ref.gaps[k] if k < len(ref.gaps) else None)


@dataclass
class TieLog:
    name: str
    ties: list[dict] = field(default_factory=list)

    def check(self, label: str, got: list[int], ref: Reference) -> Verdict:
        v = compare(got, ref)
        assert v.acceptable, f"{self.name}/{label}: diverged at step {v.step} (reference gap {v.gap}); got {got} want {ref.tokens}"
        if not v.identical:
            self.ties.append({"request": label, "step": v.step, "gap": v.gap})
        return v

    def write(self) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"oracle_ties_{self.name}.json"
        path.write_text(json.dumps(self.ties, indent=2))
        print(f"\n[oracle] {self.name}: {len(self.ties)} accepted near-tie divergences (gap < {TIE_GAP}) -> {path}")


def oracle_questions_and_prompts(kit) -> tuple[list[str], list[list[int]]]:
    """The oracle's prompts: questions from every eval set of the demo kit, every third behind a document
    (longer prompts of mixed lengths). Returns the questions too, for suites that build more prompts."""
    import random

    from services.common.prompting import PromptBuilder

    builder = PromptBuilder(kit.base_dir)
    rng = random.Random(7)
    questions = []
    for path in [kit.base_eval, *(a.eval_path for a in kit.adapters.values())]:
        lines = [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()]
        questions += rng.sample(lines, min(6, len(lines)))
    out = []
    for i, q in enumerate(questions[:24]):
        if i % 3 == 0:  # longer prompts: a document before the question
            doc = " ".join(rng.sample(questions, 6))
            out.append(builder.chat_ids([{"role": "system", "content": doc}, {"role": "user", "content": q}]))
        else:
            out.append(builder.chat_ids([{"role": "user", "content": q}]))
    return questions, out
