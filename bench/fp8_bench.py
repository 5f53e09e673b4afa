"""FP8 base weights on the demo kit: weight memory vs a bf16 model, and what FP8 does to greedy outputs.

Engines: fp32 (the reference), FP8 weights with fp32 compute (isolates the weight quantization), and for
memory a bf16 model vs FP8 weights with bf16 compute. Every demo eval set (200 held-out items per adapter task, see _eval_sets) runs greedy through the fp32 and
FP8 engines — the base set on the base model, each adapter's set with its adapter on top of the FP8 base
(the LoRA branch in the compute dtype) — and we report greedy token agreement (positions holding the same
token, over the longer output of each pair) and exact-match task accuracy.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from bench.common import Target, table, write_results

MAX_NEW = 48
ADAPTER_ITEMS = int(os.environ.get("MPLEX_BENCH_FP8_ITEMS", "200"))


def _engine(kit, dtype: str, weight_dtype: str):
    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=kit.base_dir, served_model_name=kit.model_name, dtype=dtype,
                                  weight_dtype=weight_dtype, cache=CacheConfig(memory_bytes=256 * 2**20),
                                  scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048)))


def _eval_sets(kit) -> dict[str, tuple[Path | None, list[dict]]]:
    """The kit's base eval set, and per adapter ADAPTER_ITEMS held-out items of its task: the kit's 40 are
    too few to resolve 2 points of accuracy (one item is 2.5). They come from the kit's own eval stream
    (its 40 first), minus any prompt the adapter's training data contains."""
    from services.modelkit import corpus
    from services.modelkit.config import DEMO_CONFIG

    rows = [json.loads(x) for x in Path(kit.base_eval).read_text().splitlines() if x.strip()]
    sets: dict[str, tuple[Path | None, list[dict]]] = {"base": (None, rows)}
    specs = {a.name: a for a in DEMO_CONFIG.adapters}
    for name, a in kit.adapters.items():
        spec = specs[name]
        first = corpus.adapter_eval_set(spec.task, DEMO_CONFIG.eval_size, DEMO_CONFIG.seed)
        trained = {e.prompt for e in corpus.adapter_training(spec.task, DEMO_CONFIG.seed,
                                                                 spec.train.steps * spec.train.batch_size,
                                                                 exclude={e.prompt for e in first})}
        held_out = [e for e in corpus.adapter_eval_set(spec.task, ADAPTER_ITEMS, DEMO_CONFIG.seed) if e.prompt not in trained]
        sets[name] = (a.path, [{"prompt": e.prompt, "expected": e.answer} for e in held_out])
    return sets


def _run(engine, builder, adapter, items: list[dict]) -> tuple[list[list[int]], list[str]]:
    from services.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for i, item in enumerate(items):
        engine.add_request(f"r{i}", builder.chat_ids([{"role": "user", "content": item["prompt"]}]), params, adapter=adapter)
        tokens[f"r{i}"], texts[f"r{i}"] = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.new_text
        if engine.last_plan_empty:
            engine.wake.wait(0.01)
            engine.wake.clear()
    ids = [f"r{i}" for i in range(len(items))]
    return [tokens[i] for i in ids], [texts[i].strip() for i in ids]


def main() -> None:
    from services.adapters.scoring import token_agreement
    from services.common.lora_format import content_id
    from services.common.prompting import PromptBuilder
    from services.engine.sequence import AdapterRef
    from services.modelkit import ensure_demo

    torch.set_num_threads(int(os.environ.get("MPLEX_BENCH_THREADS", "2")))
    kit = ensure_demo()
    builder = PromptBuilder(kit.base_dir)
    bf16 = _engine(kit, "bfloat16", "auto").model.weight_bytes()
    fp8_bf16 = _engine(kit, "bfloat16", "fp8").model.weight_bytes()
    memory_ratio = fp8_bf16 / bf16
    print(f"weights: bf16 {bf16 / 2**20:.2f} MiB, FP8 (bf16 compute) {fp8_bf16 / 2**20:.2f} MiB -> {memory_ratio:.3f}x", flush=True)

    full, fp8 = _engine(kit, "float32", "auto"), _engine(kit, "float32", "fp8")
    rows, per_set = [], {}
    all_full: list[list[int]] = []
    all_fp8: list[list[int]] = []
    worst_drop = 0.0
    for name, (path, items) in _eval_sets(kit).items():
        ref = AdapterRef(content_id(path), name, str(path)) if path else None
        t_full, s_full = _run(full, builder, ref, items)
        t_fp8, s_fp8 = _run(fp8, builder, ref, items)
        acc_full = sum(s == it["expected"] for s, it in zip(s_full, items)) / len(items)
        acc_fp8 = sum(s == it["expected"] for s, it in zip(s_fp8, items)) / len(items)
        agree = token_agreement(t_full, t_fp8)
        all_full += t_full
        all_fp8 += t_fp8
        if path is not None:
            worst_drop = max(worst_drop, acc_full - acc_fp8)
        per_set[name] = {"items": len(items), "token_agreement": agree, "exact_match_fp32": acc_full, "exact_match_fp8": acc_fp8}
        rows.append([name, len(items), agree, acc_full, acc_fp8, 100 * (acc_fp8 - acc_full)])
    overall = token_agreement(all_full, all_fp8)
    rows.append(["all", sum(r[1] for r in rows), overall, float("nan"), float("nan"), float("nan")])
    print(table("FP8 weights vs fp32 on the demo eval sets (greedy, fp32 compute)",
                ["eval set", "items", "token agreement", "exact match fp32", "exact match fp8", "delta points"], rows))
    write_results("fp8", {"weight_bytes": {"bf16": bf16, "fp8_bf16_compute": fp8_bf16}, "memory_ratio": memory_ratio,
                          "token_agreement": overall, "eval_sets": per_set, "max_new_tokens": MAX_NEW}, [
        Target("FP8 weight memory / bf16 weight memory", memory_ratio, 0.55, higher_is_better=False),
        Target("greedy token agreement FP8 vs fp32 (all demo eval sets)", overall, 0.95),
        Target("worst adapter exact-match drop FP8 vs fp32 (points)", 100 * worst_drop, 2.0, higher_is_better=False),
    ])
