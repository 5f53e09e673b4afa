"""Reads a PEFT LoRA adapter into per-(layer, module) A and scaled-B tensors, refusing anything malformed."""
from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.adapter_files import base_name_matcher, check_config_file, check_dir, check_weights
from services.common.lora_format import (
    SUPPORTED_MODULES,
    TensorInfo,
    AdapterFormatError,
    content_id_of,
    parse_safetensors_header,
    parse_tensor_key,
)
from services.engine.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LoraWeights:
    content_id: str
    name: str
    max_rank: int
    # (layer, module) -> (A [r, in], B [out, r] with the LoRA scale folded in)
    tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # The adapter already laid out for a native CPU slot (NativeSlotTable.pack, run by the loader thread so
    # that taking a slot on the step loop copies no weights); `tensors` are then views into its buffer.
    slot_layout: object | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.tensors}, key=SUPPORTED_MODULES.index)


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One targeted projection of a validated adapter file, before any copy: fp32 arrays (other float
    dtypes widened), read-only views of the file's bytes where it held fp32."""

    layer: int
    module: str
    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r], not yet scaled
    scale: np.float32  # the LoRA scale (alpha / r, or alpha / sqrt(r) with rsLoRA)


@dataclass(frozen=True, slots=True)
class LoraArrays:
    """An adapter file read and checked against the base model (names, pairs, shapes, ranks, dtypes and
    its content id); finiteness is checked where the weights are copied (`to_weights`, the slot packer)."""

    content_id: str
    name: str
    max_rank: int
    modules: tuple[LoraModule, ...]  # sorted by (layer, module name)

    def first_nonfinite(self) -> LoraModule | None:
        """The first module with a NaN or Inf weight (or one its scale overflows to Inf), or None."""
        with np.errstate(over="ignore"):
            return next((m for m in self.modules if not (np.isfinite(m.a).all() and np.isfinite(m.b * m.scale).all())), None)

    def refuse_nonfinite(self) -> None:
        bad = self.first_nonfinite()
        if bad is not None:
            raise AdapterFormatError("nan_weights", f"layer {bad.layer} {bad.module} has NaN or Inf weights")


def load_lora(
    adapter_dir: Path,
    model: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype,
    name: str = "",
    expected_content_id: str | None = None,
    base_names: tuple[str, ...] | None = None,
) -> LoraWeights:
    """The adapter as per-module torch tensors (B scaled), for the torch and CUDA paths."""
    return to_weights(read_lora(adapter_dir, model, max_rank=max_rank, name=name,
                                expected_content_id=expected_content_id, base_names=base_names), dtype)


def to_weights(arrays: LoraArrays, dtype: torch.dtype) -> LoraWeights:
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for m in arrays.modules:
        if not (np.isfinite(m.a).all() and np.isfinite(m.b).all()):
            raise AdapterFormatError("nan_weights", f"layer {m.layer} {m.module} has NaN or Inf weights")
        # fp32, as torch computes b.float() * scale; both arrays are fresh, aligned and owned by the tensors
        a_t, b_t = torch.from_numpy(np.array(m.a, dtype=np.float32)), torch.from_numpy(m.b * m.scale)
        tensors[(m.layer, m.module)] = (a_t, b_t) if dtype == torch.float32 else (a_t.to(dtype), b_t.to(dtype))
    return LoraWeights(arrays.content_id, arrays.name, arrays.max_rank, tensors)


def read_lora(
    adapter_dir: Path,
    model: ModelConfig,
    *,
    max_rank: int,
    name: str = "",
    expected_content_id: str | None = None,
    base_names: tuple[str, ...] | None = None,
) -> LoraArrays:
    """Read and check an adapter directory (one read of the weights file: hashed for the content id,
    its header validated, the tensors viewed in place). Everything wrong is an AdapterFormatError, by the
    upload validator's own rules (services.common.adapter_files): the files a directory may hold, the
    config, the header and the tensors. `base_names`: the names of the base model an adapter may say it
    was trained for (None: not checked -- offline tools and tests)."""
    config_path, weights = check_dir(adapter_dir)
    cfg = check_config_file(config_path, max_rank=max_rank,
                             accepts_base=base_name_matcher(base_names) if base_names is not None else _any_base,
                             base_name=base_names[0] if base_names else "")
    data = weights.read_bytes()  # read once: hashed for the content id, then parsed, then the tensors
    cid = content_id_of(cfg, hashlib.sha256(data).hexdigest())
    if expected_content_id is not None and cid != expected_content_id:
        raise AdapterFormatError("content_mismatch", f"adapter files hash to {cid[:12]}…, expected {expected_content_id[:12]}…")
    header = parse_safetensors_header(data)
    (n,) = struct.unpack("<Q", data[:8])
    check_weights(header, len(data) - 8 - n, cfg, model.base_dims())
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    scales: dict[tuple[int, str], np.float32] = {}
    for tensor_name in header:
        key = parse_tensor_key(tensor_name)
        pairs.setdefault((key.layer, key.module), {})[key.which] = tensor_name
        if key.which == "A":
            scales[(key.layer, key.module)] = np.float32(cfg.scale_for(key.module_key, cfg.rank_for(key.module_key)))
    # The arithmetic stays in numpy: loads run on a worker thread beside the step loop, and a torch op big
    # enough for intra-op parallelism would start a second OpenMP team on it, whose spinning workers then
    # take the step loop's cores (measured: Zipf multi-LoRA throughput 0.92x -> 0.69x base from one
    # torch.cat over an adapter's tensors here).
    arrays = _arrays(data, {name: header[name] for names in pairs.values() for name in names.values()})
    modules = []
    for (layer, module), names in sorted(pairs.items()):
        modules.append(LoraModule(layer, module, arrays[names["A"]], arrays[names["B"]], scales[(layer, module)]))
    return LoraArrays(cid, name or Path(adapter_dir).name, max(m.a.shape[0] for m in modules), tuple(modules))


def _any_base(_: str | None) -> bool:
    return True


def _arrays(data: bytes, infos: dict[str, TensorInfo]) -> dict[str, np.ndarray]:
    """The named tensors of a safetensors file whose header parse_safetensors_header has validated, as fp32
    arrays (fp16 and fp64 converted; bf16 widened bit-exactly: its 16 bits are the top half of an fp32)."""
    (n,) = struct.unpack("<Q", data[:8])
    base = 8 + n
    out = {}
    for name, info in infos.items():
        count, offset = math.prod(info.shape), base + info.start
        if info.dtype == "BF16":
            arr = (np.frombuffer(data, np.uint16, count, offset).astype(np.uint32) << 16).view(np.float32)
        elif info.dtype == "F16":
            arr = np.frombuffer(data, np.float16, count, offset).astype(np.float32)
        elif info.dtype == "F64":
            arr = np.frombuffer(data, np.float64, count, offset).astype(np.float32)
        else:
            arr = np.frombuffer(data, np.float32, count, offset)
        out[name] = arr.reshape(info.shape)
    return out
