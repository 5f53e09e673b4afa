"""The native CPU SGMV kernel and its slot table against the per-token oracle; its refusals; its fallback."""
import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.config import ConfigError, LoraConfig, ModelConfig
from services.engine.kernels import build_sgmv_meta, sgmv_native
from services.engine.lora.native_slots import NativeSlotTable
from tests.engine.kernels.lora_oracle import (
    DIMS,
    GROUPS,
    LAYERS,
    adapter_spec,
    group_input,
    make_adapter,
    oracle,
    slices,
)


@pytest.fixture(scope="module")
def kernel():
    return sgmv_native.load()


def table(kernel, max_slots: int, long_work: int = 1536) -> NativeSlotTable:
    return NativeSlotTable(LAYERS, slices(), max_slots=max_slots, kernel=kernel, long_work=long_work)


def check_all(tb: NativeSlotTable, token_slots: torch.Tensor, owners, seed=0):
    plan = tb.plan(build_sgmv_meta(token_slots))
    for layer in range(LAYERS):
        for group in GROUPS:
            x, y = group_input(group, len(token_slots), seed + layer)
            want = oracle(x, y, layer, group, token_slots, owners)
            tb.apply(layer, group, x, y, plan)
            torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4, msg=f"layer {layer} group {group}")
    return plan


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(adapter_spec, min_size=1, max_size=6),
    counts=st.lists(st.integers(0, 9), min_size=7, max_size=7),  # rows per slot; index 6 = base rows (slot -1)
    long_work=st.integers(1, 64),  # rows x rank above it: the MKL path
    shuffle=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_native_apply_matches_the_per_token_oracle(kernel, specs, counts, long_work, shuffle, seed):
    tb = table(kernel, max_slots=len(specs) + 1, long_work=long_work)
    owners = {}
    for slot, (targets, rank, vary) in enumerate(specs):
        ranks = {(layer, m): max(1, rank - (layer if vary else 0)) for layer in range(LAYERS) for m in targets}
        owners[slot] = make_adapter(seed + slot, targets, ranks)
        tb.install(slot, owners[slot])
        tb.activate(slot)
    slots = [s for s in range(len(specs)) for _ in range(counts[s])] + [-1] * counts[6]
    if shuffle:
        random.Random(seed).shuffle(slots)
    if not slots:
        slots = [-1]
    check_all(tb, torch.tensor(slots), owners, seed)
    tb.check_integrity()


def test_long_and_short_segments_and_holes_in_one_step(kernel):
    tb = table(kernel, max_slots=4, long_work=18)  # slot 0: 5-6 rows x rank 4 > 18 (MKL); slot 2: 2 x 8 (C)
    owners = {0: make_adapter(1, ["q_proj", "v_proj", "down_proj"], {(l, m): 4 for l in range(LAYERS) for m in DIMS}),
              2: make_adapter(2, list(DIMS), {(l, m): 8 for l in range(LAYERS) for m in DIMS})}
    for slot, w in owners.items():
        tb.install(slot, w)
    # slot 0: a long contiguous run and, shuffled, long non-contiguous rows; slot 2 short; base rows between.
    for slots in ([0] * 6 + [-1, -1] + [2, 2], [0, -1, 0, 2, 0, -1, 0, 0, 2]):
        plan = check_all(tb, torch.tensor(slots), owners)
        assert plan.long and plan.short.shape[0] == 1
    assert plan.long[0][3] is not None  # the shuffled step's long segment names its rows explicitly


def test_threads_split_segments_without_changing_a_bit(kernel):
    tb = table(kernel, max_slots=8)
    owners = {s: make_adapter(10 + s, list(DIMS), {(l, m): 1 + s for l in range(LAYERS) for m in DIMS}) for s in range(8)}
    for s, w in owners.items():
        tb.install(s, w)
    slots = torch.tensor([s % 8 for s in range(40)])
    plan = tb.plan(build_sgmv_meta(slots))
    x, y = group_input("gate_up", 40, 0)
    outs = []
    for threads in (1, 2):
        out = y.clone()
        kernel.group(x, out, plan.pos, plan.short, tb.table, 1, tb.parts["gate_up"], num_threads=threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], oracle(x, y, 1, "gate_up", slots, owners), atol=1e-4, rtol=1e-4)


