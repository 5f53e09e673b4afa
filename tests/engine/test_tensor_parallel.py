"""Tensor parallelism for real on the CPU: two processes over gloo (services/engine/parallel/).

TP=2 greedy output must be TP=1's token for token -- on the oracle prompts with chunked prefill, prefix hits
and preemption (swap and recompute), with 16+ adapters mixed in one batch and more adapters than slots, and
with FP8 weights. Float sums are ordered differently under TP (two partial sums all-reduced), so where a
request does differ, the Hugging Face reference must show a near-tie there (oracle.TIE_GAP); such cases are
written to test-artifacts/ like the oracle's own. A killed or hung rank takes the engine to dead, never a hang;
sizes the model's heads or MLP do not split into are refused.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from services.common.lora_format import content_id
from services.common.prompting import PromptBuilder
from services.common.wire import EngineFailed, EngineUnavailable
from services.engine.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from services.engine.engine import LLMEngine
from services.engine.model.loader import load_model
from services.engine.parallel.comm import TpComm, open_store
from services.engine.parallel.loader import load_shard
from services.engine.parallel.runner import TensorParallelFailure
from services.engine.parallel.shard import TpShard
from services.engine.sequence import AdapterRef, SamplingParams
from tests.engine.conftest import collect, make_config, record_swaps, run_all, split_engine
from tests.engine.oracle import TieLog, hf_greedy, oracle_questions_and_prompts

# A hang is the failure these tests exist to catch: one that hangs anyway fails instead of stalling the suite.
pytestmark = pytest.mark.timeout(300)

MAX_NEW = 32
SYSTEM = "You are a careful assistant. Answer briefly and exactly. " * 4


def tp(config: EngineConfig, n: int = 2, timeout_s: float = 30.0) -> EngineConfig:
    return dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=n, collective_timeout_s=timeout_s))


@contextlib.contextmanager
def engine_of(config: EngineConfig):
    """An engine with one torch thread per rank (2 ranks on this 2-core VM); its other ranks stopped after."""
    torch.set_num_threads(1)
    engine = LLMEngine(config)
    try:
        yield engine
    finally:
        if engine.tp is not None:
            engine.tp.close()
        if engine.adapters is not None:
            engine.adapters.shutdown()


def run_pair(config: EngineConfig, requests: list[dict], record: bool = False):
    """(TP=1 outputs, TP=2 outputs, TP=2 engine facts) for the same requests and config."""
    with engine_of(config) as one:
        want = run_all(one, requests)
    with engine_of(tp(config)) as two:
        swaps = record_swaps(two) if record else []
        got = run_all(two, requests)
        facts = {"swaps": len(swaps), "prefix_hits": two.scheduler.prefix_hit_tokens,
                 "preemptions": sum(two.scheduler.preemptions_by_kind.values()),
                 "slot_loads": two.adapters.slot_loads if two.adapters else 0,
                 "kv_blocks": two.kv.pool.num_blocks, "rank_weights": two.tp.rank_weight_bytes}
    return want, got, facts


def check_pair(name: str, requests: list[dict], want, got, reference) -> int:
    """TP=2 == TP=1 per request; where not, both must agree with the HF/PEFT reference (computed only then) up
    to a near-tie (oracle.TIE_GAP), the divergences written to test-artifacts/. Returns how many differed."""
    log = TieLog(name)
    differed = 0
    for r in requests:
        rid = r["id"]
        if got[rid] == want[rid]:
            continue
        differed += 1
        ref = reference(r)
        log.check(f"{rid}/tp2", got[rid], ref)
        log.check(f"{rid}/tp1", want[rid], ref)
    log.write()
    return differed


# -- the oracle prompts: chunked prefill, prefix hits, preemption by swap ------------------------------------
@pytest.fixture(scope="module")
def prompts(demo_kit) -> list[list[int]]:
    """test_oracle's recipe: questions from every eval set, every third behind a document; and a shared system
    prompt in front of eight of them (prefix hits)."""
    questions, out = oracle_questions_and_prompts(demo_kit)
    builder = PromptBuilder(demo_kit.base_dir)
    out += [builder.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in questions[:8]]
    return out


@pytest.fixture(scope="module")
def hf_model(demo_kit):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_kit.base_dir, dtype=torch.float32).eval()


def test_oracle_prompts_tp2_equal_tp1_with_chunks_prefix_hits_and_swaps(demo_kit, prompts, hf_model):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    requests = [{"id": f"r{i}", "prompt": p, "params": params} for i, p in enumerate(prompts)]
    longest = max(len(p) for p in prompts)
    # test_oracle's swap configuration: a pool a dozen blocks above the longest request (preemption, by swap to
    # the host tier and back, mid-prefill and mid-decode) and a budget of 32 tokens (chunked prefill).
    config = make_config(demo_kit.base_dir, block_size=4, num_blocks=(longest + MAX_NEW) // 4 + 12, budget=32,
                         preemption_mode="swap")
    want, got, facts = run_pair(config, requests, record=True)
    assert longest > 32, "prompts longer than the budget: chunked prefill"
    assert facts["prefix_hits"] > 0 and facts["swaps"] > 0, facts
    differed = check_pair("tp2-oracle", requests, want, got, lambda r: hf_greedy(hf_model, r["prompt"], MAX_NEW))
    assert differed <= 1, f"{differed} of {len(requests)} requests differ between TP=1 and TP=2"


# -- 16+ adapters mixed in a batch, more adapters than slots, preemption by recompute ------------------------
RANDOM_SPECS = [  # (rank, targets, alpha, rslora): every module, column- and row-parallel, alone and together
    (4, ["q_proj", "v_proj"], 8, False), (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], 16, False),
    (16, ["gate_proj", "up_proj", "down_proj"], 16, True), (32, ["o_proj", "down_proj"], 32, False),
    (64, ["k_proj", "v_proj"], 32, False), (2, ["q_proj"], 4, False), (8, ["up_proj", "down_proj"], 8, False),
    (12, ["o_proj"], 24, True), (6, ["q_proj", "k_proj", "o_proj"], 6, False), (24, ["gate_proj"], 12, False),
    (1, ["down_proj"], 2, False), (48, ["v_proj", "o_proj", "up_proj"], 96, False),
]


@pytest.fixture(scope="module")
def adapter_refs(demo_kit, tmp_path_factory) -> dict[str, AdapterRef]:
    from services.modelkit import make_random_adapter

    paths = {name: a.path for name, a in demo_kit.adapters.items()}
    root = tmp_path_factory.mktemp("tp-adapters")
    for i, (r, targets, alpha, rs) in enumerate(RANDOM_SPECS):
        paths[f"rand{i}"] = make_random_adapter(demo_kit.base_dir, root / f"rand{i}", rank=r, target_modules=targets,
                                                lora_alpha=alpha, seed=300 + i, use_rslora=rs)
    assert len(paths) >= 16
    return {name: AdapterRef(content_id(p), name, str(p)) for name, p in paths.items()}


def test_sixteen_plus_adapters_mixed_tp2_equal_tp1(demo_kit, adapter_refs):
    builder = PromptBuilder(demo_kit.base_dir)
    names = list(adapter_refs)
    questions = []
    for a in demo_kit.adapters.values():
        questions += [json.loads(x)["prompt"] for x in a.eval_path.read_text().splitlines()[:3]]
    params = SamplingParams(max_tokens=20, temperature=0)
    requests = []
    for i in range(2 * len(names) + 4):
        messages = [{"role": "user", "content": questions[i % len(questions)]}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        adapter = None if i % 7 == 6 else adapter_refs[names[i % len(names)]]
        requests.append({"id": f"a{i}", "prompt": builder.chat_ids(messages), "params": params, "adapter": adapter})
    need = max(len(r["prompt"]) for r in requests) + 20
    # 6 slots for 16 adapters (installs and evictions replayed on rank 1), a tiny budget (chunks) and a pool
    # too small for the batch (preemption, by recompute). The pool is calibrated on the kit's answers: the
    # stop-39 kit's adapters answer right and stop sooner, and +40 blocks no longer ran short (+36 still did).
    config = make_config(demo_kit.base_dir, max_loras=6, max_cpu_loras=8, block_size=8, budget=48,
                         num_blocks=need // 8 + 20, preemption_mode="recompute")
    want, got, facts = run_pair(config, requests)
    assert facts["preemptions"] > 0 and facts["slot_loads"] > 6, facts

    def peft_reference(r):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(demo_kit.base_dir, dtype=torch.float32)
        if r["adapter"] is None:
            return hf_greedy(base.eval(), r["prompt"], 20)
        model = PeftModel.from_pretrained(base, r["adapter"].path, adapter_name=r["adapter"].name).eval()
        return hf_greedy(model, r["prompt"], 20, adapter=r["adapter"].name)

    differed = check_pair("tp2-lora", requests, want, got, peft_reference)
    assert differed <= 1, f"{differed} of {len(requests)} requests differ between TP=1 and TP=2"


# -- shards, FP8, sizes ------------------------------------------------------------------------------------
def _load_all_ranks(model_dir: Path, n: int, weight_dtype: str):
    """Every rank's shard, loaded by n threads of this process joined in a real gloo group."""
    store = open_store(n, 30)
    shards: dict[int, object] = {}

    def rank(r: int):
        from torch.distributed import TCPStore

        st = store if r == 0 else TCPStore("127.0.0.1", store.port, n, False, timeout=datetime.timedelta(seconds=30))
        comm = TpComm(st, r, n, "gloo", 30, "cpu")
        full = ModelConfig.from_dir(model_dir)
        shards[r] = load_shard(model_dir, TpShard(full, r, n), comm, dtype=torch.float32, device="cpu",
                               weight_dtype=weight_dtype)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [shards[r] for r in range(n)]


