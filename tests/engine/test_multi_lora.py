"""Multi-LoRA serving: engine == PEFT mixed-adapter generate (fp32) with many adapters in one batch,
prefix-cache isolation between adapters, refusal of malformed adapters, loads off the step loop."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import fsspec
import fsspec.implementations.local
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.lora_format import content_id
from services.common.prompting import PromptBuilder
from services.engine.config import EngineConfig
from services.engine.sequence import AdapterRef, InvalidRequest, SamplingParams
from tests.engine.conftest import make_config, make_engine, record_swaps, run_all, run_all_split, spec_tokens
from tests.engine.oracle import TieLog, hf_greedy

MAX_NEW = 24
# KV blocks beyond the longest request's, for the tiny-pool runs. These runs read adapters on the step thread
# (`inline_loads`): with the loader thread, which step finds an adapter resident follows the machine's load, and
# so did the preemptions and accepted drafts (measured beside two busy loops: `auto` accepted 0 in one run of
# three). With it the runs are the same on any machine, and on the pinned kit +20 gives 3 preemptions, 96
# prefix-hit tokens and 2 accepted drafts (+10..12: no accepted draft, speculation being off while requests
# wait; +30: one preemption, and with the loader thread none).
SLACK = 20
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANDOM_SPECS = [  # (rank, targets, alpha, rslora, rank_pattern)
    (4, ["q_proj", "v_proj"], 8, False, None),
    (8, ALL, 16, False, None),
    (16, ["gate_proj", "up_proj", "down_proj"], 16, True, None),
    (32, ["o_proj", "down_proj"], 32, False, None),
    (64, ["k_proj", "v_proj"], 32, False, None),
    (2, ["q_proj"], 4, False, None),
    (8, ["up_proj", "down_proj"], 8, False, {"model.layers.0.mlp.down_proj": 12}),
    (12, ALL, 24, True, None),
    (6, ["q_proj", "k_proj", "o_proj"], 6, False, None),
    (24, ["gate_proj"], 12, False, None),
    (1, ALL, 2, False, None),
    (48, ["v_proj", "o_proj", "up_proj"], 96, False, None),
    (16, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, False, {"k_proj": 4}),
]


@pytest.fixture(scope="module")
def adapters(demo_kit, tmp_path_factory) -> dict[str, Path]:
    from services.modelkit import make_random_adapter

    out = {name: a.path for name, a in demo_kit.adapters.items()}
    root = tmp_path_factory.mktemp("adapters")
    for i, (r, targets, alpha, rs, rp) in enumerate(RANDOM_SPECS):
        out[f"rand{i}"] = make_random_adapter(
            demo_kit.base_dir, root / f"rand{i}", rank=r, target_modules=targets, lora_alpha=alpha, seed=100 + i,
            use_rslora=rs, rank_pattern=rp,
        )
    assert len(out) >= 16
    return out


@pytest.fixture(scope="module")
def refs_of(adapters) -> dict[str, AdapterRef]:
    return {name: AdapterRef(content_id(p), name, str(p)) for name, p in adapters.items()}


@pytest.fixture(scope="module")
def peft_model(demo_kit, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    base = AutoModelForCausalLM.from_pretrained(demo_kit.base_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@pytest.fixture(scope="module")
def workload(demo_kit, adapters):
    """Requests spread over every adapter plus base rows; some share a system prompt (prefix hits)."""
    builder = PromptBuilder(demo_kit.base_dir)
    names = list(adapters)
    own = {n: [json.loads(x)["prompt"] for x in a.eval_path.read_text().splitlines()[:3]]
           for n, a in demo_kit.adapters.items()}
    questions = [q for qs in own.values() for q in qs]
    shared = "Follow the instruction exactly. " * 5
    work = []
    k = 0  # adapter rows so far: every adapter gets one before any gets a second
    for i in range(26):
        adapter = None
        if i % 6 != 5:
            adapter, k = names[k % len(names)], k + 1
        # a demo adapter on its own task (its real answers: `extract` copies, so prompt lookup drafts right)
        q = own[adapter][i % 3] if adapter in own else questions[i % len(questions)]
        messages = [{"role": "user", "content": q}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": shared})
        work.append((adapter, builder.chat_ids(messages)))
    # The same shared-prefix prompt under one adapter twice and under a second adapter: hits only the first.
    work.append((names[0], work[0][1]))
    return work


@pytest.fixture(scope="module")
def peft_refs(peft_model, workload):
    return [hf_greedy(peft_model, prompt, MAX_NEW, adapter=adapter) for adapter, prompt in workload]


def _requests(workload, refs_of, prefix="r"):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    return [{"id": f"{prefix}{i}", "prompt": p, "params": params, "adapter": refs_of[a] if a else None}
            for i, (a, p) in enumerate(workload)]


def _check(name, engine, workload, refs_of, peft_refs, counters=None):
    """`engine`: an LLMEngine, or an EngineConfig served as `serve` does (a core process and a front-end)."""
    requests = _requests(workload, refs_of)
    out = run_all(engine, requests) if not isinstance(engine, EngineConfig) else run_all_split(engine, requests, counters)
    log = TieLog(name)
    for i, ref in enumerate(peft_refs):
        log.check(f"r{i}:{workload[i][0]}", out[f"r{i}"], ref)
    log.write()


# Both CPU paths: the native C kernel (the default wherever it builds) and the batched-torch fallback.
KERNELS = pytest.mark.parametrize("kernel", ["native", "torch"])


@KERNELS
def test_sixteen_plus_adapters_in_one_batch_match_peft(demo_kit, workload, refs_of, peft_refs, kernel):
    distinct = {a for a, _ in workload if a}
    engine = make_engine(demo_kit.base_dir, max_loras=len(distinct), max_cpu_loras=len(distinct), lora_kernel=kernel)
    assert engine.adapters.cpu_kernel == kernel
    _check(f"lora-batch-{kernel}", engine, workload, refs_of, peft_refs)
    assert len(distinct) >= 16


def test_split_path_more_adapters_than_slots_match_peft(demo_kit, workload, refs_of, peft_refs):
    """The same, with the adapters named by path in each request, through a core process."""
    need = max(len(p) + MAX_NEW for _, p in workload)
    core = {}
    _check("lora-split", make_config(demo_kit.base_dir, max_loras=4, max_cpu_loras=6, block_size=4, budget=24,
                         inline_loads=True, num_blocks=need // 4 + SLACK, preemption_mode="recompute"),
           workload, refs_of, peft_refs, counters=core)
    assert core["preemptions"] > 0


@KERNELS
def test_more_adapters_than_slots_with_chunking_prefix_hits_and_preemption(demo_kit, workload, refs_of, peft_refs, kernel):
    need = max(len(p) + MAX_NEW for _, p in workload)
    engine = make_engine(demo_kit.base_dir, max_loras=4, max_cpu_loras=6, block_size=4, budget=24,
                         inline_loads=True, num_blocks=need // 4 + SLACK, lora_kernel=kernel,
                         preemption_mode="recompute")
    assert engine.adapters.cpu_kernel == kernel
    _check(f"lora-stress-{kernel}", engine, workload, refs_of, peft_refs)
    assert engine.scheduler.num_preemptions > 0
    assert engine.adapters.slot_loads > len({a for a, _ in workload if a})  # evicted and reloaded
    assert engine.metrics.prefix_hit_tokens._value.get() > 0


def test_swapped_out_adapter_sequences_come_back_identical(demo_kit, workload, refs_of, peft_refs):
    """The stress run again with preempted sequences swapped to the host tier: a swapped-in sequence
    gets its adapter slot back (maybe another one) and continues; prefix hits and chunking as above."""
    need = max(len(p) + MAX_NEW for _, p in workload)
    engine = make_engine(demo_kit.base_dir, max_loras=4, max_cpu_loras=6, block_size=4, budget=24,
                         inline_loads=True, num_blocks=need // 4 + SLACK, preemption_mode="swap")
    # Swapped sequences come back by restore, not by a prefix hit, and the workload's one repeated
    # (prompt, adapter) pair forks: a warm-up under that adapter makes the prefix hits deliberate.
    adapter, prompt = workload[0]
    run_all(engine, [{"id": "warm", "prompt": prompt, "params": SamplingParams(max_tokens=2, temperature=0),
                      "adapter": refs_of[adapter]}])
    swaps = record_swaps(engine)
    _check("lora-swap", engine, workload, refs_of, peft_refs)
    by_id = {f"r{i}": a for i, (a, _) in enumerate(workload)}
    assert any(by_id[rid] for rid, _, _ in swaps)  # adapter sequences among the swapped
    assert engine.metrics.swap_in_blocks._value.get() > 0 and engine.kv.host.num_used == 0
    assert engine.metrics.prefix_hit_tokens._value.get() > 0


def test_prefix_cache_is_partitioned_by_adapter_content(demo_kit, adapters, refs_of, tmp_path):
    builder = PromptBuilder(demo_kit.base_dir)
    prompt = builder.chat_ids([{"role": "system", "content": "Shared context. " * 12}, {"role": "user", "content": "Hello"}])
    names = list(adapters)
    engine = make_engine(demo_kit.base_dir, block_size=8)
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(rid, ref):
        seq = engine.add_request(rid, prompt, params, adapter=ref)
        run_all(engine, [])
        return seq.num_cached_tokens

    assert cached("a1", refs_of[names[0]]) == 0
    assert cached("a2", refs_of[names[0]]) > 0  # same adapter: hits
    assert cached("b1", refs_of[names[1]]) == 0  # another adapter: nothing shared
    assert cached("base", None) == 0
    # A new version under the same name: different weights => different content id => no hits.
    v2 = tmp_path / "v2"
    shutil.copytree(adapters[names[0]], v2)
    tensors = load_file(v2 / "adapter_model.safetensors")
    first = next(iter(tensors))
    tensors[first] = tensors[first] * 1.01
    save_file(tensors, v2 / "adapter_model.safetensors")
    new_ref = AdapterRef(content_id(v2), names[0], str(v2))
    assert new_ref.content_id != refs_of[names[0]].content_id
    assert cached("v2", new_ref) == 0


def _corrupt(kind: str, src: Path, dst: Path, demo_kit) -> Path:
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    cfg = json.loads((dst / "adapter_config.json").read_text())
    if kind == "wrong_shapes":
        t = load_file(weights)
        save_file({k: torch.zeros(v.shape[0] + 3, v.shape[1]) if "lora_B" in k else v for k, v in t.items()}, weights)
    elif kind == "rank_over_max":
        cfg["r"] = 128
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    elif kind == "missing_file":
        weights.unlink()
    elif kind == "nan_weights":
        t = load_file(weights)
        k = next(iter(t))
        t[k][0, 0] = float("nan")
        save_file(t, weights)
    elif kind == "pickle":
        t = load_file(weights)
        weights.unlink()
        torch.save(t, dst / "adapter_model.bin")
    elif kind == "dora":
        cfg["use_dora"] = True
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind,code", [
    ("wrong_shapes", "shape_mismatch"), ("rank_over_max", "rank_over_max"), ("missing_file", "missing_file"),
    ("nan_weights", "nan_weights"), ("pickle", "pickle_file"), ("dora", "dora_unsupported"),
])
def test_malformed_adapter_is_refused_with_its_code_and_others_keep_decoding(demo_kit, adapters, refs_of, tmp_path, kind, code):
    bad_dir = _corrupt(kind, adapters["rand1"], tmp_path / kind, demo_kit)
    cid = "0" * 63 + "1" if kind in ("missing_file", "pickle", "dora") else content_id(bad_dir)
    engine = make_engine(demo_kit.base_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    good = engine.add_request("good", [5, 6, 7, 8], params, adapter=refs_of["rand0"])
    engine.add_request("bad", [5, 6, 7, 8], params, adapter=AdapterRef(cid, "bad", str(bad_dir)))
    errors = []
    while engine.has_unfinished():
        errors += [o.error for o in engine.step() if o.error is not None]
        engine.check_integrity()
        if engine.last_plan_empty:
            engine.wake.wait(0.05)
            engine.wake.clear()
    assert [e.code for e in errors] == [code] and errors[0].param == "model"
    assert good.finish_reason == "length" and good.num_output_tokens == 6
    with pytest.raises(InvalidRequest) as again:  # a known-bad adapter is refused at once next time
        engine.add_request("bad2", [5, 6], params, adapter=AdapterRef(cid, "bad", str(bad_dir)))
    assert again.value.code == code


class _GatedFS(fsspec.implementations.local.LocalFileSystem):
    """A storage backend whose reads wait for a gate, to hold an adapter load open."""

    gate = threading.Event()
    protocol = "gated"

    def get(self, rpath, lpath, **kw):
        assert self.gate.wait(30)
        return super().get(rpath.removeprefix("gated://"), lpath, **kw)


def test_loading_happens_off_the_step_loop(demo_kit, adapters, tmp_path):
    fsspec.register_implementation("gated", _GatedFS, clobber=True)
    _GatedFS.gate.clear()
    path = adapters["rand2"]
    ref = AdapterRef(content_id(path), "rand2", f"gated://{path}")
    engine = make_engine(demo_kit.base_dir)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    slow = engine.add_request("slow", [5, 6, 7], params, adapter=ref)
    base = engine.add_request("base", [5, 6, 7], params)
    while not base.is_finished:  # the base request streams to completion while the load is blocked
        engine.step()
    assert slow.num_output_tokens == 0 and engine.adapters.is_loading(ref.content_id)
    _GatedFS.gate.set()
    run_all(engine, [])
    assert slow.num_output_tokens == 8


def test_inline_loads_make_the_first_step_find_the_adapter_resident(demo_kit, adapters, refs_of):
    """`inline_loads` (the stress tests above): a local adapter is read on the step thread, so the request
    that needs it computes in the very step it is scheduled, whatever the machine's load; a remote one
    still loads on the fetcher threads."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = make_engine(demo_kit.base_dir, inline_loads=True)
    seq = engine.add_request("x", [5, 6, 7], params, adapter=refs_of["rand3"])
    engine.step()
    assert seq.num_computed_tokens == 3 and seq.num_output_tokens == 1 and engine.adapters.slot_loads == 1
    fsspec.register_implementation("gated", _GatedFS, clobber=True)
    _GatedFS.gate.clear()
    path = adapters["rand2"]
    remote = engine.add_request("remote", [5, 6, 7], params, adapter=AdapterRef(content_id(path), "rand2",
                                                                                f"gated://{path}"))
    engine.step()
    assert remote.num_output_tokens == 0 and engine.adapters.is_loading(content_id(path))
    _GatedFS.gate.set()
    run_all(engine, [])
    assert remote.num_output_tokens == 4 and seq.num_output_tokens == 4


