"""The quality gate: an adapter is served only if, on its eval set, it beats the base model by a margin
and stays faithful when served on the FP8 base.

Three greedy runs over the same items, with the engine library (CPU or GPU):
  adapter   the adapter on the base as engines serve it (FP8 weights when `serve_weight_dtype="fp8"`)
  base      the same served base without the adapter (same batch: base rows ride along)
  full      the adapter on the full-precision base
Scores: exact match, token F1 and ROUGE-L of each run against `expected`; greedy token agreement of
`adapter` with `full`; a latency sample (single requests with and without the adapter). The decision:
score(adapter) - score(base) >= min_margin in the configured metric AND agreement >= min_fp8_agreement.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.adapters.config import GATE_METRICS, GateDefaults
from services.adapters.evalset import EvalItem
from services.adapters.scoring import SCORERS, mean, token_agreement
from services.common.lora_format import AdapterFormatError

log = logging.getLogger("mplex.adapters.gate")

Progress = Callable[[float, str], None]  # (fraction 0..1 of the gate's work, step)


@dataclass(frozen=True, slots=True)
class Thresholds:
    metric: str
    min_margin: float
    min_fp8_agreement: float

    def __post_init__(self) -> None:
        if self.metric not in GATE_METRICS:
            raise ValueError(f"metric must be one of {GATE_METRICS}")

    @classmethod
    def from_config(cls, gate_config: dict[str, Any] | None, defaults: GateDefaults) -> Thresholds:
        merged = defaults.thresholds(**{k: v for k, v in (gate_config or {}).items()
                                        if k in ("metric", "min_margin", "min_fp8_agreement")})
        return cls(merged["metric"], float(merged["min_margin"]), float(merged["min_fp8_agreement"]))

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "min_margin": self.min_margin, "min_fp8_agreement": self.min_fp8_agreement}


@dataclass(frozen=True, slots=True)
class GateResult:
    passed: bool
    metrics: dict[str, Any]
    thresholds: dict[str, Any]
    reasons: list[dict[str, Any]]  # every check, passed or not: {code, message, passed}
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> list[dict[str, str]]:
        return [{"code": r["code"], "message": r["message"]} for r in self.reasons if not r["passed"]]


class GateError(RuntimeError):
    """The gate could not run (not a verdict on the adapter): the run is recorded as failed and retried."""


@dataclass(slots=True)
class _Run:
    texts: list[str]
    token_ids: list[list[int]]


def decide(metrics: dict[str, Any], t: Thresholds) -> tuple[bool, list[dict[str, Any]]]:
    """The verdict from the metrics: both checks are always reported, failing ones make the decision."""
    a, b = metrics["adapter"][t.metric], metrics["base"][t.metric]
    delta = a - b
    agree = metrics["fp8_token_agreement"]
    margin_ok = delta >= t.min_margin
    fp8_ok = agree >= t.min_fp8_agreement
    reasons = [
        {"code": "margin_ok" if margin_ok else "margin_below_threshold", "passed": margin_ok,
         "message": (f"{t.metric}: adapter {a:.3f} vs base {b:.3f} (+{delta:.3f})" if margin_ok else
                     f"{t.metric}: adapter {a:.3f} vs base {b:.3f}; it must beat the base by at least "
                     f"{t.min_margin:.3f} (got {delta:+.3f})")},
        {"code": "fp8_agreement_ok" if fp8_ok else "fp8_agreement_below_threshold", "passed": fp8_ok,
         "message": (f"served ({metrics['served_weight_dtype']}) vs full precision: {agree:.3f} of greedy tokens agree"
                     + ("" if fp8_ok else f"; at least {t.min_fp8_agreement:.3f} is required"))},
    ]
    return margin_ok and fp8_ok, reasons


class GateRunner:
    """Engines for the gate, built once per worker process and reused across versions (each run loads the
    candidate adapter, then unloads it)."""

    def __init__(self, model_dir: Path, *, serve_weight_dtype: str = "fp8", compute_dtype: str = "float32",
                 max_lora_rank: int = 64, kv_memory_bytes: int = 64 << 20):
        self.model_dir = Path(model_dir)
        self.serve_weight_dtype = serve_weight_dtype
        self.compute_dtype = compute_dtype
        self.max_lora_rank = max_lora_rank
        self.kv_memory_bytes = kv_memory_bytes
        self._engines: dict[str, Any] = {}
        self._builder = None

    def _engine(self, weight_dtype: str):
        engine = self._engines.get(weight_dtype)
        if engine is None:
            from services.engine.config import CacheConfig, EngineConfig, LoraConfig
            from services.engine.engine import LLMEngine

            engine = LLMEngine(EngineConfig(
                model_dir=self.model_dir, served_model_name=f"gate-{weight_dtype}", dtype=self.compute_dtype,
                weight_dtype=weight_dtype, engine_id=f"gate-{weight_dtype}",
                # No prefix cache: the latency sample must not be flattered by earlier runs' blocks.
                cache=CacheConfig(memory_bytes=self.kv_memory_bytes, enable_prefix_caching=False),
                lora=LoraConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=self.max_lora_rank),
            ))
            self._engines[weight_dtype] = engine
        return engine

    @property
    def builder(self):
        if self._builder is None:
            from services.common.prompting import PromptBuilder

            self._builder = PromptBuilder(self.model_dir)
        return self._builder

    def prompt_ids(self, item: EvalItem) -> list[int]:
        if self.builder.has_chat_template:
            return self.builder.chat_ids(item.chat())
        return self.builder.text_ids("\n".join(c for _, c in item.messages))

    def run(self, adapter_uri: str | Path, content_id: str, items: list[EvalItem], thresholds: Thresholds, *,
            max_new_tokens: int, latency_samples: int = 3, progress: Progress | None = None) -> GateResult:
        """Score the adapter at `adapter_uri` (a directory, or an object-store URI the engine fetches as it
        would when serving) on `items`; the engine checks the files hash to `content_id`."""
        from services.engine.sequence import AdapterRef

        progress = progress or (lambda f, s: None)
        ref = AdapterRef(content_id, f"candidate-{content_id[:12]}", str(adapter_uri))
        served = self._engine(self.serve_weight_dtype)
        full = self._engine("auto") if self.serve_weight_dtype != "auto" else served
        prompts = [self.prompt_ids(item) for item in items]
        limit = min(served.max_model_len, full.max_model_len)
        usable = [i for i, p in enumerate(prompts) if len(p) < limit - 1]
        if not usable:
            raise AdapterFormatError("eval_set_too_long", f"no eval item fits the model's context of {limit} tokens")
        skipped = len(items) - len(usable)
        items = [items[i] for i in usable]
        prompts = [prompts[i] for i in usable]
        budgets = [min(max_new_tokens, limit - len(p)) for p in prompts]
        try:
            progress(0.0, "evaluating: adapter and base (served precision)")
            runs = self._generate(served, prompts, budgets, [ref, None], lambda f: progress(0.5 * f, "evaluating: adapter and base (served precision)"))
            adapter, base = runs[0], runs[1]
            progress(0.5, "evaluating: adapter (full precision)")
            full_run = self._generate(full, prompts, budgets, [ref], lambda f: progress(0.5 + 0.4 * f, "evaluating: adapter (full precision)"))[0] \
                if full is not served else adapter
            progress(0.9, "evaluating: latency sample")
            latency = self._latency(served, prompts[:latency_samples], budgets[:latency_samples], ref)
        finally:
            for engine in {id(served): served, id(full): full}.values():
                self._drop_adapter(engine, content_id)
        metrics = self._metrics(items, adapter, base, full_run, latency)
        metrics["n_examples"] = len(items)
        metrics["n_skipped"] = skipped  # longer than the model's context
        passed, reasons = decide(metrics, thresholds)
        examples = [self._example(item, adapter.texts[i], base.texts[i], full_run.texts[i], thresholds.metric)
                    for i, item in enumerate(items)]
        progress(1.0, "decided")
        return GateResult(passed, metrics, thresholds.as_dict(), reasons, examples)

    def _generate(self, engine, prompts: list[list[int]], budgets: list[int], refs: list, on_progress) -> list[_Run]:
        """Greedy outputs of every prompt under each of `refs` (None = the base), in one continuous batch."""
        from services.engine.sequence import SamplingParams

        tag = f"gate-{time.monotonic_ns()}"
        texts: dict[str, list[str]] = {}
        ids: dict[str, list[int]] = {}
        order = []
        for k, ref in enumerate(refs):
            for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
                rid = f"{tag}-{k}-{i}"
                engine.add_request(rid, prompt, SamplingParams(max_tokens=budget, temperature=0.0), adapter=ref)
                texts[rid], ids[rid] = [], []
                order.append(rid)
        total, done = len(order), 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.error is not None:
                    for rid in order:
                        engine.abort_request(rid)
                    raise AdapterFormatError(out.error.code or "load_failed", out.error.message)
                texts[out.request_id].append(out.new_text)
                ids[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done += 1
                    on_progress(done / total)
            if engine.last_plan_empty and engine.has_unfinished():
                engine.wake.wait(0.05)  # an adapter load in flight
                engine.wake.clear()
        n = len(prompts)
        return [_Run(["".join(texts[rid]) for rid in order[k * n:(k + 1) * n]], [ids[rid] for rid in order[k * n:(k + 1) * n]])
                for k in range(len(refs))]

    def _latency(self, engine, prompts: list[list[int]], budgets: list[int], ref) -> dict[str, float]:
        """Single requests, one at a time, with and without the adapter (the adapter is host-resident by now)."""
        if not prompts:
            return {}
        out: dict[str, float] = {}
        for label, adapter in (("adapter", ref), ("base", None)):
            per_token, requests = [], []
            for prompt, budget in zip(prompts, budgets):
                t0 = time.perf_counter()
                run = self._generate(engine, [prompt], [budget], [adapter], lambda f: None)[0]
                elapsed = time.perf_counter() - t0
                per_token.append(elapsed / max(len(run.token_ids[0]), 1))
                requests.append(elapsed)
            out[f"{label}_ms_per_token"] = round(1000 * mean(per_token), 3)
            out[f"{label}_request_ms"] = round(1000 * mean(requests), 3)
        out["adapter_overhead"] = round(out["adapter_ms_per_token"] / out["base_ms_per_token"], 3) if out["base_ms_per_token"] else 0.0
        return out

    def _metrics(self, items: list[EvalItem], adapter: _Run, base: _Run, full: _Run, latency: dict[str, float]) -> dict[str, Any]:
        def scores(run: _Run) -> dict[str, float]:
            return {name: round(mean([fn(out, item.expected) for out, item in zip(run.texts, items)]), 4)
                    for name, fn in SCORERS.items()}

        return {
            "adapter": scores(adapter),
            "base": scores(base),
            "full_precision": scores(full),
            "fp8_token_agreement": round(token_agreement(adapter.token_ids, full.token_ids), 4),
            "fp8_exact_output_match": round(mean([float(a == b) for a, b in zip(adapter.texts, full.texts)]), 4),
            "served_weight_dtype": self.serve_weight_dtype,
            "latency": latency,
        }

    @staticmethod
    def _example(item: EvalItem, adapter: str, base: str, full: str, metric: str) -> dict[str, Any]:
        score = SCORERS[metric]
        return {"prompt": item.prompt, "expected": item.expected, "adapter": adapter, "base": base,
                "full_precision": full, "adapter_score": round(score(adapter, item.expected), 4),
                "base_score": round(score(base, item.expected), 4)}

    @staticmethod
    def _drop_adapter(engine, content_id: str) -> None:
        if engine.adapters is None:
            return
        engine.adapters.poll()
        try:
            engine.adapters.unload(content_id)
        except AdapterFormatError:
            log.warning("candidate adapter %s still pinned after the gate run", content_id[:12])
        engine.adapters.forget_failure(content_id)
