"""What a step costs, and steps kept short enough for first tokens.

`StepCostModel` fits a step's wall time as `fixed + per_token * tokens` online (the speculation controller
sizes drafts with it). `StepTimeBound` uses the same fit to keep every step under a wall-time target
(`SchedulerConfig.max_step_s`): a step's prompt work -- prefill chunks and admissions, after its decodes -- is
capped at the tokens the target leaves once the fixed cost and the decode rows are paid. A request that arrives
mid-step waits out the step in flight and then computes its prompt in the next one, so its time to first token
is about two steps; on a 2-core machine shared by a gateway, engine front-ends and the load, a 2,048-token
prefill step stretched from ~0.19 s alone to ~1.2 s, and tenant B's first token in the noisy-neighbour bench
waited behind it (bench/fairness_bench.py). Sarathi-Serve derives its token budget from a latency target the
same way, offline; here the fit follows the machine as it slows down, so the cap only bites when steps are
actually slow (on an idle machine the target allows more than the token budget). Decodes are never cut and at
least `MIN_PROMPT_TOKENS` of prompt work still runs each step, so prefill always progresses. Outputs are
unchanged: a prompt computed in more, smaller chunks gives the same tokens (tests/engine/test_oracle.py).
"""
from __future__ import annotations

MIN_PROMPT_TOKENS = 64


class StepCostModel:
    """Step wall time ~ fixed + per_token * tokens: exponentially weighted least squares over the steps seen,
    starting from a prior (two pseudo-steps on the line measured on the development VM: ~2.2 ms + ~0.065 ms
    per token) that a few dozen real steps outweigh."""

    def __init__(self, fixed: float = 2.2e-3, per_token: float = 6.5e-5, decay: float = 0.99, prior_weight: float = 2.0):
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        for tokens in (1.0, 64.0):
            self._add(tokens, fixed + per_token * tokens, prior_weight)

    def _add(self, tokens: float, seconds: float, weight: float) -> None:
        self.w += weight
        self.x += weight * tokens
        self.y += weight * seconds
        self.xx += weight * tokens * tokens
        self.xy += weight * tokens * seconds

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.w, self.x, self.y, self.xx, self.xy = d * self.w, d * self.x, d * self.y, d * self.xx, d * self.xy
        self._add(float(tokens), seconds, 1.0)

    def estimate(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token), both kept positive."""
        var = self.xx - self.x * self.x / self.w
        slope = (self.xy - self.x * self.y / self.w) / var if var > 1e-9 else 0.0
        slope = max(slope, 1e-7)
        fixed = max((self.y - slope * self.x) / self.w, 1e-6)
        return fixed, slope


class StepTimeBound:
    """The prompt tokens a step may take so that it stays within `target_s`, from the fitted step cost."""

    def __init__(self, target_s: float, cost: StepCostModel | None = None):
        self.target_s = target_s
        self.cost = cost or StepCostModel()

    def prompt_tokens(self, decode_tokens: int) -> int:
        """Prompt tokens that fit beside `decode_tokens` of decodes (at least MIN_PROMPT_TOKENS)."""
        fixed, per_token = self.cost.estimate()
        fit = int((self.target_s - fixed) / per_token) - decode_tokens
        return max(MIN_PROMPT_TOKENS, fit)
