"""The forward past the last layer's attention for the sampled rows only (LlamaModel.forward's `keep`): every
kept row's final hidden state is the whole batch's to fp32 rounding -- on the native and the torch attention
paths, with LoRA deltas on the kept rows (StepLora.rows), and for steps of prompt chunks that sample nothing.
The oracle tests hold the engine's tokens to HF's on every scheduler path; this checks the rows themselves."""
from __future__ import annotations

import pytest
import torch

from services.common.lora_format import content_id
from services.engine.sequence import AdapterRef, SamplingParams
from tests.engine.conftest import make_engine, run_all


def _check_every_kept_forward(engine) -> dict[str, int]:
    """Wrap the engine's model so every forward that keeps a strict subset of its rows is also run whole (the
    same K/V rewritten to the same slots) and compared row by row; returns counts of what was checked."""
    model, seen = engine.model, {"subset": 0, "empty": 0, "lora": 0, "mismatch": 0}
    forward = model.forward

    def checked(input_ids, positions, attn, kv_caches, lora=None, keep=None):
        out = forward(input_ids, positions, attn, kv_caches, lora, keep=keep)
        if keep is not None and keep.shape[0] < input_ids.shape[0]:
            whole = forward(input_ids, positions, attn, kv_caches, lora)
            if out.shape != (keep.shape[0], whole.shape[1]):
                seen["mismatch"] += 1
            # recorded, not raised: the engine's fault isolation would re-run the step one sequence at a time
            if not torch.allclose(out, whole.index_select(0, keep), rtol=1e-5, atol=1e-5):
                seen["mismatch"] += 1
            seen["empty" if keep.shape[0] == 0 else "subset"] += 1
            seen["lora"] += lora is not None and keep.shape[0] > 0
        return out

    model.forward = checked
    return seen


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_kept_rows_are_the_whole_batchs_rows(demo_kit, attention):
    # budget 24: long prompts span several steps, the chunks before their last sample nothing
    engine = make_engine(demo_kit.base_dir, budget=24, cpu_attention=attention)
    seen = _check_every_kept_forward(engine)
    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    lens = [41, 3, 9, 17, 30, 5]  # the first step is the first prompt's first chunk alone: nothing sampled
    reqs = [{"id": f"r{i}", "prompt": torch.randint(3, 400, (n,), generator=gen).tolist(), "params": params}
            for i, n in enumerate(lens)]
    out = run_all(engine, reqs)
    assert all(len(t) == 6 for t in out.values())
    assert seen["subset"] > 0 and seen["empty"] > 0 and seen["mismatch"] == 0, seen


def test_kept_rows_with_lora_deltas(demo_kit):
    engine = make_engine(demo_kit.base_dir, budget=32, inline_loads=True)
    seen = _check_every_kept_forward(engine)
    refs = [AdapterRef(content_id(a.path), name, str(a.path)) for name, a in sorted(demo_kit.adapters.items())]
    assert refs, "the demo kit has adapters"
    gen = torch.Generator().manual_seed(12)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    reqs = [{"id": f"r{i}", "prompt": torch.randint(3, 400, (int(n),), generator=gen).tolist(), "params": params,
             "adapter": refs[i % len(refs)] if i % 3 else None}
            for i, n in enumerate(torch.randint(4, 28, (9,), generator=gen))]
    out = run_all(engine, reqs)
    assert all(len(t) == 4 for t in out.values())
    assert seen["lora"] > 0 and seen["mismatch"] == 0, seen