def _dense(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)


@pytest.mark.parametrize("weight_dtype", ["auto", "fp8"])
def test_rank_shards_put_together_are_the_unsharded_weights_and_half_the_bytes(tiny_model, weight_dtype):
    """Column-parallel shards stack by rows, row-parallel ones by columns, the vocabulary by rows: bitwise the
    TP=1 weights -- for FP8 too (a row-parallel shard quantizes with the whole row's scale)."""
    full = load_model(tiny_model, dtype=torch.float32, weight_dtype=weight_dtype)
    shards = _load_all_ranks(tiny_model, 2, weight_dtype)
    cfg = full.config
    for i, layer in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        q, kv = cfg.q_size // 2, cfg.kv_size // 2
        qkv = [_dense(p.qkv.weight) for p in parts]
        want = _dense(layer.qkv.weight)
        assert torch.equal(torch.cat([x[:q] for x in qkv]), want[: cfg.q_size])
        assert torch.equal(torch.cat([x[q : q + kv] for x in qkv]), want[cfg.q_size : cfg.q_size + cfg.kv_size])
        assert torch.equal(torch.cat([x[q + kv :] for x in qkv]), want[cfg.q_size + cfg.kv_size :])
        for name in ("o", "down"):
            assert torch.equal(torch.cat([_dense(getattr(p, name).weight) for p in parts], 1), _dense(getattr(layer, name).weight))
    vocab = cfg.vocab_size
    assert torch.equal(torch.cat([_dense(s.lm_head.weight) for s in shards])[:vocab], _dense(full.lm_head.weight))
    total = sum(s.weight_bytes() for s in shards)
    assert all(s.weight_bytes() < 0.6 * full.weight_bytes() for s in shards)  # ~1/2 + replicated norms
    assert total < 1.05 * full.weight_bytes()  # only the norms and the vocabulary padding are extra


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory) -> Path:
    """A tiny model whose vocabulary does not split in two: rank 1's embedding / LM head shard is padded."""
    from services.modelkit import build_tiny_random

    path = build_tiny_random(tmp_path_factory.mktemp("odd") / "llama", arch="llama", seed=1, vocab_size=509,
                             max_position_embeddings=256)
    assert ModelConfig.from_dir(path).vocab_size % 2 == 1
    return path


