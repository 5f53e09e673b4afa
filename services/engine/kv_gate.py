"""The FP8 KV cache gate: a model is served with `--kv-dtype fp8` only after its greedy outputs with an fp8
KV cache agree with the same engine's full-precision KV cache on its eval sets.

Beside the adapter quality gate (services/adapters/gate.py), which checks FP8 *weights* per adapter, this checks the FP8 *KV
cache* per base model: two engines that differ only in `kv_dtype` run every eval set greedy (the base set
on the base, each adapter's set with its adapter), and the verdict is the greedy token agreement over all
of them (`token_agreement`, which the adapter gate's FP8 check uses too) against `min_agreement`. A passing verdict is recorded under
`<home>/kv_gate/` keyed by the model's fingerprint and the compute/weight dtypes it was measured with;
`mplex engine serve --kv-dtype fp8` refuses a model without one (see `require_verdict`). Run it with
`mplex engine kv-gate`.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MIN_AGREEMENT = 0.98
VERDICT_DIR = "kv_gate"


def token_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Greedy token agreement of two runs over the same prompts: positions holding the same token,
    over all positions of the longer output of each pair (an output that stops early disagrees on the rest)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        same += sum(1 for i, j in zip(x, y) if i == j)
        total += max(len(x), len(y))
    return same / total if total else 1.0



@dataclass(frozen=True, slots=True)
class KvEvalSet:
    """Prompts (token ids) of one eval set, run under `adapter` (an AdapterRef; None = the base model)."""

    name: str
    prompts: list[list[int]]
    adapter: Any = None
    expected: list[str] | None = None  # answers, for the exact-match figures (optional)


@dataclass(frozen=True, slots=True)
class KvGateResult:
    passed: bool
    agreement: float  # over every eval set's greedy tokens
    min_agreement: float
    per_set: dict[str, dict[str, float]]
    bytes_per_token: dict[str, float]  # "fp8", "reference" (the model dtype's KV), "bf16", "fp32"
    model_fingerprint: str
    dtype: str
    weight_dtype: str
    max_new_tokens: int
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def message(self) -> str:
        ok = "passed" if self.passed else "FAILED"
        return (f"fp8 KV gate {ok}: greedy token agreement with the {self.dtype} KV cache {self.agreement:.4f} "
                f"(at least {self.min_agreement:.4f} required) over {sum(int(s['items']) for s in self.per_set.values())} "
                f"items; {self.bytes_per_token['fp8']:.1f} bytes/token vs {self.bytes_per_token['reference']:.1f}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_fingerprint(model_dir: Path) -> str:
    """Identifies a checkpoint cheaply: its config.json and the names and sizes of its weight files (hashing
    multi-GB weights at every serve would cost minutes)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        h.update(f"\0{p.name}\0{p.stat().st_size}".encode())
    return h.hexdigest()[:20]


def verdict_path(home: Path, model_dir: Path, dtype: str, weight_dtype: str) -> Path:
    return Path(home) / VERDICT_DIR / f"{model_fingerprint(model_dir)}-{dtype}-{weight_dtype}.json"


