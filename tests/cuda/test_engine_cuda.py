"""The engine on `cuda`, end to end, against the CPU suites' oracles: HF transformers fp32 greedy for the base
model (tests/engine/test_oracle.py's prompts and references) and PEFT for many adapters in one batch
(tests/engine/test_multi_lora.py's workload) -- one continuous batch, chunked prefill, preemption by recompute
and by swap through the pinned host tier, async scheduling, speculative decoding with the kit's draft model,
the split (core process) path; then the FP8 KV cache through the Triton decode kernel and bf16 + FP8 weights
through `_scaled_mm`, which cannot be token-identical to fp32 and are held to agreement floors instead."""
from __future__ import annotations

import json

import pytest
import torch

from services.engine.kv_gate import token_agreement
from tests.engine import test_multi_lora as lora_suite
from tests.engine.conftest import make_config, make_engine, run_all, spec_tokens
from tests.engine.oracle import ARTIFACTS
from tests.engine.test_multi_lora import (  # noqa: F401  (fixtures)
    MAX_NEW as LORA_MAX_NEW,
    adapters,
    peft_model,
    peft_refs,
    refs_of,
    workload,
)
from tests.engine.test_oracle import MAX_NEW, _requests, hf_model, prompts, references  # noqa: F401  (fixtures)
from tests.engine.test_oracle import _check as oracle_check

CUDA = "cuda"


def _check(name, engine, prompts, references):
    """test_oracle's check (an LLMEngine stepped here, or an EngineConfig served by a core process), logged as cuda-."""
    return oracle_check(f"cuda-{name}", engine, prompts, references)


def _engine(demo_kit, **kw):
    engine = make_engine(demo_kit.base_dir, device=CUDA, **kw)
    assert torch.device(engine.runner.device).type == "cuda"
    return engine


@pytest.mark.parametrize("path", ["batch", "chunked", "recompute", "swap"])
def test_base_model_matches_the_hf_oracle(demo_kit, prompts, references, path):
    need = max(len(p) + MAX_NEW for p in prompts)
    kw = {"batch": {}, "chunked": dict(block_size=4, budget=7),
          "recompute": dict(block_size=4, num_blocks=need // 4 + 12, budget=64, preemption_mode="recompute"),
          "swap": dict(block_size=4, num_blocks=need // 4 + 12, budget=32, preemption_mode="swap")}[path]
    engine = _engine(demo_kit, **kw)
    _check(path, engine, prompts, references)
    if path in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions > 0
    if path == "swap":
        assert engine.metrics.swap_in_blocks._value.get() > 0 and engine.kv.host.num_used == 0


def test_async_scheduling_matches_the_hf_oracle(demo_kit, prompts, references):
    engine = _engine(demo_kit, async_scheduling=True, block_size=4, budget=32)
    _check("async", engine, prompts, references)
    assert engine.overlap.times.forward > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_speculative_decoding_matches_the_hf_oracle(demo_kit, prompts, references, drafter):
    engine = _engine(demo_kit, speculative=drafter, draft_model=demo_kit.draft_dir)
    _check(f"spec-{drafter}", engine, prompts, references)
    assert spec_tokens(engine, "accepted") > 0


def test_split_path_matches_the_hf_oracle(demo_kit, prompts, references):
    """`mplex engine serve`'s shape: a spawned core process on the GPU, this process as its front-end."""
    _check("split", make_config(demo_kit.base_dir, device=CUDA, block_size=4, budget=32), prompts, references)


@pytest.mark.parametrize("slots", ["all", "few"])
def test_multi_lora_matches_peft(demo_kit, workload, refs_of, peft_refs, slots):  # noqa: F811
    """The Triton SGMV kernels in the engine (fp32, ieee dots): every adapter in one batch, and fewer device
    slots than adapters with chunking, prefix hits and preemption."""
    distinct = {a for a, _ in workload if a}
    if slots == "all":
        engine = _engine(demo_kit, max_loras=len(distinct), max_cpu_loras=len(distinct))
    else:
        need = max(len(p) + LORA_MAX_NEW for _, p in workload)
        engine = _engine(demo_kit, max_loras=4, max_cpu_loras=6, block_size=4, budget=24, num_blocks=need // 4 + 30,
                         preemption_mode="recompute")
    lora_suite._check(f"cuda-lora-{slots}", engine, workload, refs_of, peft_refs)
    if slots == "few":
        assert engine.scheduler.num_preemptions > 0 and engine.adapters.slot_loads > len(distinct)


def _agreement(name, got: dict[str, list[int]], want: dict[str, list[int]]) -> dict:
    keys = sorted(want)
    same = sum(got[k] == want[k] for k in keys)
    figures = {"name": name, "sequences": len(keys), "identical": same,
               "token_agreement": token_agreement([got[k] for k in keys], [want[k] for k in keys])}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / f"cuda_agreement_{name}.json").write_text(json.dumps(figures, indent=2))
    print(f"\n[cuda] {name}: {figures}")
    return figures


def test_fp8_kv_cache_through_the_triton_decode_kernel(demo_kit, prompts):
    """Same fp8 KV scheme on both sides: the CPU engine reads it with the native C kernel, the GPU engine with
    the Triton kernel; only fp32 summation order differs, so greedy outputs agree but for near-ties."""
    requests = _requests(prompts)
    gpu = _engine(demo_kit, kv_dtype="fp8")
    assert gpu.runner.attention_kernel is not None, "an fp8 cache on CUDA decodes through the Triton kernel"
    got = run_all(gpu, requests)
    want = run_all(make_engine(demo_kit.base_dir, kv_dtype="fp8"), _requests(prompts))
    figures = _agreement("fp8-kv", got, want)
    assert figures["identical"] >= 0.9 * len(requests) and figures["token_agreement"] >= 0.95


def test_bf16_with_fp8_weights(demo_kit, prompts, references):
    """Production dtypes: bf16 activations, FP8 weights through `_scaled_mm`. Not the fp32 oracle's tokens,
    so held to floors on agreement with it (measured figures go to test-artifacts/)."""
    engine = _engine(demo_kit, dtype="bfloat16", weight_dtype="fp8")
    got = run_all(engine, _requests(prompts))
    want = {f"r{i}": ref.tokens for i, ref in enumerate(references)}
    figures = _agreement("bf16-fp8-weights", got, want)
    first = sum(got[k][:1] == want[k][:1] for k in want)
    assert first >= 0.8 * len(want) and figures["token_agreement"] >= 0.6
