"""The native CPU paged decode attention (attention_cpu_native.c): compiled once per machine, called
through ctypes.

A CPU decode step's attention used to gather every sequence's cache blocks into a padded copy and run
SDPA with a mask over the padding (bucketed by context length to bound the padding): three passes over
the KV bytes. The C kernel reads each sequence's keys and values once, in place, through its block
table, with an online softmax; on decode batches of 16-256 sequences one layer's attention takes 2-6x
less time than the gather + SDPA path (docs/engine.md). fp32 compute only; prefill chunks keep the SDPA
path. The cache may be fp32 or fp8 (e4m3 with per-(block, kv head) scales, kernels/kv_fp8.py): fp8 bytes are
decoded in registers, and `write_fp8` is the fp8 cache's writer, byte for byte kv_fp8.write_fp8_kv.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # first: its libgomp is the OpenMP runtime the kernel's -fopenmp links against (same soname)

from services.engine.kernels.native_build import NativeKernelUnavailable, library, open_library
from services.engine.model.attention import KV_LIMIT

SOURCE = Path(__file__).with_name("attention_cpu_native.c")
ABI_VERSION = 3
# The C source's stack buffers: query heads per kv head, head width, block size.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256

__all__ = ["NativeAttention", "NativeKernelUnavailable", "load"]

_ERRORS = {
    1: "head counts, head width, block size or row strides do not fit the operands",
    2: "a query row is outside the batch",
    3: "a context length is below 1 or beyond the sequence's block table",
    4: "a block id is outside the cache",
    5: "the shapes exceed the kernel's limits (group, head width, block size)",
    6: "a slot is outside the cache",
    7: "a block is written by two runs of rows, or a run's slots do not follow each other",
    8: "out of memory",
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
        fp8 = lib.mplex_paged_decode_attention_fp8
        fp8.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64,
                        i64, ctypes.c_float, i64]
        fp8.restype = ctypes.c_int
        write = lib.mplex_fp8_kv_write
        write.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64, i64]
        write.restype = ctypes.c_int
        self._fn, self._fp8, self._write = fn, fp8, write
        norm = lib.mplex_add_rms_norm
        norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_float, i64]
        norm.restype = ctypes.c_int
        rope = lib.mplex_rope_write_kv
        rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, ctypes.c_float, i64]
        rope.restype = ctypes.c_int
        self._norm, self._rope = norm, rope
        self._lib = lib

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        """dtype is the compute dtype (q, out); the cache may be that or fp8 either way."""
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
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """out[rows[b]] = attention of q[rows[b]] over the first ctx_lens[b] cached tokens of sequence b.

        q, out [T, H, D] fp32 with unit head-dim stride and heads packed (row stride free); caches
        [num_blocks, block_size, KVH, D] contiguous, fp32 -- or float8_e4m3fn with k_scales, v_scales
        [num_blocks, KVH] contiguous fp32; rows, ctx_lens [B] and tables [B, width] contiguous int64 CPU
        tensors. Rows not named in `rows` are left as they are."""
        fp8 = _check(q, out, k_cache, v_cache, rows, ctx_lens, tables, k_scales, v_scales)
        n = rows.shape[0]
        if n == 0:
            return
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        head = (q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), q.shape[0], k_cache.data_ptr(),
                v_cache.data_ptr())
        tail = (num_blocks, block_size, kv_heads, head_dim, q.shape[1], rows.data_ptr(), ctx_lens.data_ptr(),
                tables.data_ptr(), tables.shape[1], n, window or 0, scale, num_threads)
        if fp8:
            rc = self._fp8(*head, k_scales.data_ptr(), v_scales.data_ptr(), *tail)
        else:
            rc = self._fn(*head, *tail)
        if rc:
            raise ValueError(f"native attention refused its operands: {_ERRORS.get(rc, f'error {rc}')}")

    def write_fp8(self, k_cache: torch.Tensor, k_scales: torch.Tensor, v_cache: torch.Tensor, v_scales: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *, num_threads: int) -> None:
        """Write rows k, v [T, KVH, D] (fp32, heads packed, unit inner stride) into their slots of fp8 caches,
        raising their blocks' scales as needed: the bytes and scales of kv_fp8.write_fp8_kv. The rows of one
        block must be consecutive with consecutive slots, one run per block (as a step plan writes)."""
        for name, t, dtype in (("k_cache", k_cache, FP8), ("v_cache", v_cache, FP8)):
            if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 4 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous 4-D {dtype} CPU tensor, got {t.dtype} {tuple(t.shape)}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        _check_scales(k_scales, v_scales, num_blocks, kv_heads)
        for name, t in (("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.shape[1:] != (kv_heads, head_dim):
                raise ValueError(f"{name} must be fp32 [T, {kv_heads}, {head_dim}] on the CPU, got {t.dtype} {tuple(t.shape)}")
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError(f"{name} must have packed heads with a unit inner stride, got strides {t.stride()}")
        n = slot_mapping.shape[0]
        if (slot_mapping.dtype != torch.int64 or slot_mapping.device.type != "cpu" or slot_mapping.dim() != 1
                or not slot_mapping.is_contiguous() or k.shape[0] != n or v.shape[0] != n):
            raise ValueError("slot_mapping must be a contiguous int64 CPU vector with one slot per row of k and v")
        rc = self._write(k_cache.data_ptr(), k_scales.data_ptr(), v_cache.data_ptr(), v_scales.data_ptr(), num_blocks,
                         block_size, kv_heads, head_dim, k.data_ptr(), max(k.stride(0), kv_heads * head_dim),
                         v.data_ptr(), max(v.stride(0), kv_heads * head_dim), slot_mapping.data_ptr(), n, num_threads)
        if rc:
            raise ValueError(f"native fp8 KV write refused its operands: {_ERRORS.get(rc, f'error {rc}')}")

    # -- the decoder layer's elementwise passes (fp32, CPU): LlamaModel.forward's fused path ---------------------
    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     num_threads: int) -> torch.Tensor:
        """h += delta (in place, when given), then RMSNorm(h) * weight into a new tensor (HF's op order; the sum
        of squares in another order). h, delta [T, H] fp32 with unit inner stride, weight [H] contiguous."""
        _rows(h, "h")
        if delta is not None:
            _rows(delta, "delta", h.shape)
        if weight.dtype != torch.float32 or weight.shape != h.shape[1:] or not weight.is_contiguous():
            raise ValueError(f"weight must be contiguous fp32 [{h.shape[1]}], got {weight.dtype} {tuple(weight.shape)}")
        x = torch.empty(h.shape, dtype=torch.float32)
        rc = self._norm(h.data_ptr(), _ld(h), delta.data_ptr() if delta is not None else None,
                        _ld(delta) if delta is not None else 0, x.data_ptr(), _ld(x), weight.data_ptr(),
                        h.shape[0], h.shape[1], eps, num_threads)
        if rc:
            raise ValueError(f"native RMSNorm refused its operands: {_ERRORS.get(rc, f'error {rc}')}")
        return x

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int, positions: torch.Tensor,
                      cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_threads: int) -> None:
        """RoPE on qkv's q and k heads in place (tables [max_positions, D] as rope.RotaryEmbedding holds them:
        torch's bits), then each token's k and v heads, made cacheable, into its slot of the fp32 caches
        [num_blocks, block_size, KVH, D]. qkv [T, (H + 2 KVH) D] fp32, unit inner stride."""
        _rows(qkv, "qkv")
        n = qkv.shape[0]
        if qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim:
            raise ValueError(f"qkv must be [T, {(num_heads + 2 * kv_heads) * head_dim}], got {tuple(qkv.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 or not t.is_contiguous()
                    or t.shape[2:] != (kv_heads, head_dim)):
                raise ValueError(f"{name} must be a contiguous fp32 [blocks, block_size, {kv_heads}, {head_dim}] CPU "
                                 f"tensor, got {t.dtype} {tuple(t.shape)}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        for name, t in (("cos", cos), ("sin_signed", sin_signed)):
            if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != head_dim or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous fp32 [positions, {head_dim}] table")
        for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
            if t.dtype != torch.int64 or t.device.type != "cpu" or t.shape != (n,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 CPU vector of {n}")
        rc = self._rope(qkv.data_ptr(), _ld(qkv), n, num_heads, kv_heads, head_dim, positions.data_ptr(),
                        cos.data_ptr(), sin_signed.data_ptr(), min(cos.shape[0], sin_signed.shape[0]),
                        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
                        slot_mapping.data_ptr(), KV_LIMIT, num_threads)
        if rc:
            raise ValueError(f"native RoPE / KV write refused its operands: {_ERRORS.get(rc, f'error {rc}')}")


def _ld(t: torch.Tensor) -> int:
    """A [rows, width] operand's row stride as the C passes read it (any stride is as good for fewer than 2 rows)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _rows(t: torch.Tensor, name: str, shape=None) -> None:
    if (t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1)
            or (shape is not None and t.shape != shape)):
        want = f"[{shape[0]}, {shape[1]}]" if shape is not None else "2-D"
        raise ValueError(f"{name} must be a {want} fp32 CPU tensor with unit inner stride, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")


