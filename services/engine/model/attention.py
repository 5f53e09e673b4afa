"""Paged attention over a flattened (varlen) batch: K/V are written to and read from cache blocks.

The batch's query tokens are split into groups so that no sequence pays for another's shape: decode
rows (one query token each) and prefill rows (a chunk of query tokens each). A padded group runs as ONE
scaled-dot-product-attention call whose keys are gathered from the cache through the sequences' block
tables. On the CPU in fp32 the decode rows instead form one DecodeGroup, which the native kernel
(kernels/attention_native.py) attends in place in the cache, without a padded copy; on CUDA with an fp8
cache the Triton paged decode kernel (kernels/decode_attention.py) does the same. There is no
per-sequence Python loop in the forward.

An fp8 cache (kernels/kv_fp8.py) is written through the scheme's writer (the native one on the CPU in
fp32) and read dequantized: by the decode kernels in registers, by the SDPA path after its gather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine.kernels.kv_fp8 import Fp8WritePlan, gather_dequant, write_fp8_kv


@dataclass(slots=True)
class LayerKV:
    """One layer's paged cache: K and V [num_blocks, block_size, kv_heads, D] in the compute dtype, or
    float8_e4m3fn with their scales [num_blocks, kv_heads] fp32 (one per block and kv head)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding per-block state, each indexed by block id in dim 0."""
        return [self.k, self.v] if self.k_scale is None else [self.k, self.v, self.k_scale, self.v_scale]


class DecodeKernel(Protocol):
    """Paged decode attention read in place through block tables (kernels/attention_native.py,
    kernels/decode_attention.py): out[rows[b]] = attention of q[rows[b]] over ctx_lens[b] cached tokens."""

    def decode(self, q, out, k_cache, v_cache, rows, ctx_lens, tables, *, scale: float, window: int | None,
               num_threads: int, k_scales=None, v_scales=None) -> None: ...


class Fp8Writer(Protocol):
    """A native writer of fp8 K/V rows with the bytes of kv_fp8.write_fp8_kv (kernels/attention_native.py)."""

    def write_fp8(self, k_cache, k_scales, v_cache, v_scales, k, v, slot_mapping, *, num_threads: int) -> None: ...


class ElementwiseOps(Protocol):
    """The decoder layer's elementwise work in single native passes (kernels/attention_native.NativeAttention)."""

    def add_rms_norm(self, h, delta, weight, eps: float, num_threads: int): ...

    def rope_write_kv(self, qkv, num_heads: int, kv_heads: int, head_dim: int, positions, cos, sin_signed, k_cache,
                      v_cache, slot_mapping, num_threads: int) -> None: ...


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
    """Decode rows attended by a paged decode kernel, straight from the cache (no padded copy)."""

    rows: torch.Tensor  # [B] each sequence's query row in the flattened batch
    context_lens: torch.Tensor  # [B] tokens in cache after this step (incl. the new one)
    block_tables: torch.Tensor  # [B, nblocks] contiguous cache block ids (padding = 0, never read)
    kernel: DecodeKernel
    sliding_window: int | None
    num_threads: int

    @property
    def num_seqs(self) -> int:
        return self.rows.shape[0]


@dataclass(slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) for every new token
    groups: tuple[AttnGroup | DecodeGroup, ...]
    fp8_write: Fp8WritePlan | None = None  # fp8 cache written by torch: the step's runs of rows per block
    fp8_writer: Fp8Writer | None = None  # fp8 cache written natively (CPU, fp32)
    num_threads: int = 1
    # The native CPU library's fused passes (RMSNorm with the residual add, RoPE with the K/V write:
    # kernels/attention_native.py), when the step runs the native decode kernel in fp32; else None.
    elementwise: ElementwiseOps | None = None


# Largest magnitude a cached K/V element may hold: far above any real activation, small enough that a query
# times a stale key cannot overflow fp32 (|q| * KV_LIMIT * head_dim << 3.4e38).
KV_LIMIT = 1e18