def record_verdict(home: Path, model_dir: Path, result: KvGateResult) -> Path:
    path = verdict_path(home, model_dir, result.dtype, result.weight_dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def load_verdict(home: Path, model_dir: Path, dtype: str, weight_dtype: str) -> dict[str, Any] | None:
    path = verdict_path(home, model_dir, dtype, weight_dtype)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class KvGateRequired(RuntimeError):
    """fp8 KV was asked for a model without a passing gate verdict; the message says how to get one."""


def require_verdict(home: Path, model_dir: Path, dtype: str, weight_dtype: str) -> dict[str, Any]:
    verdict = load_verdict(home, model_dir, dtype, weight_dtype)
    if verdict is None or not verdict.get("passed"):
        what = "no fp8 KV gate verdict" if verdict is None else (
            f"its fp8 KV gate failed (agreement {verdict.get('agreement', float('nan')):.4f} < "
            f"{verdict.get('min_agreement', float('nan')):.4f})")
        raise KvGateRequired(
            f"--kv-dtype fp8: model {model_dir} (dtype {dtype}, weights {weight_dtype}) has {what}; run "
            f"`mplex engine kv-gate --model {model_dir} --dtype {dtype} --weight-dtype {weight_dtype}` first "
            f"(or pass --skip-kv-gate to serve it unchecked)")
    return verdict


def check_fp8_kv(
    model_dir: Path,
    eval_sets: list[KvEvalSet],
    *,
    dtype: str = "float32",
    weight_dtype: str = "auto",
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    max_new_tokens: int = 48,
    kv_memory_bytes: int = 256 << 20,
    max_lora_rank: int = 64,
) -> KvGateResult:
    """Greedy outputs of every eval set with the model-dtype KV cache and with the fp8 KV cache."""
    from services.engine.config import CacheConfig, ModelConfig

    if not 0 <= min_agreement <= 1:
        raise ValueError("min_agreement must be in [0, 1]")
    if not eval_sets or not any(s.prompts for s in eval_sets):
        raise ValueError("the fp8 KV gate needs at least one eval item")
    engines = {kv: _engine(model_dir, dtype, weight_dtype, kv, kv_memory_bytes, max_lora_rank) for kv in ("auto", "fp8")}
    per_set: dict[str, dict[str, float]] = {}
    all_ref: list[list[int]] = []
    all_fp8: list[list[int]] = []
    for s in eval_sets:
        ref, ref_text = _greedy(engines["auto"], s, max_new_tokens)
        fp8, fp8_text = _greedy(engines["fp8"], s, max_new_tokens)
        all_ref += ref
        all_fp8 += fp8
        figures = {"items": float(len(s.prompts)), "token_agreement": token_agreement(ref, fp8),
                   "identical_outputs": sum(a == b for a, b in zip(ref, fp8)) / max(1, len(ref))}
        if s.expected is not None:
            figures["exact_match_reference"] = _exact(ref_text, s.expected)
            figures["exact_match_fp8"] = _exact(fp8_text, s.expected)
        per_set[s.name] = figures
    agreement = token_agreement(all_ref, all_fp8)
    mcfg = ModelConfig.from_dir(model_dir)
    import torch

    def per_token(kv: str, dt: torch.dtype) -> float:
        cache = CacheConfig(kv_dtype=kv)
        return cache.bytes_per_block(mcfg, dt) / cache.block_size

    compute = engines["auto"].config.torch_dtype
    bytes_per_token = {"fp8": per_token("fp8", compute), "reference": per_token("auto", compute),
                       "bf16": per_token("auto", torch.bfloat16), "fp32": per_token("auto", torch.float32)}
    return KvGateResult(agreement >= min_agreement, agreement, min_agreement, per_set, bytes_per_token,
                        model_fingerprint(model_dir), dtype, weight_dtype, max_new_tokens)


def _engine(model_dir: Path, dtype: str, weight_dtype: str, kv_dtype: str, memory: int, max_lora_rank: int):
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model_dir=Path(model_dir), served_model_name=f"kv-gate-{kv_dtype}", dtype=dtype, weight_dtype=weight_dtype,
        engine_id=f"kv-gate-{kv_dtype}",
        cache=CacheConfig(memory_bytes=memory, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048),
        lora=LoraConfig(max_loras=4, max_cpu_loras=8, max_lora_rank=max_lora_rank),
    ))


def _greedy(engine, s: KvEvalSet, max_new_tokens: int) -> tuple[list[list[int]], list[str]]:
    from services.engine.sequence import SamplingParams

    tag = f"kvgate-{time.monotonic_ns()}"
    ids = [f"{tag}-{i}" for i in range(len(s.prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    texts: dict[str, str] = {rid: "" for rid in ids}
    for rid, prompt in zip(ids, s.prompts):
        budget = min(max_new_tokens, engine.max_model_len - len(prompt))
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max(1, budget), temperature=0), adapter=s.adapter)
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"fp8 KV gate: request failed: {out.error}")
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.new_text
        if engine.last_plan_empty and engine.has_unfinished():
            engine.wake.wait(0.05)  # an adapter load in flight
            engine.wake.clear()
    return [tokens[r] for r in ids], [texts[r].strip() for r in ids]


def _exact(texts: list[str], expected: list[str]) -> float:
    return sum(t == e for t, e in zip(texts, expected)) / max(1, len(texts))


def demo_eval_sets(kit, adapter_items: int = 200) -> list[KvEvalSet]:
    """The demo kit's eval sets: its base set, and per adapter `adapter_items` held-out items of its task
    (the kit's 40 are too few to resolve 2 points of accuracy). They come from the kit's own eval stream
    (its 40 first), minus any prompt the adapter's training data contains."""
    from services.common.lora_format import content_id
    from services.common.prompting import PromptBuilder
    from services.engine.sequence import AdapterRef
    from services.modelkit import corpus
    from services.modelkit.config import DEMO_CONFIG

    builder = PromptBuilder(kit.base_dir)

    def ids(prompt: str) -> list[int]:
        return builder.chat_ids([{"role": "user", "content": prompt}])

    rows = [json.loads(x) for x in Path(kit.base_eval).read_text().splitlines() if x.strip()]
    sets = [KvEvalSet("base", [ids(r["prompt"]) for r in rows], None, [r["expected"] for r in rows])]
    specs = {a.name: a for a in DEMO_CONFIG.adapters}
    for name, a in kit.adapters.items():
        spec = specs[name]
        first = corpus.adapter_eval_set(spec.task, DEMO_CONFIG.eval_size, DEMO_CONFIG.seed)
        trained = {e.prompt for e in corpus.adapter_training(spec.task, DEMO_CONFIG.seed,
                                                             spec.train.steps * spec.train.batch_size,
                                                             exclude={e.prompt for e in first})}
        held_out = [e for e in corpus.adapter_eval_set(spec.task, adapter_items, DEMO_CONFIG.seed)
                    if e.prompt not in trained]
        ref = AdapterRef(content_id(a.path), name, str(a.path))
        sets.append(KvEvalSet(name, [ids(e.prompt) for e in held_out], ref, [e.answer for e in held_out]))
    return sets
