"""build_sgmv_meta: segments are a stable grouping of the batch by slot, with consistent host copies."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.kernels import build_sgmv_meta


def check_meta(slots: torch.Tensor) -> None:
    meta = build_sgmv_meta(slots)
    t = slots.numel()
    idx, starts, seg_slots = meta.token_indices_sorted, meta.seg_starts, meta.seg_slots
    assert (idx.dtype, starts.dtype, seg_slots.dtype) == (torch.int64, torch.int32, torch.int32)
    assert meta.num_tokens == t
    assert sorted(idx.tolist()) == list(range(t))  # a permutation of the batch rows
    assert starts.tolist() == list(meta.starts_host) and seg_slots.tolist() == list(meta.slots_host)
    assert meta.starts_host[0] == 0 and meta.starts_host[-1] == t
    assert list(meta.slots_host) == sorted(set(slots.tolist()))  # one segment per slot present, ascending
    lora_lens = []
    for i, slot in enumerate(meta.slots_host):
        rows = idx[meta.starts_host[i] : meta.starts_host[i + 1]].tolist()
        assert rows and all(slots[r].item() == slot for r in rows)
        assert rows == sorted(rows)  # stable: batch order kept inside a segment
        if slot >= 0:
            lora_lens.append(len(rows))
    assert meta.max_lora_seg_len == max(lora_lens, default=0)
    assert meta.max_slot == (max(slots.tolist()) if t else -1)
    assert meta.is_identity == (idx.tolist() == list(range(t)))
    assert [s for s, _, _ in meta.lora_segments()] == [s for s in meta.slots_host if s >= 0]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=7), max_size=40))
def test_meta_groups_tokens_by_slot(slot_list):
    check_meta(torch.tensor(slot_list, dtype=torch.int64))


def test_meta_edge_cases():
    check_meta(torch.tensor([], dtype=torch.int64))
    check_meta(torch.full((5,), -1, dtype=torch.int32))
    check_meta(torch.tensor([3]))
    meta = build_sgmv_meta(torch.tensor([0, 0, 2, 2, 2]))
    assert meta.is_identity and meta.lora_segments() == [(0, 0, 2), (2, 2, 5)]
    meta = build_sgmv_meta(torch.tensor([2, -1, 0, 2, -1, 0]))
    assert meta.token_indices_sorted.tolist() == [1, 4, 2, 5, 0, 3]
    assert meta.starts_host == (0, 2, 4, 6) and meta.slots_host == (-1, 0, 2)
    assert meta.max_lora_seg_len == 2 and not meta.is_identity


@pytest.mark.parametrize(
    "slots, match",
    [
        (torch.zeros(2, 3, dtype=torch.int64), "1-D"),
        (torch.zeros(4), "int32 or int64"),
        (torch.tensor([0, -2, 1]), ">= -1"),
    ],
)
def test_meta_rejects_bad_slots(slots, match):
    with pytest.raises(ValueError, match=match):
        build_sgmv_meta(slots)
