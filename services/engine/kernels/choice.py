"""Which attention kernel and fp8 KV writer an engine (or a tensor-parallel rank) uses, from its config."""
from __future__ import annotations

import logging

import torch

from services.engine.config import EngineConfig

log = logging.getLogger("mplex.engine")


def attention_kernel_for(config: EngineConfig, mcfg, block_size: int):
    """The paged decode kernel: on the CPU the native one, when config.cpu_attention allows it and it fits
    here; on CUDA with an fp8 cache the Triton one (which reads fp8 + scales in place rather than
    dequantizing a gathered copy); otherwise none (gather + SDPA)."""
    from services.engine.config import ConfigError
    from services.engine.kernels import attention_native

    if config.device != "cpu":
        if config.cache.is_fp8 and config.device.startswith("cuda"):
            from services.engine.kernels.decode_attention import TritonDecodeAttention

            return TritonDecodeAttention()
        return None
    if config.cpu_attention == "torch":
        return None
    why = None
    if not attention_native.NativeAttention.supports(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, block_size,
                                                     config.torch_dtype):
        why = (f"it takes fp32, at most {attention_native.MAX_GROUP} query heads per kv head, head_dim <= "
               f"{attention_native.MAX_HEAD_DIM} and block_size <= {attention_native.MAX_BLOCK}")
    else:
        try:
            return attention_native.load()
        except attention_native.NativeKernelUnavailable as exc:
            why = str(exc)
    if config.cpu_attention == "native":
        kv = " (with kv_dtype=fp8 too: the kernel dequantizes into fp32)" if config.cache.is_fp8 else ""
        raise ConfigError(f"cpu_attention=native, but {why}{kv}")
    if config.torch_dtype == torch.float32:  # other dtypes are expected to use SDPA: no warning for them
        log.warning("native CPU attention unavailable, using gather + SDPA: %s", why)
    return None


def fp8_writer_for(config: EngineConfig, attention_kernel):
    """The native writer of an fp8 cache: the CPU decode kernel's library, when it is in use (fp32 compute;
    cpu_attention="torch" keeps every KV op in torch). Otherwise kv_fp8.write_fp8_kv writes."""
    from services.engine.kernels.attention_native import NativeAttention

    if config.cache.is_fp8 and isinstance(attention_kernel, NativeAttention):
        return attention_kernel
    return None
