"""The batch class yields a step to interactive first tokens.

A step that computes part of an interactive prompt is on the way to that request's first token, so it is
kept lean: lower classes' prefill chunks and admissions wait for the next step (their decodes, one token
each, still run). Any other step takes at most `lower_class_prefill_tokens` of lower-class prompt work
(chunks included), so the step an interactive request arrives during, and must wait out, is never a whole
budget of batch prompts. On a step-time-bound engine, batch prompts filling the rest of the token budget made
every interactive first-token step longer by their prefill (the Batch API bench, issue 24). Outputs are
unchanged -- a batch prompt is computed a step later, token for token the same (tests/engine/test_oracle.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.sequence import Priority

if TYPE_CHECKING:
    from services.engine.config import SchedulerConfig
    from services.engine.scheduler import StepPlan


def computes_interactive_prompt(plan: StepPlan) -> bool:
    """True when the plan so far has an interactive sequence's prompt tokens (a first token is coming)."""
    return any(s.seq.priority is Priority.INTERACTIVE and s.start < s.seq.num_prompt_tokens for s in plan.scheduled)


def class_budget_cap(plan: StepPlan, priority: Priority, config: SchedulerConfig) -> int | None:
    """The plan's token count `priority`'s prompt work may fill the step to (None: the whole budget).
    Decodes are scheduled before any class's prompt work, so the cap counts that class's prompt tokens only.
    Without chunked prefill a capped prompt could never be admitted: no cap then."""
    if priority is Priority.INTERACTIVE or config.lower_class_prefill_tokens is None or not config.chunked_prefill:
        return None
    return plan.num_batched_tokens + config.lower_class_prefill_tokens