def test_reinstall_and_evict_leave_no_stale_weights(kernel):
    tb = table(kernel, max_slots=2)
    a = make_adapter(1, list(DIMS), {(l, m): 4 for l in range(LAYERS) for m in DIMS})
    b = make_adapter(2, ["o_proj"], {(l, "o_proj"): 2 for l in range(LAYERS)})
    tb.install(0, a)
    check_all(tb, torch.tensor([0, 0, -1]), {0: a})
    tb.install(0, b)  # replaces a: groups b does not target must add nothing
    check_all(tb, torch.tensor([0, 0, -1]), {0: b})
    assert tb.nbytes == sum(x.numel() * 4 for pair in b.tensors.values() for x in pair)
    tb.check_integrity()
    tb.evict(0)
    assert not tb.table.any() and tb.nbytes == 0
    x, y = group_input("o", 3, 5)
    want = y.clone()
    tb.apply(0, "o", x, y, tb.plan(build_sgmv_meta(torch.tensor([0, 0, -1]))))
    assert torch.equal(y, want)  # an evicted slot's rows get no delta (its table rows are 0)
    tb.check_integrity()


def test_output_may_be_a_column_window_of_a_wider_tensor(kernel):
    tb = table(kernel, max_slots=1)
    w = make_adapter(3, ["q_proj", "k_proj", "v_proj"], {(l, m): 5 for l in range(LAYERS) for m in DIMS})
    tb.install(0, w)
    slots = torch.tensor([0, -1, 0])
    x_wide = torch.randn(3, 40)
    x = x_wide[:, 4:20]  # row stride 40, as a slice of a fused activation would be
    full = torch.randn(3, 50)
    y = full[:, 10:42]  # the qkv group's 32 columns inside a wider row
    before = full.clone()
    want = oracle(x, y, 0, "qkv", slots, {0: w})
    tb.apply(0, "qkv", x, y, tb.plan(build_sgmv_meta(slots)))
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(full[:, :10], before[:, :10]) and torch.equal(full[:, 42:], before[:, 42:])


def test_the_kernel_refuses_operands_it_would_index_out_of_bounds(kernel):
    tb = table(kernel, max_slots=2)
    tb.install(0, make_adapter(1, list(DIMS), {(l, m): 4 for l in range(LAYERS) for m in DIMS}))
    x, y = group_input("qkv", 4, 0)
    parts = tb.parts["qkv"]
    segs = torch.tensor([[0, 4, 0]])

    def call(**kw):
        args = {"x": x, "y": y.clone(), "pos": None, "segs": segs, "table": tb.table, "layer": 0, "parts": parts}
        args.update(kw)
        kernel.group(args.pop("x"), args.pop("y"), args.pop("pos"), args.pop("segs"), args.pop("table"),
                     args.pop("layer"), args.pop("parts"), num_threads=2, check=False)

    with pytest.raises(ValueError, match="slot is outside"):
        call(segs=torch.tensor([[0, 4, 7]]))
    with pytest.raises(ValueError, match="start/end are outside"):
        call(segs=torch.tensor([[0, 9, 0]]))
    with pytest.raises(ValueError, match="row index is outside"):
        call(pos=torch.tensor([0, 1, 2, 99]))
    with pytest.raises(ValueError, match="output columns"):
        call(parts=torch.tensor([[0, 30, 16]]))
    with pytest.raises(ValueError, match="layer"):
        call(layer=LAYERS)
    bad = tb.table.clone()
    bad[0, 0, 0, 2] = 600
    with pytest.raises(ValueError, match="rank is outside"):
        call(table=bad)
    bad = tb.table.clone()
    bad[0, 0, 0, 0] = 0
    with pytest.raises(ValueError, match="null weight pointer"):
        call(table=bad)
    # The Python-side checks: dtype, layout, row counts.
    with pytest.raises(ValueError, match="fp32"):
        kernel.group(x.double(), y, None, segs, tb.table, 0, parts, num_threads=1)
    with pytest.raises(ValueError, match="unit column stride"):
        kernel.group(x, y.t().contiguous().t(), None, segs, tb.table, 0, parts, num_threads=1)
    with pytest.raises(ValueError, match="rows"):
        kernel.group(x, y[:3], None, segs, tb.table, 0, parts, num_threads=1, check=False)
    out = y.clone()
    call(y=out)  # and the well-formed call still works after all the refusals
    assert not torch.equal(out, y)


