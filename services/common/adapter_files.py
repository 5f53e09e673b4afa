"""What an adapter directory may hold, and the checks on its bytes: one set of rules for the upload
validator (services/adapters) and the engine's loader (services/engine/lora), so a file one refuses the
other refuses too, with the same code.

Torch-free and execution-free: names and first bytes are judged (no pickles, no code), the config is JSON
read under a size cap (no keys that make Hugging Face libraries import code, the base model it names must be
ours), and the weights' safetensors header must tile its data exactly and describe LoRA tensors shaped for
the base model (lora_format.check_tensors). Finiteness is checked where the weights are read.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from services.common.lora_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterFormatError,
    AdapterShape,
    BaseDims,
    TensorInfo,
    check_tensors,
    parse_config,
)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz", ".dill")
CODE_SUFFIXES = (
    ".py", ".pyc", ".pyo", ".pyd", ".pyx", ".so", ".dylib", ".dll", ".exe", ".sh", ".bash", ".zsh", ".fish",
    ".bat", ".cmd", ".ps1", ".js", ".mjs", ".ts", ".rb", ".pl", ".php", ".lua", ".jar", ".class", ".wasm",
    ".ipynb", ".whl", ".egg", ".elf", ".o", ".a", ".app", ".msi", ".vbs", ".r", ".jl", ".go", ".c", ".cc", ".cpp",
)
# Harmless files people ship next to an adapter (PEFT's model card, tokenizer copies): skipped, never stored.
IGNORED_NAMES = ("readme", "license", "licence", "notice", ".gitattributes", ".gitignore", ".ds_store")
IGNORED_SUFFIXES = (".md", ".txt", ".json", ".jinja", ".model")
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
MAX_CONFIG_BYTES = 1 << 20
# Config keys that make Hugging Face libraries import or download code: refused anywhere in the config.
_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
# PEFT records the base model's class for AutoPeftModel and imports its module on load: only a
# transformers model module is acceptable there.
_AUTO_MAPPING_LIBRARY = re.compile(r"^transformers(\.[a-z0-9_]+)*$")
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


# -- names and first bytes --------------------------------------------------------------------------------
def classify(name: str) -> str:
    """'keep' (one of the two PEFT files), 'ignore', or raise the refusal code for this file name."""
    base = PurePosixPath(name).name
    lower = base.lower()
    if base in ADAPTER_FILES:
        return "keep"
    if lower.endswith(PICKLE_SUFFIXES) or lower in ("pytorch_model", "adapter_model"):
        raise AdapterFormatError("pickle_file", f"{name!r} looks like a pickle checkpoint; only {WEIGHTS_FILE} (safetensors) is accepted")
    if lower.endswith(CODE_SUFFIXES) or "." not in lower.lstrip("."):
        if lower not in IGNORED_NAMES and not lower.startswith(("license", "licence", "readme")):
            raise AdapterFormatError("code_file", f"{name!r} looks like code or an executable; adapters are data only")
    if lower.endswith(".safetensors"):
        raise AdapterFormatError("unexpected_file", f"{name!r}: the weights must be in a file named {WEIGHTS_FILE}")
    if lower in IGNORED_NAMES or lower.startswith(("license", "licence", "readme", "._")) or lower.endswith(IGNORED_SUFFIXES):
        return "ignore"
    raise AdapterFormatError("unexpected_file", f"{name!r} is not part of a PEFT adapter ({CONFIG_FILE} + {WEIGHTS_FILE})")


def sniff_content(name: str, head: bytes) -> None:
    """Content checks on a kept file's first (16) bytes: a pickle or an executable under an innocent name.
    A safetensors file is an 8-byte length then '{' (the length's own bytes may look like anything)."""
    if head[8:9] == b"{" or head[:1] == b"{":
        return
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise AdapterFormatError("pickle_file", f"{name!r} is a pickle, not safetensors")
    if head[:4] == b"PK\x03\x04":
        raise AdapterFormatError("pickle_file", f"{name!r} is a zip (a torch.save checkpoint?), not safetensors")
    if head[:4] == b"\x7fELF" or head[:2] in (b"#!", b"MZ"):
        raise AdapterFormatError("code_file", f"{name!r} is an executable")


def check_dir(adapter_dir: Path) -> tuple[Path, Path]:
    """A stored (or unpacked) adapter directory holds exactly the two PEFT files, as regular files whose
    first bytes are what their names say. Returns (config path, weights path)."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterFormatError("missing_file", f"adapter directory {adapter_dir} does not exist")
    for entry in sorted(adapter_dir.iterdir()):
        if entry.is_symlink() or not entry.is_file():
            raise AdapterFormatError("archive_special_file", f"{entry.name!r} is not a regular file")
        classify(entry.name)
        if entry.name not in ADAPTER_FILES:
            raise AdapterFormatError("unexpected_file", f"{entry.name!r} is not part of a PEFT adapter")
    paths = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
    for path in paths:
        if not path.is_file():
            raise AdapterFormatError("missing_file", f"{path.name} is missing", path.name)
        with open(path, "rb") as f:
            sniff_content(path.name, f.read(16))
    return paths


# -- the config ---------------------------------------------------------------------------------------------
def base_name_matcher(names: Iterable[str]) -> Callable[[str | None], bool]:
    """Whether an adapter's `base_model_name_or_path` names the base model known by `names` (a name, a path
    or its last component, compared case-insensitively); an adapter that names nothing is accepted."""
    accepted = frozenset(n.strip().rstrip("/").lower() for n in names if n)

    def accepts(name_or_path: str | None) -> bool:
        if not name_or_path:
            return True
        value = str(name_or_path).strip().rstrip("/").lower()
        return value in accepted or value.rsplit("/", 1)[-1] in accepted

    return accepts


def check_config_file(path: Path, *, max_rank: int, accepts_base: Callable[[str | None], bool],
                      base_name: str) -> AdapterConfig:
    """`check_config_bytes` on a file, never reading more than MAX_CONFIG_BYTES of it."""
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    return check_config_bytes(raw, max_rank=max_rank, accepts_base=accepts_base, base_name=base_name)


def check_config_bytes(raw: bytes, *, max_rank: int, accepts_base: Callable[[str | None], bool],
                       base_name: str) -> AdapterConfig:
    """The adapter config: JSON under MAX_CONFIG_BYTES, no code references, supported PEFT features, within
    the rank limit, for this base model (`base_name` is what the refusal calls it)."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterFormatError("bad_config", f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterFormatError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    found = _find_code_key(parsed)
    if found:
        raise AdapterFormatError("custom_code", f"adapter configs may not reference custom code ({found})", found)
    mapping = parsed.get("auto_mapping") if isinstance(parsed, dict) else None
    if mapping and not (isinstance(mapping, dict) and set(mapping) <= {"base_model_class", "parent_library"}
                        and _AUTO_MAPPING_LIBRARY.match(str(mapping.get("parent_library", "")))
                        and _CLASS_NAME.match(str(mapping.get("base_model_class", "")))):
        raise AdapterFormatError("custom_code", "auto_mapping may only name a transformers model class", "auto_mapping")
    cfg = parse_config(parsed, max_rank=max_rank)
    if not accepts_base(cfg.base_model_name_or_path):
        raise AdapterFormatError(
            "base_model_mismatch",
            f"the adapter was trained for {cfg.base_model_name_or_path!r}; this platform serves {base_name!r}",
            "base_model_name_or_path",
        )
    return cfg


def _find_code_key(value: Any, path: str = "", depth: int = 0) -> str | None:
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


# -- the weights --------------------------------------------------------------------------------------------
def check_weights(header: dict[str, TensorInfo], data_len: int, cfg: AdapterConfig, dims: BaseDims) -> AdapterShape:
    """The safetensors tensors tile the `data_len` bytes after the header exactly (nothing hidden between or
    after them) and are the LoRA pairs of targeted modules, shaped for this base model and config."""
    covered = sorted((info.start, info.end) for info in header.values())
    cursor = 0
    for start, end in covered:
        if start != cursor:
            raise AdapterFormatError("bad_offsets", f"the data region has {start - cursor} bytes no tensor describes at offset {cursor}")
        cursor = end
    if cursor != data_len:
        raise AdapterFormatError("bad_offsets", f"the data region has {data_len - cursor} trailing bytes no tensor describes")
    return check_tensors(header, cfg, dims)
