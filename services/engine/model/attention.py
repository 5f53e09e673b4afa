"""Paged attention over a flattened (varlen) batch: K/V are written to and read from cache blocks.

The batch's query tokens are split into groups so that no sequence pays for another's shape: decode
rows (one query token each) and prefill rows (a chunk of query tokens each). A padded group runs as ONE
scaled-dot-product-attention call whose keys are gathered from the cache through the sequences' block
tables. On the CPU in fp32 the decode rows instead form one DecodeGroup, which the native kernel
(kernels/attention_native.py) attends in place in the cache, without a padded copy. There is no
per-sequence Python loop in the forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.kernels.attention_native import NativeAttention


@dataclass(slots=True)
class AttnGroup:
    """One padded attention batch: B sequences, Q query slots, L key slots (L = blocks * block_size)."""

    token_index: torch.Tensor  # [B, Q] rows into the flattened token batch (padding repeats a valid row)
    valid: torch.Tensor  # [B, Q] bool: real query slots
    block_tables: torch.Tensor  # [B, nblocks] cache block ids (padding = 0)
    mask: torch.Tensor  # [B, 1, Q, L] additive: 0 where key j is visible to query i, -inf elsewhere

    @property
    def num_seqs(self) -> int:
        return self.token_index.shape[0]


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows attended by the native CPU kernel, straight from the cache (no padded copy)."""

    rows: torch.Tensor  # [B] each sequence's query row in the flattened batch
    context_lens: torch.Tensor  # [B] tokens in cache after this step (incl. the new one)
    block_tables: torch.Tensor  # [B, nblocks] contiguous cache block ids (padding = 0, never read)
    kernel: NativeAttention
    sliding_window: int | None
    num_threads: int

    @property
    def num_seqs(self) -> int:
        return self.rows.shape[0]


@dataclass(slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) for every new token
    groups: tuple[AttnGroup | DecodeGroup, ...]


def build_group(
    token_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype = torch.float32,
) -> AttnGroup:
    """Build a padded group from per-sequence [B] tensors.

    token_starts: first row of the sequence's query tokens in the flattened batch;
    query_lens: new tokens this step; context_lens: tokens in cache after this step (incl. new ones).
    """
    device = token_starts.device
    q_max = int(query_lens.max())
    l_max = block_tables.shape[1] * block_size
    q_idx = torch.arange(q_max, device=device)
    valid = q_idx[None, :] < query_lens[:, None]
    token_index = token_starts[:, None] + torch.minimum(q_idx[None, :], (query_lens - 1)[:, None])
    # Absolute position of each query slot; key j is visible when j <= position (and inside the window).
    q_pos = (context_lens - query_lens)[:, None] + q_idx[None, :]
    k_pos = torch.arange(l_max, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
    mask &= valid[:, :, None]
    # Padded query slots see key 0 only, so softmax never divides by zero; their output is discarded.
    mask[:, :, 0] |= ~valid
    # Additive rather than boolean: CPU SDPA takes it as is (a bool mask is converted on every call), and
    # the group's mask is built once per step for all layers.
    zero = torch.zeros((), dtype=dtype, device=device)
    additive = torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=device))
    return AttnGroup(token_index=token_index, valid=valid, block_tables=block_tables, mask=additive.unsqueeze(1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D]."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for group in meta.groups:  # prefill rows, and decode rows (bucketed by context length on the torch path)
        if isinstance(group, DecodeGroup):
            group.kernel.decode(q, out, k_cache, v_cache, group.rows, group.context_lens, group.block_tables,
                                scale=scale, window=group.sliding_window, num_threads=group.num_threads)
            continue
        b, qn = group.token_index.shape
        flat = group.token_index.reshape(-1)
        q_g = q.index_select(0, flat).view(b, qn, -1, head_dim).transpose(1, 2)
        nb = group.block_tables.shape[1]
        k_g = k_cache.index_select(0, group.block_tables.reshape(-1)).view(b, nb * block_size, kv_heads, head_dim)
        v_g = v_cache.index_select(0, group.block_tables.reshape(-1)).view(b, nb * block_size, kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q_g,
            k_g.transpose(1, 2),
            v_g.transpose(1, 2),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=kv_heads != q.shape[1],
        )
        o = o.transpose(1, 2).reshape(b * qn, -1, head_dim)
        keep = group.valid.reshape(-1)
        out.index_copy_(0, flat[keep], o[keep])
    return out
