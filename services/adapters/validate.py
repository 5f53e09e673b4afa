"""Validation of an uploaded adapter, as plain functions: everything short of running it.

Order matters only for which refusal is reported first; every refusal is an AdapterFormatError with a
stable `code` and a human `message`, stored as the version's `status_reasons`:

  upload      unsupported_upload, archive_* (see services.adapters.archive), pickle_file, code_file,
              unexpected_file, duplicate_file, missing_file
  config      bad_config, custom_code, unsupported_peft_type, dora_unsupported, modules_to_save_unsupported,
              bias_unsupported, unsupported_feature, bad_rank, bad_alpha, rank_over_max,
              unknown_target_module, embedding_lora_unsupported, base_model_mismatch
  safetensors bad_header, oversize_header, bad_dtype, bad_offsets, overlapping_offsets, dtype_shape_mismatch
  tensors     empty_adapter, unexpected_tensor, shape_mismatch, rank_mismatch, duplicate_tensor,
              missing_tensor, nan_weights, content_mismatch

Nothing here imports torch or unpickles anything: the files are read as JSON and raw bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.adapters.archive import unpack
from services.adapters.base_model import BaseModel
from services.adapters.config import ArchiveLimits
from services.common.adapter_files import check_config_file, check_dir, check_weights
from services.common.lora_format import (
    AdapterConfig,
    AdapterFormatError,
    AdapterShape,
    content_id,
    find_non_finite,
    read_safetensors_header,
)


@dataclass(frozen=True, slots=True)
class ValidatedAdapter:
    dir: Path
    content_id: str
    config: AdapterConfig
    shape: AdapterShape
    ignored: tuple[str, ...] = ()


def reason(exc: AdapterFormatError) -> dict[str, str]:
    """A refusal as stored in `status_reasons`."""
    return {"code": exc.code, "message": exc.message}


def validate_upload(upload: Path, sandbox: Path, *, base: BaseModel, limits: ArchiveLimits,
                    expected_content_id: str | None = None) -> ValidatedAdapter:
    """An uploaded archive: unpack it safely into `sandbox`, then validate what came out."""
    unpacked = unpack(upload, sandbox, limits)
    v = validate_dir(unpacked.dir, base=base, expected_content_id=expected_content_id)
    return ValidatedAdapter(v.dir, v.content_id, v.config, v.shape, unpacked.ignored)


def validate_dir(adapter_dir: Path, *, base: BaseModel, expected_content_id: str | None = None) -> ValidatedAdapter:
    """A directory holding the two PEFT files (a stored version, or an unpacked upload). The rules are the
    engine loader's too (services.common.adapter_files)."""
    adapter_dir = Path(adapter_dir)
    config_path, weights_path = check_dir(adapter_dir)
    cfg = check_config_file(config_path, max_rank=base.max_lora_rank, accepts_base=base.accepts, base_name=base.name)
    header = read_safetensors_header(weights_path)
    shape = check_weights(header, weights_path.stat().st_size - 8 - _header_len(weights_path), cfg, base.dims)
    bad = find_non_finite(weights_path, header)
    if bad is not None:
        raise AdapterFormatError("nan_weights", f"tensor {bad!r} holds NaN or Inf values")
    cid = content_id(adapter_dir)
    if expected_content_id is not None and cid != expected_content_id:
        raise AdapterFormatError("content_mismatch", f"the stored files hash to {cid[:12]}…, not the version's {expected_content_id[:12]}…")
    return ValidatedAdapter(adapter_dir, cid, cfg, shape)


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")
