"""The quality gate: an adapter is served only if it does what its eval set asks (or, without one, does not
damage what the base model does well), produces well-formed output, and stays faithful when served on the
FP8 base.

Three greedy runs over the same items, with the engine library (CPU or GPU):
  adapter   the adapter on the base as engines serve it (FP8 weights when `serve_weight_dtype="fp8"`)
  base      the same served base without the adapter (same batch: base rows ride along)
  full      the adapter on the full-precision base
Scores: exact match, token F1 and ROUGE-L of each run against `expected`; the paired per-item drop from
base to adapter (base-capability sets); malformed outputs (empty, undecodable, looping) and degenerate
logits (NaN/Inf or flat) of the adapter run; greedy token agreement of `adapter` with `full`; a latency
sample (single requests with and without the adapter). The verdict is services.adapters.checks.decide.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.adapters.checks import NO_REGRESSION, QUALITY_CHECKS, Thresholds, decide, regression
from services.adapters.evalset import EvalItem
from services.adapters.scoring import SCORERS, malformation, mean, token_agreement
from services.common.lora_format import AdapterFormatError

log = logging.getLogger("mplex.adapters.gate")

Progress = Callable[[float, str], None]  # (fraction 0..1 of the gate's work, step)


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
    degenerate: list[int]  # per output: generated tokens whose logits were NaN/Inf or flat


__all__ = ["GateError", "GateResult", "GateRunner", "Thresholds", "decide"]


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
            check: str, max_new_tokens: int, latency_samples: int = 3, min_items: int = 1,
            progress: Progress | None = None) -> GateResult:
        """Score the adapter at `adapter_uri` (a directory, or an object-store URI the engine fetches as it
        would when serving) on `items` and judge it with the quality `check` (`margin` on a task eval set,
        `no_regression` on a base-capability set); the engine checks the files hash to `content_id`.
        Fewer than `min_items` items that fit the context is a GateError (the set cannot judge)."""
        from services.engine.sequence import AdapterRef

        if check not in QUALITY_CHECKS:
            raise ValueError(f"check must be one of {QUALITY_CHECKS}")
        progress = progress or (lambda f, s: None)
        ref = AdapterRef(content_id, f"candidate-{content_id[:12]}", str(adapter_uri))
        served = self._engine(self.serve_weight_dtype)
        full = self._engine("auto") if self.serve_weight_dtype != "auto" else served
        prompts = [self.prompt_ids(item) for item in items]
        limit = min(served.max_model_len, full.max_model_len)
        usable = [i for i, p in enumerate(prompts) if len(p) < limit - 1]
        if not usable:
            raise AdapterFormatError("eval_set_too_long", f"no eval item fits the model's context of {limit} tokens")
        if len(usable) < min_items:
            raise GateError(f"only {len(usable)} eval items fit the model's context; this check needs {min_items}")
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
        metrics = self._metrics(items, adapter, base, full_run, latency, check=check, thresholds=thresholds)
        metrics["n_examples"] = len(items)
        metrics["n_skipped"] = skipped  # longer than the model's context
        passed, reasons = decide(metrics, thresholds)
        examples = [self._example(item, i, adapter, base, full_run, thresholds.metric) for i, item in enumerate(items)]
        progress(1.0, "decided")
        return GateResult(passed, metrics, thresholds.as_dict(), reasons, examples)

    def _generate(self, engine, prompts: list[list[int]], budgets: list[int], refs: list, on_progress) -> list[_Run]:
        """Greedy outputs of every prompt under each of `refs` (None = the base), in one continuous batch.
        Each token's logprob comes back too: a NaN/Inf one, or one at -ln(vocab) (greedy picked from a flat,
        uniform distribution: the logits carry nothing), marks degenerate logits."""
        from services.engine.sequence import SamplingParams

        tag = f"gate-{time.monotonic_ns()}"
        texts: dict[str, list[str]] = {}
        ids: dict[str, list[int]] = {}
        degenerate: dict[str, int] = {}
        flat = -math.log(engine.model.config.vocab_size) + 1e-4
        order = []
        for k, ref in enumerate(refs):
            for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
                rid = f"{tag}-{k}-{i}"
                engine.add_request(rid, prompt, SamplingParams(max_tokens=budget, temperature=0.0, logprobs=0), adapter=ref)
                texts[rid], ids[rid], degenerate[rid] = [], [], 0
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
                degenerate[out.request_id] += sum(1 for lp in out.logprobs or () if not math.isfinite(lp.logprob) or lp.logprob <= flat)
                if out.finished:
                    done += 1
                    on_progress(done / total)
            if engine.last_plan_empty and engine.has_unfinished():
                engine.wake.wait(0.05)  # an adapter load in flight
                engine.wake.clear()
        n = len(prompts)
        return [_Run(["".join(texts[rid]) for rid in rows], [ids[rid] for rid in rows], [degenerate[rid] for rid in rows])
                for rows in (order[k * n:(k + 1) * n] for k in range(len(refs)))]

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

    def _metrics(self, items: list[EvalItem], adapter: _Run, base: _Run, full: _Run, latency: dict[str, float], *,
                 check: str, thresholds: Thresholds) -> dict[str, Any]:
        def per_item(run: _Run, fn) -> list[float]:
            return [fn(out, item.expected) for out, item in zip(run.texts, items)]

        def scores(run: _Run) -> dict[str, float]:
            return {name: round(mean(per_item(run, fn)), 4) for name, fn in SCORERS.items()}

        metrics = {
            "check": check,
            "adapter": scores(adapter),
            "base": scores(base),
            "full_precision": scores(full),
            "malformed": self._malformed(items, adapter, base),
            "degenerate_logits": {"tokens": sum(adapter.degenerate), "outputs": sum(1 for d in adapter.degenerate if d),
                                  "checked": sum(len(t) for t in adapter.token_ids)},
            "fp8_token_agreement": round(token_agreement(adapter.token_ids, full.token_ids), 4),
            "fp8_exact_output_match": round(mean([float(a == b) for a, b in zip(adapter.texts, full.texts)]), 4),
            "served_weight_dtype": self.serve_weight_dtype,
            "latency": latency,
        }
        if check == NO_REGRESSION:
            fn = SCORERS[thresholds.metric]
            metrics["regression"] = regression(per_item(adapter, fn), per_item(base, fn),
                                               confidence=thresholds.regression_confidence).as_dict()
        return metrics

    @staticmethod
    def _malformed(items: list[EvalItem], adapter: _Run, base: _Run) -> dict[str, Any]:
        """Outputs of the adapter that are malformed where the base's output for the same item is not (a base
        that already loops on an item does not count against the adapter)."""
        kinds = {"empty": 0, "undecodable": 0, "repetition": 0}
        base_total = adapter_total = 0
        for i, item in enumerate(items):
            a = malformation(adapter.texts[i], adapter.token_ids[i], item.expected)
            b = malformation(base.texts[i], base.token_ids[i], item.expected)
            adapter_total += a is not None
            base_total += b is not None
            if a is not None and b is None:
                kinds[a] += 1
        count = sum(kinds.values())
        return {"count": count, "rate": round(count / len(items), 4) if items else 0.0, **kinds,
                "adapter_total": adapter_total, "base_total": base_total}

    @staticmethod
    def _example(item: EvalItem, i: int, adapter: _Run, base: _Run, full: _Run, metric: str) -> dict[str, Any]:
        score = SCORERS[metric]
        out = {"prompt": item.prompt, "expected": item.expected, "adapter": adapter.texts[i], "base": base.texts[i],
               "full_precision": full.texts[i], "adapter_score": round(score(adapter.texts[i], item.expected), 4),
               "base_score": round(score(base.texts[i], item.expected), 4)}
        malformed = malformation(adapter.texts[i], adapter.token_ids[i], item.expected)
        if malformed is not None:
            out["adapter_malformed"] = malformed
        return out

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
