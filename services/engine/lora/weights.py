"""Reads a PEFT LoRA adapter into per-(layer, module) A and scaled-B tensors, refusing anything malformed."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.lora_format import (
    FLOAT_DTYPES,
    SUPPORTED_MODULES,
    TensorInfo,
    WEIGHTS_FILE,
    AdapterFormatError,
    content_id,
    parse_tensor_key,
    read_config,
    read_safetensors_header,
)
from services.engine.config import ModelConfig

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-capable projection."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True, slots=True)
class LoraWeights:
    content_id: str
    name: str
    max_rank: int
    # (layer, module) -> (A [r, in], B [out, r] with the LoRA scale folded in)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.tensors}, key=SUPPORTED_MODULES.index)


def load_lora(
    adapter_dir: Path,
    model: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype,
    name: str = "",
    expected_content_id: str | None = None,
) -> LoraWeights:
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterFormatError("missing_file", f"adapter directory {adapter_dir} does not exist")
    weights = adapter_dir / WEIGHTS_FILE
    if not weights.is_file():
        pickles = [p.name for p in adapter_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES]
        if pickles:
            raise AdapterFormatError("pickle_file", f"{pickles[0]} is a pickle checkpoint; only {WEIGHTS_FILE} is loaded", WEIGHTS_FILE)
        raise AdapterFormatError("missing_file", f"{WEIGHTS_FILE} is missing", WEIGHTS_FILE)
    cfg = read_config(adapter_dir, max_rank=max_rank)
    cid = content_id(adapter_dir)
    if expected_content_id is not None and cid != expected_content_id:
        raise AdapterFormatError("content_mismatch", f"adapter files hash to {cid[:12]}…, expected {expected_content_id[:12]}…")
    header = read_safetensors_header(weights)
    if not header:
        raise AdapterFormatError("empty_adapter", "the adapter has no tensors")
    dims = module_dims(model)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name, info in header.items():
        key = parse_tensor_key(tensor_name)
        if key.layer >= model.num_layers:
            raise AdapterFormatError("shape_mismatch", f"tensor {tensor_name!r} is for layer {key.layer}; the base model has {model.num_layers}")
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterFormatError("bad_dtype", f"tensor {tensor_name!r} has non-float dtype {info.dtype}")
        rank = cfg.rank_for(key.module_key)
        d_in, d_out = dims[key.module]
        want = (rank, d_in) if key.which == "A" else (d_out, rank)
        if info.shape != want:
            features_ok = len(info.shape) == 2 and (info.shape[1] == d_in if key.which == "A" else info.shape[0] == d_out)
            code = "rank_mismatch" if features_ok else "shape_mismatch"
            raise AdapterFormatError(code, f"tensor {tensor_name!r} has shape {list(info.shape)}, expected {list(want)} for this base model")
        slot = pairs.setdefault((key.layer, key.module), {})
        if key.which in slot:
            raise AdapterFormatError("duplicate_tensor", f"two lora_{key.which} tensors for layer {key.layer} {key.module}")
        slot[key.which] = tensor_name
    # One read of the whole file, its header validated above (offsets inside the data, no overlaps, sizes
    # matching dtype x shape); then a few ops per tensor: loads run on worker threads beside the step loop,
    # and every Python-level op holds the GIL the step loop needs.
    raw = _read_tensors(weights, {name: header[name] for names in pairs.values() for name in names.values()})
    checked = [raw[name] for names in pairs.values() for name in names.values()]
    for (layer, module), names in sorted(pairs.items()):
        if set(names) != {"A", "B"}:
            raise AdapterFormatError("missing_tensor", f"layer {layer} {module} has lora_{''.join(names)} but not its pair")
    if not bool(torch.isfinite(torch.cat([t.reshape(-1).float() for t in checked])).all()):
        bad = next(key for key, names in sorted(pairs.items())
                   if not all(bool(torch.isfinite(raw[n].float()).all()) for n in names.values()))
        raise AdapterFormatError("nan_weights", f"layer {bad[0]} {bad[1]} has NaN or Inf weights")
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), names in sorted(pairs.items()):
        a, b = raw[names["A"]], raw[names["B"]]
        scale = cfg.scale_for(parse_tensor_key(names["A"]).module_key, a.shape[0])
        # clone: A must not alias the file's buffer (B's multiply makes a copy of its own)
        tensors[(layer, module)] = (a.to(dtype).clone(), b.float().mul(scale).to(dtype).contiguous())
    return LoraWeights(cid, name or adapter_dir.name, max(a.shape[0] for a, _ in tensors.values()), tensors)


def _read_tensors(path: Path, infos: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors file whose header read_safetensors_header has validated."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    base = 8 + n
    return {name: torch.frombuffer(data, dtype=_TORCH_DTYPES[info.dtype], count=math.prod(info.shape), offset=base + info.start)
            .view(info.shape) for name, info in infos.items()}