def test_without_a_compiler_auto_falls_back_to_torch_and_native_refuses(tiny_model, tmp_path, monkeypatch, caplog):
    from services.engine.lora.manager import AdapterManager

    model = ModelConfig.from_dir(tiny_model)
    monkeypatch.setenv("MPLEX_HOME", str(tmp_path))  # no cached library there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    sgmv_native.load.cache_clear()
    try:
        with pytest.raises(sgmv_native.NativeKernelUnavailable, match="no-such-cc"):
            sgmv_native.load()
        with caplog.at_level(logging.WARNING, logger="mplex.engine.lora"):
            m = AdapterManager(model, LoraConfig(max_loras=2, max_cpu_loras=2), dtype=torch.float32, device="cpu")
        assert m.cpu_kernel == "torch" and "using the torch path" in caplog.text
        m.shutdown()
        with pytest.raises(ConfigError, match="cpu_kernel=native"):
            AdapterManager(model, LoraConfig(max_loras=2, max_cpu_loras=2, cpu_kernel="native"), dtype=torch.float32, device="cpu")
    finally:
        sgmv_native.load.cache_clear()
    monkeypatch.undo()
    m = AdapterManager(model, LoraConfig(max_loras=2, max_cpu_loras=2), dtype=torch.float32, device="cpu")
    assert m.cpu_kernel == "native"
    m.shutdown()
    with pytest.raises(ConfigError, match="fp32 only"):
        AdapterManager(model, LoraConfig(max_loras=2, max_cpu_loras=2, cpu_kernel="native"), dtype=torch.bfloat16, device="cpu")


def test_a_broken_compile_names_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLEX_HOME", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("int mplex_sgmv_abi_version(void) { return 1 }\n")  # missing ';'
    monkeypatch.setattr(sgmv_native, "SOURCE", bad)
    sgmv_native.load.cache_clear()
    try:
        with pytest.raises(sgmv_native.NativeKernelUnavailable, match="error"):
            sgmv_native.load()
        assert not list((tmp_path / "build" / "native").glob("*.so"))  # no half-written library left behind
    finally:
        sgmv_native.load.cache_clear()


def _runs(slots: list[int]) -> tuple[tuple[int, int, int], ...]:
    runs: list[list[int]] = []
    for row, s in enumerate(slots):
        if runs and runs[-1][0] == s:
            runs[-1][2] = row + 1
        else:
            runs.append([s, row, row + 1])
    return tuple(map(tuple, runs))


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    counts=st.lists(st.integers(0, 9), min_size=7, max_size=7),
    long_work=st.integers(1, 64),
    seed=st.integers(0, 10_000),
)
def test_planning_from_the_schedulers_slot_runs_equals_planning_from_the_token_map(kernel, ranks, counts, long_work, seed):
    """The step loop plans a slot-sorted batch from its runs (no sort of the token->slot map): the same
    segments, the same long/short split, the same bits out."""
    tb = table(kernel, max_slots=len(ranks), long_work=long_work)
    for slot, r in enumerate(ranks):
        tb.install(slot, make_adapter(seed + slot, list(DIMS), {(l, m): r for l in range(LAYERS) for m in DIMS}))
    slots = [-1] * counts[6] + [s for s in range(len(ranks)) for _ in range(counts[s])] or [-1]
    want = tb.plan(build_sgmv_meta(torch.tensor(slots)))
    got = tb.plan_runs(_runs(slots))
    assert got.pos is None and want.pos is None
    assert torch.equal(got.short, want.short) and got.long == want.long
    for layer in range(LAYERS):
        for group in GROUPS:
            x, y = group_input(group, len(slots), seed + layer)
            y2 = y.clone()
            tb.apply(layer, group, x, y, want)
            tb.apply(layer, group, x, y2, got)
            assert torch.equal(y, y2)


