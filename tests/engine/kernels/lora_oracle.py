"""A per-token, per-module LoRA oracle and random adapters and inputs for the CPU SGMV paths' tests (torch and native).

The oracle knows nothing of classes, entries, grids, buffers or segments: every token multiplies its own
adapter's A and B for each targeted module and adds the result at that module's output offset.
"""
import torch
from hypothesis import strategies as st

from services.engine.lora.manager import GROUPS as MANAGER_GROUPS, group_slices
from services.engine.lora.weights import LoraWeights

LAYERS = 2
DIMS = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
        "gate_proj": (16, 24), "up_proj": (16, 24), "down_proj": (24, 16)}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MAX_RANK = 8


def slices():
    assert GROUPS == MANAGER_GROUPS  # the oracle's groups are the engine's
    return group_slices(DIMS)


def make_adapter(seed: int, targets: list[str], ranks: dict[tuple[int, str], int]) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for m in targets:
            r = ranks[(layer, m)]
            d_in, d_out = DIMS[m]
            tensors[(layer, m)] = (torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g) / r)
    return LoraWeights(f"cid{seed}", f"a{seed}", max(ranks.values()), tensors)


def oracle(x, y, layer, group, token_slots, owners: dict[int, LoraWeights]):
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        w = owners[slot]
        for m, off, size in slices()[group]:
            pair = w.tensors.get((layer, m))
            if pair is not None:
                a, b = pair
                out[t, off : off + size] += (x[t] @ a.t()) @ b.t()
    return out


def group_input(group: str, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    d_in = DIMS[GROUPS[group][0]][0]
    d_out = sum(DIMS[m][1] for m in GROUPS[group])
    return torch.randn(t, d_in, generator=g), torch.randn(t, d_out, generator=g)


adapter_spec = st.tuples(
    st.lists(st.sampled_from(sorted(DIMS)), min_size=1, max_size=7, unique=True),  # targets
    st.integers(1, MAX_RANK),  # rank
    st.booleans(),  # vary the rank per layer (rank_pattern)
)