def test_odd_vocabulary_and_fp8_tp2_equal_tp1(odd_vocab_model):
    """FP8 weights (each rank's scales those of the unsharded weight) and an FP8 KV cache (per-block scales of
    each rank's own KV heads); a padded vocabulary shard whose padding never reaches the sampler."""
    vocab = ModelConfig.from_dir(odd_vocab_model).vocab_size
    rng = random.Random(3)
    params = SamplingParams(max_tokens=16, temperature=0)
    requests = [{"id": f"f{i}", "prompt": [rng.randrange(5, vocab) for _ in range(rng.randrange(4, 90))],
                 "params": params} for i in range(10)]
    requests.append({"id": "last-id", "prompt": [vocab - 1, vocab - 2, 5], "params": params})  # rows only rank 1 holds
    config = make_config(odd_vocab_model, weight_dtype="fp8", kv_dtype="fp8", budget=32)
    want, got, _ = run_pair(config, requests)
    assert all(t < vocab for r in requests for t in got[r["id"]])
    assert [r["id"] for r in requests if got[r["id"]] != want[r["id"]]] == []


def test_sizes_the_model_does_not_split_into_are_refused_naming_the_field(tiny_model):
    cfg = make_config(tiny_model)  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ConfigError, match="num_attention_heads"):
        tp(cfg, 3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        tp(cfg, 4)
    mcfg = dataclasses.replace(ModelConfig.from_dir(tiny_model), intermediate_size=130, num_heads=4, num_kv_heads=4)
    with pytest.raises(ConfigError, match="intermediate_size"):
        ParallelConfig(tensor_parallel_size=4).check_model(mcfg)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    ParallelConfig(tensor_parallel_size=2).check_model(ModelConfig.from_dir(tiny_model))  # 2 divides all


# -- a rank that dies --------------------------------------------------------------------------------------
def test_a_killed_rank_fails_the_engine_instead_of_hanging(tiny_model):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with engine_of(tp(make_config(tiny_model), timeout_s=20)) as engine:
        engine.add_request("r", [5, 6, 7, 8], params)
        engine.step()
        os.kill(engine.tp.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelFailure):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 20  # the watchdog or the closed connection: no collective timeout
        with pytest.raises(TensorParallelFailure):  # and it stays failed
            engine.step()


def test_a_hung_rank_fails_the_engine_after_the_collective_timeout(tiny_model):
    """A rank that stops answering (SIGSTOP: alive, its sockets open) is found by the collective timeout."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with engine_of(tp(make_config(tiny_model), timeout_s=3)) as engine:
        engine.add_request("r", [5, 6, 7, 8], params)
        engine.step()
        rank1 = engine.tp.procs[0]
        os.kill(rank1.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelFailure, match="timed out"):
            while engine.has_unfinished():
                engine.step()
        assert 3 <= time.monotonic() - t0 < 30
        rank1.join(10)
        assert not rank1.is_alive()  # the failed group's ranks are stopped


def _ranks_of(pid: int) -> list[int]:
    """The core's tensor-parallel ranks: its children started by multiprocessing's spawn (not its resource
    tracker)."""
    kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_a_killed_rank_takes_a_core_process_to_dead(tiny_model):
    """As `serve` runs it: the core's rank 1 is SIGKILLed mid-stream -> the stream fails (EngineFailed), the core
    process exits non-zero, and new requests are refused as dead (503)."""
    async def main():
        async with split_engine(tp(make_config(tiny_model))) as (client, proc):
            params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            running = client.generate("r", [5, 6, 7, 8], params)
            await anext(running)
            ranks = _ranks_of(proc.pid)
            assert len(ranks) == 1
            os.kill(ranks[0], signal.SIGKILL)
            with pytest.raises(EngineFailed):
                async for _ in running:
                    pass
            proc.join(20)
            assert proc.exitcode not in (None, 0) and not client.alive
            with pytest.raises(EngineUnavailable) as late:
                await collect(client, "late", [5, 6], params)
            assert late.value.status == 503

    asyncio.run(asyncio.wait_for(main(), 120))


def test_tensor_parallelism_with_speculation_or_async_scheduling_is_refused(tiny_model):
    """The step broadcast carries neither draft tokens nor async placeholder fills: the pairs are refused at
    configuration, never run wrong."""
    cfg = tp(make_config(tiny_model), 2)
    with pytest.raises(ConfigError, match="speculative decoding or async_scheduling"):
        dataclasses.replace(cfg, speculative=SpeculativeConfig(method="ngram"))
    with pytest.raises(ConfigError, match="speculative decoding or async_scheduling"):
        dataclasses.replace(cfg, async_scheduling=True)
    with pytest.raises(ConfigError, match="async_scheduling cannot be combined with speculative decoding"):
        dataclasses.replace(make_config(tiny_model), async_scheduling=True, speculative=SpeculativeConfig(method="ngram"))