def cacheable(x: torch.Tensor) -> torch.Tensor:
    """K or V rows as the cache may hold them: NaN, Inf and magnitudes over KV_LIMIT become 0.

    A block outlives its sequence: freed, it goes to the next request, whose prefill gathers whole blocks and
    masks the slots past its fill. A masked slot adds exp(-inf) = 0 -- unless it holds NaN or Inf (NaN - inf,
    0 * NaN), which one request's overflowing activations (an adapter with huge weights, found by the quality
    gate) would otherwise pass on to whoever gets the block next. Only a request whose own K/V is not finite
    sees a change, and its output is garbage already; a healthy request's values pass unchanged."""
    return torch.where(x.abs() <= KV_LIMIT, x, torch.zeros((), dtype=x.dtype, device=x.device))


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, meta: AttnMetadata) -> None:
    """The step's new K/V rows [T, KVH, D] into their slots (made finite first: `cacheable`)."""
    k, v = cacheable(k), cacheable(v)
    if not cache.is_fp8:
        kv_heads, head_dim = cache.k.shape[2:]
        cache.k.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        cache.v.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    elif meta.fp8_writer is not None:
        meta.fp8_writer.write_fp8(cache.k, cache.k_scale, cache.v, cache.v_scale, k, v, meta.slot_mapping,
                                  num_threads=meta.num_threads)
    else:
        assert meta.fp8_write is not None, "an fp8 cache needs the step's write plan"
        write_fp8_kv(cache.k, cache.k_scale, k, meta.fp8_write)
        write_fp8_kv(cache.v, cache.v_scale, v, meta.fp8_write)


def split_into_decode_rows(offsets: torch.Tensor, lens: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
                           split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence attention inputs (first row in the flattened batch, query rows, context after the step,
    block table [n, width]) with each `split` sequence's rows cut into one-row sequences: its row j sees the
    context up to its own position (ctx - lens + 1 + j tokens) through the same block table. All of the step's
    K/V is written before any attention reads the cache, so these are exactly decode rows, and the paged
    decode kernel attends them in place: a draft's k + 1 rows being verified (each computed as plain decoding
    would compute it), and on the CPU a prompt chunk, where the kernel beats a padded causal SDPA group
    (model_runner.PREFILL_DECODE_ROWS_MAX). One batched pass, no loop over rows."""
    if not bool(split.any()):
        return offsets, lens, ctx, tables
    reps = torch.where(split, lens, torch.ones_like(lens))
    idx = torch.repeat_interleave(torch.arange(lens.shape[0]), reps)
    j = torch.arange(idx.shape[0]) - (torch.cumsum(reps, 0) - reps)[idx]
    cut = split[idx]
    return (offsets[idx] + torch.where(cut, j, 0), torch.where(cut, 1, lens[idx]),
            torch.where(cut, ctx[idx] - lens[idx] + 1 + j, ctx[idx]), tables[idx])


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
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache: LayerKV,
    meta: AttnMetadata,
    scale: float,
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D], or None where the step's K/V rows are in the cache already (the native
    RoPE pass writes them); cache: [num_blocks, block_size, KVH, D] K and V. Returns [T, H, D]. `wanted`: the
    rows whose output is read (the last layer's kept rows, LlamaModel.forward): a decode kernel's group attends
    those alone, and the other rows of the result are left unset."""
    num_blocks, block_size, kv_heads, head_dim = cache.k.shape
    if k is not None:
        write_kv(k, v, cache, meta)
    out = torch.empty_like(q)
    for group in meta.groups:  # prefill rows, and decode rows (bucketed by context length on the torch path)
        if isinstance(group, DecodeGroup):
            rows, ctx, tables = group.rows, group.context_lens, group.block_tables
            if wanted is not None:
                sel = torch.isin(rows, wanted)
                rows, ctx, tables = rows[sel], ctx[sel], tables[sel]
            group.kernel.decode(q, out, cache.k, cache.v, rows, ctx, tables,
                                scale=scale, window=group.sliding_window, num_threads=group.num_threads,
                                k_scales=cache.k_scale, v_scales=cache.v_scale)
            continue
        b, qn = group.token_index.shape
        flat = group.token_index.reshape(-1)
        q_g = q.index_select(0, flat).view(b, qn, -1, head_dim).transpose(1, 2)
        nb = group.block_tables.shape[1]
        if cache.is_fp8:
            k_g = gather_dequant(cache.k, cache.k_scale, group.block_tables, q.dtype)
            v_g = gather_dequant(cache.v, cache.v_scale, group.block_tables, q.dtype)
        else:
            k_g = cache.k.index_select(0, group.block_tables.reshape(-1))
            v_g = cache.v.index_select(0, group.block_tables.reshape(-1))
        k_g = k_g.view(b, nb * block_size, kv_heads, head_dim)
        v_g = v_g.view(b, nb * block_size, kv_heads, head_dim)
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
