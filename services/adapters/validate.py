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

import json
import re
from dataclasses import dataclass
from pathlib import Path

from services.adapters.archive import classify, sniff_content, unpack
from services.adapters.base_model import BaseModel
from services.adapters.config import ArchiveLimits
from services.common.lora_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterFormatError,
    AdapterShape,
    check_data_coverage,
    check_tensors,
    content_id,
    find_non_finite,
    parse_config,
    read_safetensors_header,
)

MAX_CONFIG_BYTES = 1 << 20
# Config keys that make Hugging Face libraries import or download code: refused anywhere in the config.
_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
# PEFT records the base model's class for AutoPeftModel and imports its module on load: only a
# transformers model module is acceptable there.
_AUTO_MAPPING_LIBRARY = re.compile(r"^transformers(\.[a-z0-9_]+)*$")
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


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
    """A directory holding the two PEFT files (a stored version, or an unpacked upload)."""
    adapter_dir = Path(adapter_dir)
    for entry in sorted(adapter_dir.iterdir()):
        if entry.is_symlink() or not entry.is_file():
            raise AdapterFormatError("archive_special_file", f"{entry.name!r} is not a regular file")
        classify(entry.name)
        if entry.name not in (CONFIG_FILE, WEIGHTS_FILE):
            raise AdapterFormatError("unexpected_file", f"{entry.name!r} is not part of a PEFT adapter")
    config_path, weights_path = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterFormatError("missing_file", f"{path.name} is missing", path.name)
        with open(path, "rb") as f:
            sniff_content(path.name, f.read(16))
    cfg = check_config(config_path, base=base)
    header = read_safetensors_header(weights_path)
    check_data_coverage(header, weights_path.stat().st_size - 8 - _header_len(weights_path))
    shape = check_tensors(header, cfg, base.dims)
    bad = find_non_finite(weights_path, header)
    if bad is not None:
        raise AdapterFormatError("nan_weights", f"tensor {bad!r} holds NaN or Inf values")
    cid = content_id(adapter_dir)
    if expected_content_id is not None and cid != expected_content_id:
        raise AdapterFormatError("content_mismatch", f"the stored files hash to {cid[:12]}…, not the version's {expected_content_id[:12]}…")
    return ValidatedAdapter(adapter_dir, cid, cfg, shape)


def check_config(path: Path, *, base: BaseModel) -> AdapterConfig:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterFormatError("bad_config", f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterFormatError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    found = _find_code_key(raw)
    if found:
        raise AdapterFormatError("custom_code", f"adapter configs may not reference custom code ({found})", found)
    mapping = raw.get("auto_mapping") if isinstance(raw, dict) else None
    if mapping and not (isinstance(mapping, dict) and set(mapping) <= {"base_model_class", "parent_library"}
                        and _AUTO_MAPPING_LIBRARY.match(str(mapping.get("parent_library", "")))
                        and _CLASS_NAME.match(str(mapping.get("base_model_class", "")))):
        raise AdapterFormatError("custom_code", "auto_mapping may only name a transformers model class", "auto_mapping")
    cfg = parse_config(raw, max_rank=base.max_lora_rank)
    if not base.accepts(cfg.base_model_name_or_path):
        raise AdapterFormatError(
            "base_model_mismatch",
            f"the adapter was trained for {cfg.base_model_name_or_path!r}; this platform serves {base.name!r}",
            "base_model_name_or_path",
        )
    return cfg


def _find_code_key(value, path: str = "", depth: int = 0) -> str | None:
    """The dotted path of the first key that asks for code (a non-empty auto_map etc.), at any depth."""
    if depth > 32:
        return path or "config"
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if key in _CODE_KEYS and item:
                return here
            found = _find_code_key(item, here, depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_code_key(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
    return None


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")
