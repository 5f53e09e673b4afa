"""Compiles the SGMV kernels (and, for sm_89+, the FP8 row quantization) for CUDA targets (PTX + cubin through the bundled ptxas) without a GPU.

Run as a script, in a process where TRITON_INTERPRET is unset: the interpreter never type-checks
or lowers the kernels, so this is what catches code that only breaks in the compiled path.
Prints one line per compiled variant; exits non-zero on the first failure.
"""
import os
import sys

if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
    sys.exit("run without TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from services.engine.kernels import fp8_quant_triton  # noqa: E402
from services.engine.kernels import sgmv_triton as kernels  # noqa: E402

INDEX = {"ranks_ptr": "*i32", "token_idx_ptr": "*i64", "seg_starts_ptr": "*i32", "seg_slots_ptr": "*i32"}


def shrink(dtype: str, split_k: int, precision):
    sig = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "out_ptr": "*fp32", **INDEX, "h_in": "i32", "r_max": "i32"}
    sig |= {s: "i32" for s in ("stride_xt", "stride_xh", "stride_as", "stride_ar", "stride_ah", "stride_ot", "stride_or")}
    consts = {"BLOCK_M": 16, "BLOCK_R": 32, "BLOCK_K": 64, "SPLIT_K": split_k, "UPCAST": False, "DOT_PRECISION": precision}
    return ASTSource(kernels.sgmv_shrink_kernel, sig | {k: "constexpr" for k in consts}, consts)


def expand(dtype: str, v_dtype: str, precision):
    sig = {"v_ptr": f"*{v_dtype}", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", **INDEX, "h_out": "i32", "r_max": "i32", "y_offset": "i32"}
    sig |= {s: "i32" for s in ("stride_vt", "stride_vr", "stride_bs", "stride_bh", "stride_br", "stride_yt", "stride_yh")}
    consts = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 16, "UPCAST": False, "DOT_PRECISION": precision}
    return ASTSource(kernels.sgmv_expand_kernel, sig | {k: "constexpr" for k in consts}, consts)


def quantize_rows(dtype: str):
    sig = {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32", "stride_q": "i32"}
    consts = {"FP8_MAX": 448.0, "BLOCK": 1024, "STAGED": False}
    return ASTSource(fp8_quant_triton.quantize_rows_kernel, sig | {k: "constexpr" for k in consts}, consts)


if __name__ == "__main__":
    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    variants = {
        "shrink bf16": shrink("bf16", 1, None),
        "shrink fp32 split-k": shrink("fp32", 4, "ieee"),
        "expand bf16 (fp32 v)": expand("bf16", "fp32", None),
        "expand fp16": expand("fp16", "fp16", None),
        "expand fp32": expand("fp32", "fp32", "ieee"),
    }
    if target.arch >= 89:  # e4m3 conversions exist from sm_89 (where the engine uses _scaled_mm)
        variants["fp8 row quantization of bfloat16 activations (no dots)"] = quantize_rows("bf16")
    for name, src in variants.items():
        compiled = triton.compile(src, target=target)
        uses_mma = "mma" in compiled.asm["ptx"]
        print(f"compiled {name} for sm_{target.arch}: {len(compiled.asm['cubin'])} bytes cubin, tensor cores: {uses_mma}")
