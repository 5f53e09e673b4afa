"""The forward's rotary embedding (model/rope.py): q and k heads rotated in one call with tables gathered once a
forward, bit for bit what Hugging Face's apply_rotary_pos_emb computes, for every rope type the engine reads."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from services.engine.config import RopeConfig
from services.engine.model.rope import RotaryEmbedding

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, rope_type="linear", factor=2.0),
    "llama3": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64),
    "yarn": RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("head_dim", [8, 24, 32, 64])
def test_rotating_q_and_k_together_is_hf_bit_for_bit(rope, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    emb = RotaryEmbedding(ROPES[rope], head_dim, 256, torch.float32, "cpu")
    heads, kv_heads, t = 6, 2, 37
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    qkv[::5, :head_dim] = 0.0  # zeros (and their signs) rotate as HF's do
    qkv[1::7, head_dim:2 * head_dim] = -0.0
    positions = torch.randint(0, 256, (t,), generator=gen)
    qk, _ = qkv.split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
    cos, sin = emb.tables(positions)
    got = emb.rotate(qk.view(t, heads + kv_heads, head_dim), cos, sin)
    q, k = qk.view(t, heads + kv_heads, head_dim).split((heads, kv_heads), dim=1)
    # HF's layout: [batch, heads, seq, d] with cos/sin [batch, seq, d]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          emb.cos[positions][None], emb.sin[positions][None])
    want = torch.cat((want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)), dim=1)
    assert got.view(torch.int32).equal(want.contiguous().view(torch.int32))  # the bits, signed zeros included
