"""Engine compute kernels: SGMV multi-LoRA shrink/expand (Triton + torch reference) and FP8 linear."""
from services.engine.kernels.fp8 import Fp8Weight, fp8_embedding, fp8_embedding_ref, fp8_linear, fp8_linear_ref, quantize_fp8
from services.engine.kernels.sgmv import lora_expand, lora_shrink
from services.engine.kernels.sgmv_meta import SgmvMeta, build_sgmv_meta
from services.engine.kernels.sgmv_ref import lora_expand_ref, lora_shrink_ref

__all__ = [
    "Fp8Weight",
    "SgmvMeta",
    "build_sgmv_meta",
    "fp8_embedding",
    "fp8_embedding_ref",
    "fp8_linear",
    "fp8_linear_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_ref",
    "quantize_fp8",
]
