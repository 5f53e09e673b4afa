"""The batch class yields a step to interactive first tokens.

A step that computes part of an interactive prompt is on the way to that request's first token, so it is
kept lean: lower classes' prefill chunks and admissions wait for the next step, and so do their decodes (a
batch decode row is small, but on a step-time-bound engine eight of them made an interactive prompt's step
~25% longer: 4.6 -> 5.8 ms on the development VM, bench/batch_bench.py's step table). Any other step takes
at most `lower_class_prefill_tokens` of lower-class prompt work (chunks included), and, with
`lower_class_prompt_s`, no more than the fitted step cost (step_time.py) says that many seconds of compute
buy: the step an interactive request arrives during, and must wait out, is never a whole budget of batch
prompts (beside 8 decode rows, a step with a 128-token batch prompt took 10.1 ms here, with a 35-token one
5.6 ms). On a GPU, where prompt tokens cost little, the time cap allows more than the token cap and the
token cap rules. The batch work goes on in the next step, token for token the same
(tests/engine/test_oracle.py); a step with no interactive prompt holds nothing back, so the batch only waits
while interactive first tokens are being computed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.sequence import Priority

if TYPE_CHECKING:
    from services.engine.config import SchedulerConfig
    from services.engine.scheduler import StepPlan
    from services.engine.step_time import StepCostModel

# Lower-class prompt work a step may always take, whatever the fitted cost says (prompts keep moving).
MIN_LOWER_CLASS_PROMPT_TOKENS = 16


def computes_interactive_prompt(plan: StepPlan) -> bool:
    """True when the plan so far has an interactive sequence's prompt tokens (a first token is coming)."""
    return any(s.seq.priority is Priority.INTERACTIVE and s.start < s.seq.num_prompt_tokens for s in plan.scheduled)


def lower_class_rows(plan: StepPlan) -> list:
    """The rows a lean step gives back: every lower-class row of a plan that computes an interactive prompt
    (their decodes; their prompt work was never added to it)."""
    if not computes_interactive_prompt(plan):
        return []
    return [s for s in plan.scheduled if s.seq.priority is not Priority.INTERACTIVE]


def lower_class_prompt_tokens(config: SchedulerConfig, cost: StepCostModel | None) -> int | None:
    """Lower-class prompt tokens one step may take (None: no cap)."""
    cap = config.lower_class_prefill_tokens
    if config.lower_class_prompt_s is not None and cost is not None:
        _, per_token = cost.estimate()
        timed = max(MIN_LOWER_CLASS_PROMPT_TOKENS, int(config.lower_class_prompt_s / per_token))
        cap = timed if cap is None else min(cap, timed)
    return cap


def class_budget_cap(plan: StepPlan, priority: Priority, config: SchedulerConfig,
                     cost: StepCostModel | None = None) -> int | None:
    """The plan's token count `priority`'s prompt work may fill the step to (None: the whole budget).
    Decodes are scheduled before any class's prompt work, so the cap counts that class's prompt tokens only.
    Without chunked prefill a capped prompt could never be admitted: no cap then."""
    if priority is Priority.INTERACTIVE or not config.chunked_prefill:
        return None
    cap = lower_class_prompt_tokens(config, cost)
    return None if cap is None else plan.num_batched_tokens + cap
