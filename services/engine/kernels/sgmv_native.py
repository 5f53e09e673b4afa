"""The native CPU SGMV kernel (sgmv_cpu_native.c): compiled once per machine, called through ctypes.

The CPU's LoRA cost is reading adapter weights, and the batched-torch path (sgmv_cpu.py) has to pad
adapters into rank-class stacks and gather/scatter rows around them. The C kernel reads each adapter's
own exact-rank weights once per segment and spreads the segments over the OpenMP threads; on a captured
250-row Zipf decode step over 86 adapters its 16 group applications take ~1.6 ms against ~5.3 ms for the
classed torch path (docs/engine.md). It is fp32 only; other dtypes use the torch path.

The shared library is built by native_build.py (once per machine, source, compiler and flags). When no
compiler works, `load()` raises NativeKernelUnavailable with the compiler's output, and the engine
(lora.cpu_kernel = "auto") falls back to the torch path with a warning.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # first: its libgomp is the OpenMP runtime the kernel's -fopenmp links against (same soname)

from services.engine.kernels.native_build import NativeKernelUnavailable, library, open_library

SOURCE = Path(__file__).with_name("sgmv_cpu_native.c")
MAX_RANK = 512  # MPLEX_MAX_RANK in the C source: the largest max_lora_rank the config accepts
ABI_VERSION = 1

__all__ = ["NativeKernelUnavailable", "NativeSgmv", "load"]

_ERRORS = {
    1: "a segment's adapter slot is outside the slot table",
    2: "a slot table rank is outside 0..512",
    3: "a slot table entry with a rank has a null weight pointer",
    4: "a segment row index is outside the batch",
    5: "a group part's module index or output columns are outside the table or the output",
    6: "a segment's start/end are outside the batch",
    7: "layer, input width or output strides do not fit the operands",
}


class NativeSgmv:
    """The loaded library; `group` is the checked entry point."""

    def __init__(self, path: Path):
        self.path = path
        lib = open_library(path, "mplex_sgmv_abi_version", ABI_VERSION)
        fn = lib.mplex_sgmv_group
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, i64]
        fn.restype = ctypes.c_int
        self._fn = fn  # ctypes releases the GIL for the call: adapter loads keep running beside it
        self._lib = lib

    def group(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        pos: torch.Tensor | None,
        segs: torch.Tensor,
        table: torch.Tensor,
        layer: int,
        parts: torch.Tensor,
        *,
        num_threads: int,
        check: bool = True,
    ) -> None:
        """y[rows, part columns] += x[rows] A^T Bt for every segment and part, in place (see the C source).

        x [T, d_in], y [T, cols] fp32 with unit column stride; pos [T] int64 (step position -> row) or None
        for the identity; segs [S, 3] int64 (start, end, slot); table [slots, layers, modules, 3] int64;
        parts [P, 3] int64. The C side re-checks every index it follows (rows, slots, ranks, pointers, part
        columns); `check=False` skips only the Python-side dtype/layout checks, for callers that made them
        on the same operands' first use."""
        if check:
            _check(x, y, pos, segs, table, parts)
        elif x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        if segs.shape[0] == 0:
            return
        rc = self._fn(x.data_ptr(), x.stride(0), x.shape[1], y.data_ptr(), y.stride(0), y.shape[1], x.shape[0],
                      None if pos is None else pos.data_ptr(), segs.data_ptr(), segs.shape[0],
                      table.data_ptr(), table.shape[0], table.shape[1], table.shape[2], layer,
                      parts.data_ptr(), parts.shape[0], num_threads)
        if rc:
            raise ValueError(f"native SGMV refused its operands: {_ERRORS.get(rc, f'error {rc}')}")


def _check(x, y, pos, segs, table, parts) -> None:
    for name, t in (("x", x), ("y", y)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
            raise ValueError(f"{name} must be row-major with unit column stride, got strides {t.stride()}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    ints = [("segs", segs, 2), ("table", table, 4), ("parts", parts, 2)]
    if pos is not None:
        ints.append(("pos", pos, 1))
    for name, t, dims in ints:
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dims}-D int64 CPU tensor, got {t.dtype} {tuple(t.shape)}")
    if segs.shape[1] != 3 or table.shape[3] != 3 or parts.shape[1] != 3:
        raise ValueError(f"segs {tuple(segs.shape)}, table {tuple(table.shape)} and parts {tuple(parts.shape)} need 3 fields")
    if pos is not None and pos.shape[0] != x.shape[0]:
        raise ValueError(f"pos has {pos.shape[0]} entries for {x.shape[0]} rows")


@functools.cache
def load() -> NativeSgmv:
    """Build (once per machine and source) and load the kernel; raises NativeKernelUnavailable."""
    return NativeSgmv(library(SOURCE, "sgmv"))

