"""Compiles the paged decode attention kernel for CUDA targets (PTX + cubin through the bundled ptxas)
without a GPU: fp8 and plain caches, GQA and MHA, odd head widths, with and without a sliding window.

Run as a script, in a process where TRITON_INTERPRET is unset (the interpreter never type-checks or lowers
a kernel). Prints one line per compiled variant; exits non-zero on the first failure.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
    sys.exit("run without TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from services.engine.kernels import decode_attention_triton as kernels  # noqa: E402
from services.engine.kernels.decode_attention import triton_next_pow2  # noqa: E402

STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch", "stride_sb",
           "stride_tb")


def shapes(group: int, head_dim: int) -> dict:
    return {"GROUP": group, "GROUP_PAD": triton_next_pow2(group), "HEAD_DIM": head_dim,
            "D_PAD": triton_next_pow2(head_dim)}


def decode(dtype: str, fp8: bool, group: int, head_dim: int, block_size: int, window: bool, split: bool):
    cache = "u8" if fp8 else dtype
    sig = {"q_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}",
           "ks_ptr": "*fp32" if fp8 else f"*{cache}", "vs_ptr": "*fp32" if fp8 else f"*{cache}",
           "rows_ptr": "*i64", "ctx_ptr": "*i64", "tables_ptr": "*i64", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
           "pacc_ptr": "*fp32", "scale": "fp32", "window": "i32", "part_tokens": "i32"}
    sig |= {s: "i32" for s in STRIDES}
    consts = shapes(group, head_dim) | {"BLOCK_SIZE": block_size, "FP8": fp8, "HAS_WINDOW": window, "SPLIT": split}
    return ASTSource(kernels.paged_decode_kernel, sig | {k: "constexpr" for k in consts}, consts)


def combine(dtype: str, group: int, head_dim: int):
    sig = {"out_ptr": f"*{dtype}", "rows_ptr": "*i64", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32",
           "num_parts": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    consts = shapes(group, head_dim)
    return ASTSource(kernels.combine_kernel, sig | {k: "constexpr" for k in consts}, consts)


if __name__ == "__main__":
    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    variants = {
        "fp8 cache, bf16, GQA 4, d128, block 16, split": decode("bf16", True, 4, 128, 16, False, True),
        "fp8 cache, fp32, GQA 3, d24, block 16, window": decode("fp32", True, 3, 24, 16, True, False),
        "fp8 cache, fp16, MHA, d80, block 32": decode("fp16", True, 1, 80, 32, False, False),
        "bf16 cache, GQA 8, d128, block 16, window, split": decode("bf16", False, 8, 128, 16, True, True),
        "merge of partitions, bf16, GQA 4, d128": combine("bf16", 4, 128),
    }
    for name, src in variants.items():
        compiled = triton.compile(src, target=target)
        print(f"compiled {name} for sm_{target.arch}: {len(compiled.asm['cubin'])} bytes cubin")
