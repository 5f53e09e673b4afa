"""Projections prepacked for the CPU's oneDNN GEMM (model/layers.py, Linear.pack): the same products as
torch's F.linear to fp32 rounding, calls of few rows left to F.linear, packing decided by measuring both paths
on this machine, and the engine's greedy outputs the oracle's on both paths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels.fp8 import quantize_fp8
from services.engine.model.layers import PACK_MIN_GAIN, PACK_TRIAL_ROWS, Linear, can_pack, packed_gains, packed_min_rows
from services.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine, run_all
from tests.engine.oracle import hf_greedy

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1, 1)), reason="torch without oneDNN linear ops here")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 256])
def test_a_packed_projection_is_f_linear_to_fp32_rounding(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 96, generator=gen)
    b = torch.randn(384, generator=gen) if bias else None
    x = torch.randn(rows, 96, generator=gen)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    lin = Linear(w.clone(), b)
    assert lin.pack(1) and not lin.pack(1)  # once
    assert lin.packed_min_rows == 1  # every call below with rows takes the packed weight
    assert lin.weight_bytes() == 2 * w.numel() * 4 + (384 * 4 if bias else 0)  # dense and packed
    got = lin(x)
    assert got.shape == (rows, 384) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    # A strided input (a slice of a wider row, as a fused projection's output is read) gives the same rows.
    wide = torch.randn(rows, 200, generator=gen)
    torch.testing.assert_close(lin(wide[:, 50:146]).double(), F.linear(wide[:, 50:146].double(), w.double(),
                               None if b is None else b.double()), atol=2e-5, rtol=1e-5)


def test_few_rows_take_f_linear_and_enough_take_the_packed_weight():
    """Which path a call takes, by its rows: told apart by a packed weight deliberately not the dense one's."""
    w = torch.randn(256, 256)
    lin = Linear(w)
    assert lin.pack(12) and lin.packed_min_rows == 12
    lin.packed = torch.ops.mkldnn._reorder_linear_weight(-w)
    for rows, packed in ((1, False), (11, False), (12, True), (300, True)):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(lin(x), F.linear(x, -w if packed else w), atol=1e-4, rtol=1e-5)


def test_packing_is_used_from_the_fewest_rows_where_it_won_at_every_larger_count():
    rows = PACK_TRIAL_ROWS
    assert packed_min_rows(dict.fromkeys(rows, 1.5)) == 1
    assert packed_min_rows({m: (0.4 if m < 8 else 1.6) for m in rows}) == 8
    assert packed_min_rows({m: (1.6 if m != 16 else 1.0) for m in rows}) == 32  # a loss at 16 rows: from above it
    assert packed_min_rows({m: (1.6 if m < 256 else PACK_MIN_GAIN - 0.01) for m in rows}) is None  # the largest lost
    assert packed_min_rows({m: 1.0 for m in rows}) is None  # a tie is not worth twice the weight memory


def test_a_measured_packing_holds_the_packed_weight_only_where_it_won():
    w = torch.randn(384, 96)
    gains = packed_gains(w, torch.ops.mkldnn._reorder_linear_weight(w), None, rows=(1, 64))
    assert set(gains) == {1, 64} and all(0.05 < g < 20 for g in gains.values())
    lin = Linear(w)
    packed = lin.pack()  # measured on this machine: either way, a consistent state
    assert packed == (lin.packed is not None)
    assert (lin.packed_min_rows in PACK_TRIAL_ROWS) if packed else (lin.packed_min_rows == 0 and lin.weight_bytes() == w.numel() * 4)


def test_what_is_not_packed():
    assert not Linear(quantize_fp8(torch.randn(64, 32))).pack()  # FP8 has its own GEMM
    assert not Linear(torch.randn(64, 32, dtype=torch.float16)).pack()
    assert not Linear(torch.randn(64, 32, dtype=torch.bfloat16)).pack()
    assert not Linear(torch.randn(64, 32, device="meta")).pack()


def test_engine_outputs_match_hf_packed_and_not(tiny_model):
    """The tiny Llama through both GEMM paths: greedy tokens identical to HF fp32 (and so to each other),
    prefill and decode, 8 prompts in one batch."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(4, 40, (8,), generator=gen)]
    want = {f"p{i}": hf_greedy(hf, p, 16).tokens for i, p in enumerate(prompts)}
    for packed in (True, False):
        engine = make_engine(tiny_model, cpu_packed_gemm=False)
        if packed:  # from one row on, whether or not packing pays on this machine
            assert engine.model.pack_weights(min_rows=1) == 4 * len(engine.model.layers) + 1
        layer = engine.model.layers[0]
        assert all((lin.packed is not None) == packed for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        out = run_all(engine, [{"id": f"p{i}", "prompt": p, "params": params} for i, p in enumerate(prompts)])
        assert out == want, packed


def test_the_served_engine_packs_unless_told_not_to(demo_kit):
    import inspect

    from services.common.settings import get_settings
    from services.engine.cli import _engine_config, serve

    options = {name: getattr(p.default, "default", p.default) for name, p in inspect.signature(serve).parameters.items()}
    options.update(model=demo_kit.base_dir, served_model_name=demo_kit.model_name)
    assert _engine_config(options, get_settings()).cpu_packed_gemm is True
    assert _engine_config({**options, "cpu_packed_gemm": False}, get_settings()).cpu_packed_gemm is False
