"""The native CPU paged decode attention (attention_cpu_native.c): compiled once per machine, called
through ctypes.

A CPU decode step's attention used to gather every sequence's cache blocks into a padded copy and run
SDPA with a mask over the padding (bucketed by context length to bound the padding): three passes over
the KV bytes. The C kernel reads each sequence's keys and values once, in place, through its block
table, with an online softmax; on decode batches of 16-256 sequences one layer's attention takes 2-6x
less time than the gather + SDPA path (docs/engine.md). fp32 only; prefill chunks keep the SDPA path.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # first: its libgomp is the OpenMP runtime the kernel's -fopenmp links against (same soname)

from services.engine.kernels.native_build import NativeKernelUnavailable, library, open_library

SOURCE = Path(__file__).with_name("attention_cpu_native.c")
ABI_VERSION = 1
# The C source's stack buffers: query heads per kv head, head width, block size.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256

__all__ = ["NativeAttention", "NativeKernelUnavailable", "load"]

_ERRORS = {
    1: "head counts, head width, block size or row strides do not fit the operands",
    2: "a query row is outside the batch",
    3: "a context length is below 1 or beyond the sequence's block table",
    4: "a block id is outside the cache",
    5: "the shapes exceed the kernel's limits (group, head width, block size)",
}


class NativeAttention:
    """The loaded library; `decode` is the checked entry point."""

    def __init__(self, path: Path):
        self.path = path
        lib = open_library(path, "mplex_attn_abi_version", ABI_VERSION)
        fn = lib.mplex_paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64,
                       ctypes.c_float, i64]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        return (dtype == torch.float32 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
                and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK)

    def decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        ctx_lens: torch.Tensor,
        tables: torch.Tensor,
        *,
        scale: float,
        window: int | None,
        num_threads: int,
    ) -> None:
        """out[rows[b]] = attention of q[rows[b]] over the first ctx_lens[b] cached tokens of sequence b.

        q, out [T, H, D] fp32 with unit head-dim stride and heads packed (row stride free); caches
        [num_blocks, block_size, KVH, D] contiguous fp32; rows, ctx_lens [B] and tables [B, width] contiguous
        int64 CPU tensors. Rows not named in `rows` are left as they are."""
        _check(q, out, k_cache, v_cache, rows, ctx_lens, tables)
        n = rows.shape[0]
        if n == 0:
            return
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        rc = self._fn(q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), q.shape[0],
                      k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_size, kv_heads, head_dim, q.shape[1],
                      rows.data_ptr(), ctx_lens.data_ptr(), tables.data_ptr(), tables.shape[1], n,
                      window or 0, scale, num_threads)
        if rc:
            raise ValueError(f"native attention refused its operands: {_ERRORS.get(rc, f'error {rc}')}")


def _check(q, out, k_cache, v_cache, rows, ctx_lens, tables) -> None:
    for name, t in (("q", q), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must have packed heads with a unit inner stride, got strides {t.stride()}")
    if q.shape != out.shape:
        raise ValueError(f"q {tuple(q.shape)} and out {tuple(out.shape)} differ")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 4-D fp32 CPU tensor, got {t.dtype} {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    for name, t, dims in (("rows", rows, 1), ("ctx_lens", ctx_lens, 1), ("tables", tables, 2)):
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dims}-D int64 CPU tensor, got {t.dtype} {tuple(t.shape)}")
    if not rows.shape[0] == ctx_lens.shape[0] == tables.shape[0]:
        raise ValueError(f"rows {rows.shape[0]}, ctx_lens {ctx_lens.shape[0]} and tables {tables.shape[0]} differ")


@functools.cache
def load() -> NativeAttention:
    """Build (once per machine and source) and load the kernel; raises NativeKernelUnavailable."""
    return NativeAttention(library(SOURCE, "attention"))
