"""The batch class yields a step to interactive first tokens.

A step that computes part of an interactive prompt is on the way to that request's first token, so it is
kept lean: lower classes' prefill chunks and admissions wait for the next step (their decodes, one token
each, still run). On a step-time-bound engine, batch prompts filling the rest of the token budget made
every interactive first-token step longer by their prefill (the Batch API bench, issue 24). Outputs are
unchanged -- a batch prompt is computed a step later, token for token the same (tests/engine/test_oracle.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.sequence import Priority

if TYPE_CHECKING:
    from services.engine.scheduler import StepPlan


def computes_interactive_prompt(plan: StepPlan) -> bool:
    """True when the plan so far has an interactive sequence's prompt tokens (a first token is coming)."""
    return any(s.seq.priority is Priority.INTERACTIVE and s.start < s.seq.num_prompt_tokens for s in plan.scheduled)