def test_slot_runs_of_a_schedule_and_a_recurring_slot():
    from types import SimpleNamespace

    from services.engine.model_runner import _slot_runs

    def sched(*pairs):
        return [SimpleNamespace(lora_slot=s, num_new_tokens=n) for s, n in pairs]

    assert _slot_runs(sched((-1, 3), (0, 1), (0, 5), (4, 1))) == ((-1, 0, 3), (0, 3, 9), (4, 9, 10))
    assert _slot_runs(sched((2, 1), (0, 1), (2, 1))) is None  # not grouped: the token map is sorted instead


def test_pack_from_the_file_arrays_is_the_pack_of_the_loaded_tensors(kernel, tiny_model, tmp_path):
    """The loader packs straight from the file's arrays (A copied, B scaled and transposed in one numpy op);
    that must be bit-identical to packing the per-module tensors load_lora gives, with the same views."""
    from services.engine.lora.weights import load_lora, read_lora
    from services.modelkit import make_random_adapter

    model = ModelConfig.from_dir(tiny_model)
    path = make_random_adapter(tiny_model, tmp_path / "a", rank=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                               lora_alpha=7, seed=3)
    tb = NativeSlotTable(model.num_layers, _model_slices(model), max_slots=2, kernel=kernel)
    fast = tb.pack(read_lora(path, model, max_rank=64))
    ref = load_lora(path, model, max_rank=64, dtype=torch.float32)
    slow = tb.pack(ref)
    assert torch.equal(fast.slot_layout.buffer, slow.slot_layout.buffer)
    assert torch.equal(fast.slot_layout.table_rows[..., 2], slow.slot_layout.table_rows[..., 2])
    assert set(fast.tensors) == set(ref.tensors) and len(fast.tensors) == len(ref.tensors)
    for key, (a, b) in ref.tensors.items():
        fa, fb = fast.tensors[key]
        assert torch.equal(fa, a) and torch.equal(fb, b)
        assert fa.data_ptr() >= fast.slot_layout.buffer.data_ptr()  # views into the slot buffer, not copies
    assert fast.nbytes == ref.nbytes and fast.target_modules == ref.target_modules
    tb.install(0, fast)
    tb.check_integrity()


def _model_slices(model):
    from services.engine.lora.manager import group_slices

    return group_slices(model.base_dims().module_dims())


@pytest.mark.parametrize("poison", ["nan_a", "inf_b", "overflow_by_scale"])
def test_pack_refuses_non_finite_weights_naming_the_module(kernel, tiny_model, tmp_path, poison):
    from safetensors.torch import load_file, save_file

    from services.common.lora_format import WEIGHTS_FILE, AdapterFormatError
    from services.engine.lora.weights import read_lora
    from services.modelkit import make_random_adapter

    model = ModelConfig.from_dir(tiny_model)
    path = make_random_adapter(tiny_model, tmp_path / "a", rank=2, target_modules=["k_proj", "o_proj"], lora_alpha=8, seed=5)
    tensors = load_file(str(path / WEIGHTS_FILE))
    which = "lora_A" if poison == "nan_a" else "lora_B"
    name = next(n for n in sorted(tensors) if "layers.1." in n and f"o_proj.{which}" in n)
    tensors[name][0, 0] = {"nan_a": float("nan"), "inf_b": float("inf"), "overflow_by_scale": 3e38}[poison]
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    tb = NativeSlotTable(model.num_layers, _model_slices(model), max_slots=1, kernel=kernel)
    with pytest.raises(AdapterFormatError, match="layer 1 o_proj has NaN or Inf") as info:
        tb.pack(read_lora(path, model, max_rank=64))  # alpha 8 / r 2: a scale of 4 takes 3e38 past fp32
    assert info.value.code == "nan_weights"
