"""The speculative decoding gate: speculation is turned on per model and per adapter only where it measured
exact and worth it.

Two engines that differ only in `speculative.method` run each eval set (the base model's, and each
adapter's under its adapter; the fp8 KV gate's sets, kv_gate.py) greedy, one request at a time -- the
latency case speculation is for. A set passes when the outputs agree (greedy token agreement, the KV
gate's measure, at least `min_agreement`: identical up to float near-ties between the decode and the
verification kernels) and its TPOT is at least `min_gain` times lower with speculation. The verdict, keyed
by the model's fingerprint and method, lists the passing sets' keys ("base" or an adapter's content id);
`mplex engine serve --speculative ngram` speculates only for those (SpeculativeConfig.enabled_for).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.engine.config import spec_key
from services.engine.kv_gate import KvEvalSet, model_fingerprint, token_agreement

VERDICT_DIR = "spec_gate"
DEFAULT_MIN_GAIN = 1.1
DEFAULT_MIN_AGREEMENT = 0.999


@dataclass(frozen=True, slots=True)
class SpecGateResult:
    method: str
    enabled: list[str]  # keys of the sets that passed
    per_set: dict[str, dict[str, Any]]
    min_gain: float
    min_agreement: float
    model_fingerprint: str
    max_new_tokens: int
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def message(self) -> str:
        parts = [f"{name}: agreement {s['token_agreement']:.4f}, TPOT {s['tpot_plain_ms']:.2f} -> "
                 f"{s['tpot_spec_ms']:.2f} ms ({s['gain']:.2f}x), acceptance {s['acceptance']:.2f} "
                 f"{'ON' if s['passed'] else 'off'}" for name, s in self.per_set.items()]
        return f"speculative ({self.method}) gate:\n  " + "\n  ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_speculation(model_dir: Path, eval_sets: list[KvEvalSet], *, method: str = "ngram",
                      min_gain: float = DEFAULT_MIN_GAIN, min_agreement: float = DEFAULT_MIN_AGREEMENT,
                      max_new_tokens: int = 48, max_items: int = 24, dtype: str = "float32",
                      draft_model: Path | None = None) -> SpecGateResult:
    """Gate one drafter ("ngram" or "draft_model", with its checkpoint `draft_model`)."""
    if not eval_sets or not any(s.prompts for s in eval_sets):
        raise ValueError("the speculative gate needs at least one eval item")
    plain, spec = (_engine(model_dir, dtype, m, draft_model) for m in ("off", method))
    per_set: dict[str, dict[str, Any]] = {}
    enabled: list[str] = []
    for s in eval_sets:
        prompts = s.prompts[:max_items]
        _one_by_one(plain, prompts[:2], s.adapter, max_new_tokens)  # warm-up (adapter load, first steps)
        _one_by_one(spec, prompts[:2], s.adapter, max_new_tokens)
        a = _one_by_one(plain, prompts, s.adapter, max_new_tokens)
        b = _one_by_one(spec, prompts, s.adapter, max_new_tokens)
        agreement = token_agreement(a["tokens"], b["tokens"])
        gain = a["tpot"] / b["tpot"] if b["tpot"] > 0 else float("nan")
        passed = agreement >= min_agreement and gain >= min_gain
        per_set[s.name] = {"key": spec_key(s.adapter), "items": len(prompts), "token_agreement": agreement,
                           "tpot_plain_ms": 1000 * a["tpot"], "tpot_spec_ms": 1000 * b["tpot"], "gain": gain,
                           "acceptance": b["accepted"] / b["drafted"] if b["drafted"] else 0.0, "passed": passed}
        if passed:
            enabled.append(spec_key(s.adapter))
    return SpecGateResult(method, enabled, per_set, min_gain, min_agreement, model_fingerprint(model_dir),
                          max_new_tokens)


def _engine(model_dir: Path, dtype: str, method: str, draft_model: Path | None):
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SpeculativeConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model_dir=Path(model_dir), served_model_name=f"spec-gate-{method}", dtype=dtype, engine_id=f"spec-gate-{method}",
        cache=CacheConfig(memory_bytes=128 << 20), lora=LoraConfig(max_loras=4, max_cpu_loras=8),
        speculative=SpeculativeConfig(method=method, draft_model=draft_model if method != "off" else None),
    ))


def _one_by_one(engine, prompts: list[list[int]], adapter, max_new_tokens: int) -> dict[str, Any]:
    """Each prompt alone, greedy: its tokens, and the mean over requests of (last - first token) / (n - 1)."""
    from services.engine.sequence import SamplingParams

    tokens, tpots, drafted, accepted = [], [], 0, 0
    for i, prompt in enumerate(prompts):
        rid = f"specgate-{time.monotonic_ns()}-{i}"
        budget = max(1, min(max_new_tokens, engine.max_model_len - len(prompt)))
        engine.add_request(rid, prompt, SamplingParams(max_tokens=budget, temperature=0), adapter=adapter)
        out, stamps = [], []
        while engine.has_unfinished():
            for o in engine.step():
                if o.error is not None:
                    raise RuntimeError(f"speculative gate: request failed: {o.error}")
                out += o.new_token_ids
                stamps += [time.perf_counter()] * len(o.new_token_ids)
                drafted, accepted = drafted + o.finished * o.num_draft_tokens, accepted + o.finished * o.num_accepted_tokens
            if engine.last_plan_empty and engine.has_unfinished():
                engine.wake.wait(0.05)
                engine.wake.clear()
        tokens.append(out)
        if len(stamps) > 1:
            tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"tokens": tokens, "tpot": sum(tpots) / len(tpots) if tpots else 0.0, "drafted": drafted,
            "accepted": accepted}


def verdict_path(home: Path, model_dir: Path, method: str) -> Path:
    return Path(home) / VERDICT_DIR / f"{model_fingerprint(model_dir)}-{method}.json"


def record_verdict(home: Path, model_dir: Path, result: SpecGateResult) -> Path:
    path = verdict_path(home, model_dir, result.method)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def chosen_drafters(home: Path, model_dir: Path) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None:
    """`--speculative auto`: the keys some drafter's verdict enables, and per key the drafter that passed
    with the higher gain. None without any verdict."""
    from services.engine.config import DRAFTERS

    best: dict[str, tuple[float, str]] = {}
    found = False
    for method in DRAFTERS:
        try:
            verdict = json.loads(verdict_path(home, model_dir, method).read_text())
        except (OSError, ValueError):
            continue
        found = True
        for s in verdict["per_set"].values():
            if s["passed"] and s["gain"] > best.get(s["key"], (0.0, ""))[0]:
                best[s["key"]] = (s["gain"], method)
    if not found:
        return None
    return tuple(best), tuple((key, method) for key, (_, method) in best.items())


def enabled_keys(home: Path, model_dir: Path, method: str) -> tuple[str, ...] | None:
    """The keys a recorded verdict turns speculation on for; None without a verdict."""
    try:
        return tuple(json.loads(verdict_path(home, model_dir, method).read_text())["enabled"])
    except (OSError, ValueError, KeyError):
        return None