FP8 = torch.float8_e4m3fn


def _check_scales(k_scales, v_scales, num_blocks: int, kv_heads: int) -> None:
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu"
                or t.shape != (num_blocks, kv_heads) or not t.is_contiguous()):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name} must be a contiguous fp32 [{num_blocks}, {kv_heads}] CPU tensor, got {got}")


def _check(q, out, k_cache, v_cache, rows, ctx_lens, tables, k_scales, v_scales) -> bool:
    """Raises on a bad operand; returns True for an fp8 cache."""
    for name, t in (("q", q), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must have packed heads with a unit inner stride, got strides {t.stride()}")
    if q.shape != out.shape:
        raise ValueError(f"q {tuple(q.shape)} and out {tuple(out.shape)} differ")
    fp8 = k_cache.dtype == FP8
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (torch.float32, FP8) or t.device.type != "cpu" or t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 4-D fp32 (or fp8 with scales) CPU tensor, got {t.dtype} {tuple(t.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    if fp8:
        _check_scales(k_scales, v_scales, k_cache.shape[0], k_cache.shape[2])
    elif k_scales is not None or v_scales is not None:
        raise ValueError("scales are for an fp8 cache; this cache is fp32")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    for name, t, dims in (("rows", rows, 1), ("ctx_lens", ctx_lens, 1), ("tables", tables, 2)):
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dims}-D int64 CPU tensor, got {t.dtype} {tuple(t.shape)}")
    if not rows.shape[0] == ctx_lens.shape[0] == tables.shape[0]:
        raise ValueError(f"rows {rows.shape[0]}, ctx_lens {ctx_lens.shape[0]} and tables {tables.shape[0]} differ")
    return fp8


@functools.cache
def load() -> NativeAttention:
    """Build (once per machine and source) and load the kernel; raises NativeKernelUnavailable."""
    return NativeAttention(library(SOURCE, "attention"))
