"""The quality gate's verdict from its measurements: one function per check, each returning a `Check` (passed
or not, the measured value and its threshold), and `decide`, which runs them all and reports every one.

Which quality check applies depends on the eval set (docs/adapters.md, "Quality gate"):
  margin         a task eval set (the tenant's, or the demo kit's for one of its own adapters): the adapter
                 must beat the base on it by `min_margin`;
  no_regression  no task eval set: on the platform's base-capability set the adapter must not do worse than
                 the base beyond `max_regression` (a one-sided upper confidence bound on the mean paired drop).
Always: well-formedness (outputs not newly empty, undecodable or looping), finite and informative logits,
and FP8 parity (served vs full precision) where the served base is FP8.

`decide` reads only the metrics the gate stores, so a stored verdict can be recomputed from its run.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from services.adapters.config import GATE_METRICS, GateDefaults

MARGIN, NO_REGRESSION = "margin", "no_regression"
QUALITY_CHECKS = (MARGIN, NO_REGRESSION)
_THRESHOLD_KEYS = ("metric", "min_margin", "min_fp8_agreement", "max_regression", "regression_confidence",
                   "max_malformed_rate")


@dataclass(frozen=True, slots=True)
class Thresholds:
    metric: str
    min_margin: float
    min_fp8_agreement: float
    max_regression: float
    regression_confidence: float
    max_malformed_rate: float

    def __post_init__(self) -> None:
        if self.metric not in GATE_METRICS:
            raise ValueError(f"metric must be one of {GATE_METRICS}")

    @classmethod
    def from_config(cls, gate_config: dict[str, Any] | None, defaults: GateDefaults) -> Thresholds:
        """A version's stored gate config over the platform defaults (versions stored before a threshold
        existed get the default)."""
        merged = defaults.thresholds(**{k: v for k, v in (gate_config or {}).items() if k in _THRESHOLD_KEYS})
        return cls(merged["metric"], *(float(merged[k]) for k in _THRESHOLD_KEYS[1:]))

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _THRESHOLD_KEYS}


@dataclass(frozen=True, slots=True)
class Check:
    name: str  # margin | no_regression | well_formed | logits | fp8_agreement
    code: str  # `<name>_ok` when passed, else the refusal code
    passed: bool
    message: str
    value: float | None = None  # what was measured
    threshold: float | None = None

    def as_reason(self) -> dict[str, Any]:
        return {"check": self.name, "code": self.code, "passed": self.passed, "message": self.message,
                "value": None if self.value is None else round(self.value, 4), "threshold": self.threshold}


@dataclass(frozen=True, slots=True)
class Regression:
    """Paired per-item drop (base score - adapter score) over a base-capability set."""

    n: int
    mean_drop: float
    upper_bound: float  # one-sided upper confidence bound of the mean drop
    confidence: float
    worse: int  # items the adapter scores lower on
    better: int
    tied: int  # same score (almost always: the same greedy output)

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean_drop": round(self.mean_drop, 4), "upper_bound": round(self.upper_bound, 4),
                "confidence": self.confidence, "worse": self.worse, "better": self.better, "tied": self.tied}


def regression(adapter_scores: Sequence[float], base_scores: Sequence[float], *, confidence: float) -> Regression:
    """Mean paired drop and its one-sided upper bound (normal approximation, mean + z * sd / sqrt(n)).

    Greedy outputs are deterministic, so the only variance is which items the set happens to hold. Ties (the
    same output, drop 0) are most items for a harmless adapter and count as what they are, evidence of no
    change: they shrink the spread, unlike a rank test that drops them. Near-ties in the base's logits flip
    a few greedy tokens either way under a tiny adapter (as FP8 rounding does); the tolerance absorbs them."""
    drops = [b - a for a, b in zip(adapter_scores, base_scores, strict=True)]
    n = len(drops)
    if n == 0:
        raise ValueError("no items to compare")
    mean = math.fsum(drops) / n
    var = math.fsum((d - mean) ** 2 for d in drops) / (n - 1) if n > 1 else 0.0
    z = NormalDist().inv_cdf(confidence)
    eps = 1e-9
    return Regression(n=n, mean_drop=mean, upper_bound=mean + z * math.sqrt(var / n), confidence=confidence,
                      worse=sum(d > eps for d in drops), better=sum(d < -eps for d in drops),
                      tied=sum(abs(d) <= eps for d in drops))


def margin_check(metrics: dict[str, Any], t: Thresholds) -> Check:
    a, b = metrics["adapter"][t.metric], metrics["base"][t.metric]
    delta = a - b
    if delta >= t.min_margin:
        return Check(MARGIN, "margin_ok", True, f"{t.metric}: adapter {a:.3f} vs base {b:.3f} ({delta:+.3f}; at least "
                                               f"{t.min_margin:+.3f} required)", delta, t.min_margin)
    return Check(MARGIN, "margin_below_threshold", False,
                 f"{t.metric}: adapter {a:.3f} vs base {b:.3f}; it must beat the base by at least {t.min_margin:.3f} "
                 f"(got {delta:+.3f})", delta, t.min_margin)


def no_regression_check(metrics: dict[str, Any], t: Thresholds) -> Check:
    r = metrics["regression"]
    a, b = metrics["adapter"][t.metric], metrics["base"][t.metric]
    pct = round(100 * r["confidence"])
    counts = f"{r['worse']} worse, {r['better']} better, {r['tied']} unchanged"
    if r["upper_bound"] <= t.max_regression:
        return Check(NO_REGRESSION, "no_regression_ok", True,
                     f"{t.metric} on {r['n']} base-capability items: adapter {a:.3f} vs base {b:.3f}; mean drop "
                     f"{r['mean_drop']:+.3f}, {pct}% upper bound {r['upper_bound']:+.3f} within the tolerance of "
                     f"{t.max_regression:.3f} ({counts})", r["upper_bound"], t.max_regression)
    return Check(NO_REGRESSION, "regression_over_tolerance", False,
                 f"the adapter damages what the base model does well: {t.metric} on {r['n']} base-capability items "
                 f"adapter {a:.3f} vs base {b:.3f}; mean drop {r['mean_drop']:+.3f} ({pct}% upper bound "
                 f"{r['upper_bound']:+.3f}) is over the tolerance of {t.max_regression:.3f} ({counts}). An adapter "
                 f"meant for one task: upload it with an eval set of that task (the margin check then applies)",
                 r["upper_bound"], t.max_regression)


def well_formed_check(metrics: dict[str, Any], t: Thresholds) -> Check:
    m = metrics["malformed"]
    n = metrics["n_examples"]
    kinds = ", ".join(f"{m[k]} {k}" for k in ("empty", "undecodable", "repetition") if m[k]) or "none"
    if m["rate"] <= t.max_malformed_rate:
        return Check("well_formed", "well_formed_ok", True,
                     f"{m['count']} of {n} outputs empty, undecodable or looping where the base's are not ({kinds}; "
                     f"at most {t.max_malformed_rate:.1%} allowed)", m["rate"], t.max_malformed_rate)
    return Check("well_formed", "malformed_outputs", False,
                 f"{m['count']} of {n} outputs ({m['rate']:.1%}) are empty, undecodable or stuck repeating where the "
                 f"base's are not ({kinds}); at most {t.max_malformed_rate:.1%} is allowed", m["rate"],
                 t.max_malformed_rate)


def logits_check(metrics: dict[str, Any], t: Thresholds) -> Check:
    d = metrics["degenerate_logits"]
    if d["tokens"] == 0:
        return Check("logits", "logits_ok", True, f"finite, informative logits on all {d['checked']} generated tokens",
                     0.0, 0.0)
    return Check("logits", "degenerate_logits", False,
                 f"NaN/Inf or flat (uniform) logits on {d['tokens']} of {d['checked']} generated tokens, in "
                 f"{d['outputs']} outputs: the adapter breaks the model's numerics", float(d["tokens"]), 0.0)


def fp8_check(metrics: dict[str, Any], t: Thresholds) -> Check:
    dtype = metrics["served_weight_dtype"]
    agree = metrics["fp8_token_agreement"]
    if dtype != "fp8":
        return Check("fp8_agreement", "fp8_agreement_ok", True,
                     f"not applicable: engines serve the base in full precision ({dtype})", agree, t.min_fp8_agreement)
    ok = agree >= t.min_fp8_agreement
    return Check("fp8_agreement", "fp8_agreement_ok" if ok else "fp8_agreement_below_threshold", ok,
                 f"served ({dtype}) vs full precision: {agree:.3f} of greedy tokens agree"
                 + (f" (at least {t.min_fp8_agreement:.3f} required)" if ok else
                    f"; at least {t.min_fp8_agreement:.3f} is required"), agree, t.min_fp8_agreement)


def decide(metrics: dict[str, Any], t: Thresholds) -> tuple[bool, list[dict[str, Any]]]:
    """Every check, passed or not, in a fixed order (the quality check first); any failure rejects."""
    quality = no_regression_check if metrics["check"] == NO_REGRESSION else margin_check
    checks = [quality(metrics, t), well_formed_check(metrics, t), logits_check(metrics, t), fp8_check(metrics, t)]
    return all(c.passed for c in checks), [c.as_reason() for c in checks]