def test_more_distinct_adapters_queued_than_the_host_tier_holds_load_about_once_each(tiny_model, tmp_path):
    """12 adapters queued at once, 2 device slots, a host tier of 4: each adapter is read from storage
    once (a queue that asked for all of them at once evicted each load before it got a slot)."""
    from services.modelkit import make_random_adapter

    refs = []
    for i in range(12):
        path = make_random_adapter(tiny_model, tmp_path / f"a{i}", rank=2 + i % 3, seed=i)
        refs.append(AdapterRef(content_id(path), f"a{i}", str(path)))
    engine = make_engine(tiny_model, max_loras=2, max_cpu_loras=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    reads = []
    read = engine.adapters._read
    engine.adapters._read = lambda ref: (reads.append(ref.content_id), read(ref))[1]
    # Each adapter's two requests are adjacent in the queue, so no policy needs an adapter twice.
    out = run_all(engine, [{"id": f"r{i}", "prompt": [3, 4, 5 + i], "params": params, "adapter": refs[i // 2]}
                           for i in range(24)])
    assert all(len(toks) == 4 for toks in out.values())
    assert sorted(reads) == sorted(r.content_id for r in refs), f"{len(reads)} reads for 12 adapters"


def test_a_request_starved_of_a_slot_gets_one_while_the_other_slots_keep_batching(tiny_model, tmp_path):
    """Two hot adapters whose requests never stop keep both device slots pinned; a cold adapter's request
    waits lora_starvation_steps, then one slot is drained for it (no new sequences join that slot) and it
    runs -- while the other hot adapter keeps admitting new requests the whole time (the batch never
    stalls behind the starving request)."""
    from services.modelkit import make_random_adapter

    refs = {}
    for i, name in enumerate(("hot1", "hot2", "cold")):
        path = make_random_adapter(tiny_model, tmp_path / name, rank=2, seed=i)
        refs[name] = AdapterRef(content_id(path), name, str(path))
    engine = make_engine(tiny_model, max_loras=2, max_cpu_loras=4)
    for ref in refs.values():
        engine.adapters.load_sync(ref)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    patience = engine.scheduler.config.lora_starvation_steps
    n = 0

    def add(name):
        nonlocal n
        n += 1
        engine.add_request(f"{name}-{n}", [3, 4, 5 + n % 7], params, adapter=refs[name])

    done: set[str] = set()
    cold_added = cold_admitted = None
    hot_admitted_while_draining: dict[str, int] = {"hot1": 0, "hot2": 0}
    drained = None
    for step in range(400):
        add("hot1"), add("hot2")  # both hot slots always have newer requests waiting
        if step == 3:
            engine.add_request("cold", [3, 4, 5], params, adapter=refs["cold"])
            cold_added = step
        running_before = {s.request_id for s in engine.scheduler.running}
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done.add(out.request_id)
        draining = engine.scheduler.draining_slot
        if draining is not None:
            drained = draining
        admitted = [s for s in engine.scheduler.running if s.request_id not in running_before]
        for s in admitted:
            if s.request_id == "cold":
                cold_admitted = step
            elif draining is not None:
                hot_admitted_while_draining[s.adapter.name] += 1
                assert s.lora_slot != draining, "a sequence joined the slot being drained"
        if "cold" in done:
            break
    assert "cold" in done, "the cold adapter's request never got a slot"
    # It waited its patience, then at most the drained slot's remaining work (max_tokens) plus a step.
    assert patience <= cold_admitted - cold_added <= patience + params.max_tokens + 2, (cold_added, cold_admitted)
    assert drained is not None
    # The hot adapter whose slot was not drained kept taking new requests during the drain.
    assert max(hot_admitted_while_draining.values()) > 0, hot_admitted_while_draining
    # Once drained and handed over, no slot stays closed: both hot adapters keep being admitted.
    admitted_after: dict[str, int] = {"hot1": 0, "hot2": 0}
    window = 2 * (patience + params.max_tokens)
    for step in range(2 * window):
        add("hot1"), add("hot2")
        running_before = {s.request_id for s in engine.scheduler.running}
        engine.step()
        for s in engine.scheduler.running:
            if s.request_id not in running_before and step >= window:
                admitted_after[s.adapter.name] += 1
    assert min(admitted_after.values()) > 0, admitted_after
    engine.check_integrity()


def test_async_scheduling_more_adapters_than_slots_with_preemption(demo_kit, workload, refs_of, peft_refs):
    """Async scheduling (overlap.py): adapter slots acquired and loaded while the previous forward runs."""
    need = max(len(p) + MAX_NEW for _, p in workload)
    engine = make_engine(demo_kit.base_dir, max_loras=4, max_cpu_loras=6, block_size=4, budget=24,
                         inline_loads=True, num_blocks=need // 4 + SLACK, preemption_mode="recompute",
                         async_scheduling=True)
    _check("lora-async", engine, workload, refs_of, peft_refs)
    assert engine.scheduler.num_preemptions > 0
    assert engine.adapters.slot_loads > len({a for a, _ in workload if a})


@pytest.mark.parametrize("drafter", ["ngram", "auto"])
def test_speculative_decoding_with_many_adapters_matches_peft(demo_kit, workload, refs_of, peft_refs, drafter):
    """Drafts verified under each row's adapter (its SGMV segment covers the draft rows), with chunked
    prefill, prefix hits and preemption, more adapters than slots: PEFT's tokens. `auto`: base rows draft
    with the kit's draft model, adapter rows with prompt lookup, in the same steps."""
    need = max(len(p) + MAX_NEW for _, p in workload)
    engine = make_engine(demo_kit.base_dir, max_loras=4, max_cpu_loras=6, block_size=4, budget=24,
                         inline_loads=True, num_blocks=need // 4 + SLACK, preemption_mode="recompute",
                         speculative=drafter, draft_model=demo_kit.draft_dir)
    _check(f"lora-spec-{drafter}", engine, workload, refs_of, peft_refs)
    assert spec_tokens(engine, "accepted") > 0
    assert engine.scheduler.num_preemptions > 0
