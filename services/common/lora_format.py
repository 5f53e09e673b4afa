"""The PEFT LoRA adapter format as Multiplex accepts it: config rules, tensor names, content ids.

Torch-free, so the gateway, the upload pipeline and the engine refuse the same things with the same
codes. Adapter files are data: safetensors and a JSON config only; nothing here executes them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MAX_HEADER_BYTES = 16 * 2**20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<which>A|B)(?:\.[\w-]+)?\.weight$"
)


class AdapterFormatError(ValueError):
    """A refused adapter: `code` is stable and machine-readable, `message` says what to fix."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.field = code, message, field


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    def rank_for(self, module_key: str) -> int:
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, module_key), self.r))

    def alpha_for(self, module_key: str) -> float:
        return float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_key), self.lora_alpha))

    def scale_for(self, module_key: str, rank: int) -> float:
        alpha = self.alpha_for(module_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])


def _pattern_key(patterns: dict[str, Any], key: str) -> str:
    # PEFT's rule: a pattern matches when it matches a dotted suffix of the module's full name.
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


def parse_config(raw: Any, *, max_rank: int | None = None) -> AdapterConfig:
    """Validate a parsed adapter_config.json. Every refusal names the field."""
    if not isinstance(raw, dict):
        raise AdapterFormatError("bad_config", "adapter_config.json must be a JSON object")
    if "auto_map" in raw or raw.get("trust_remote_code"):
        raise AdapterFormatError("custom_code", "adapter configs may not reference custom code (auto_map)", "auto_map")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterFormatError("unsupported_peft_type", f"peft_type {peft_type!r} is not LoRA", "peft_type")
    if raw.get("use_dora"):
        raise AdapterFormatError("dora_unsupported", "DoRA adapters are not supported", "use_dora")
    if raw.get("modules_to_save"):
        raise AdapterFormatError("modules_to_save_unsupported", "modules_to_save (full-weight copies) is not supported", "modules_to_save")
    if raw.get("bias", "none") != "none":
        raise AdapterFormatError("bias_unsupported", f"bias={raw.get('bias')!r}: only 'none' is supported", "bias")
    for name in ("trainable_token_indices", "layer_replication", "megatron_config"):
        if raw.get(name):
            raise AdapterFormatError("unsupported_feature", f"{name} is not supported", name)
    if raw.get("use_qalora") or raw.get("lora_bias"):
        raise AdapterFormatError("unsupported_feature", "QA-LoRA / lora_bias are not supported", "lora_bias")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterFormatError("bad_rank", f"r must be a positive integer, got {r!r}", "r")
    alpha = raw.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterFormatError("bad_alpha", f"lora_alpha must be a positive number, got {alpha!r}", "lora_alpha")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(str(t).split(".")[-1] for t in targets) - set(SUPPORTED_MODULES))
        if unknown:
            code = "embedding_lora_unsupported" if any(u in ("embed_tokens", "lm_head") for u in unknown) else "unknown_target_module"
            raise AdapterFormatError(code, f"target_modules {unknown} are not supported (supported: {list(SUPPORTED_MODULES)})", "target_modules")
        targets = tuple(str(t) for t in targets)
    elif not isinstance(targets, str):
        raise AdapterFormatError("unknown_target_module", "target_modules must be a list of module names or a regex", "target_modules")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(isinstance(v, int) and v > 0 for v in rank_pattern.values()):
        raise AdapterFormatError("bad_rank", "rank_pattern values must be positive integers", "rank_pattern")
    if not isinstance(alpha_pattern, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in alpha_pattern.values()):
        raise AdapterFormatError("bad_alpha", "alpha_pattern values must be positive numbers", "alpha_pattern")
    for pattern in (*rank_pattern, *alpha_pattern):
        try:
            re.compile(pattern)
        except re.error:
            raise AdapterFormatError("bad_config", f"invalid pattern {pattern!r}", "rank_pattern") from None
    cfg = AdapterConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=targets,
        rank_pattern=dict(rank_pattern),
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        base_model_name_or_path=raw.get("base_model_name_or_path"),
    )
    if max_rank is not None and cfg.max_rank > max_rank:
        raise AdapterFormatError("rank_over_max", f"rank {cfg.max_rank} exceeds this platform's maximum of {max_rank}", "r")
    return cfg


def read_config(adapter_dir: Path, *, max_rank: int | None = None) -> AdapterConfig:
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise AdapterFormatError("missing_file", f"{CONFIG_FILE} is missing", CONFIG_FILE)
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    return parse_config(raw, max_rank=max_rank)


@dataclass(frozen=True, slots=True)
class TensorKey:
    layer: int
    module: str  # one of SUPPORTED_MODULES
    which: str  # "A" or "B"
    module_key: str  # the module's name in the base model, as PEFT's rank/alpha patterns see it


@functools.lru_cache(maxsize=4096)
def parse_tensor_key(name: str) -> TensorKey:
    """The layer, module and A/B of a tensor name (cached: every adapter of a base model uses the same
    few hundred names, and the engine's loader parses each adapter's on every load); raises for others."""
    m = _KEY.match(name)
    if m is None:
        if "embed_tokens" in name or "lm_head" in name:
            raise AdapterFormatError("embedding_lora_unsupported", f"tensor {name!r}: embedding/lm_head LoRA is not supported")
        if "lora_magnitude_vector" in name:
            raise AdapterFormatError("dora_unsupported", f"tensor {name!r} is a DoRA magnitude vector")
        raise AdapterFormatError("unexpected_tensor", f"tensor {name!r} is not a LoRA A/B weight of a decoder layer")
    module = m["module"]
    if module not in SUPPORTED_MODULES or MODULE_GROUP[module] != m["group"]:
        raise AdapterFormatError("unknown_target_module", f"tensor {name!r} targets unsupported module {module!r}")
    layer = int(m["layer"])
    return TensorKey(layer, module, m["which"], f"model.layers.{layer}.{m['group']}.{module}")


class TensorInfo(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path, *, max_header: int = MAX_HEADER_BYTES) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header without loading any tensor."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = _header_length(head, size, max_header)
        return _parse_header(f.read(n), size)


def parse_safetensors_header(data: bytes, *, max_header: int = MAX_HEADER_BYTES) -> dict[str, TensorInfo]:
    """The same checks on a whole file already in memory (the engine's loader reads it once)."""
    n = _header_length(data[:8], len(data), max_header)
    return _parse_header(data[8 : 8 + n], len(data))


def _header_length(head: bytes, size: int, max_header: int) -> int:
    if len(head) < 8:
        raise AdapterFormatError("bad_header", "file is too short to be safetensors")
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > max_header or n > size - 8:
        raise AdapterFormatError("oversize_header", f"safetensors header length {n} is invalid for a {size}-byte file")
    return n


def _parse_header(raw: bytes, size: int) -> dict[str, TensorInfo]:
    n = len(raw)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterFormatError("bad_header", "safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise AdapterFormatError("bad_header", "safetensors header must be a JSON object")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, meta in header.items():  # the engine parses every adapter on every load: kept lean
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise AdapterFormatError("bad_header", f"tensor {name!r} has a malformed header entry") from None
        width = DTYPE_BYTES.get(dtype) if type(dtype) is str else None
        if width is None:
            raise AdapterFormatError("bad_dtype", f"tensor {name!r} has unsupported dtype {dtype!r}")
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise AdapterFormatError("bad_header", f"tensor {name!r} has a malformed shape or offsets")
            count *= d
        if type(start) is not int or type(end) is not int:
            raise AdapterFormatError("bad_header", f"tensor {name!r} has a malformed shape or offsets")
        if not 0 <= start <= end <= data_len:
            raise AdapterFormatError("bad_offsets", f"tensor {name!r} points outside the file ({start}..{end} of {data_len})")
        if count * width != end - start:
            raise AdapterFormatError("dtype_shape_mismatch", f"tensor {name!r}: {dtype}{list(shape)} needs {count * width} bytes, has {end - start}")
        spans.append((start, end, name))
        out[name] = TensorInfo(dtype, shape, start, end)
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise AdapterFormatError("overlapping_offsets", f"tensors {n0!r} and {n1!r} overlap")
    return out


def weights_sha256(adapter_dir: Path) -> str:
    h = hashlib.sha256()
    with open(Path(adapter_dir) / WEIGHTS_FILE, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_id(adapter_dir: Path) -> str:
    """The adapter's identity: sha256 over its weights and the config fields that change its output.

    Two adapters with the same weights but another alpha or rank pattern compute different things,
    so they must never share a prefix-cache entry; a renamed copy of the same adapter shares all.
    """
    return content_id_of(read_config(adapter_dir), weights_sha256(adapter_dir))


def content_id_of(cfg: AdapterConfig, weights_digest: str) -> str:
    """content_id from a parsed config and the weights file's sha256 hex digest."""
    effective = {
        "r": cfg.r, "lora_alpha": cfg.lora_alpha, "use_rslora": cfg.use_rslora,
        "rank_pattern": cfg.rank_pattern, "alpha_pattern": cfg.alpha_pattern,
    }
    h = hashlib.sha256()
    h.update(b"mplex-lora-v1\0")
    h.update(weights_digest.encode())
    h.update(json.dumps(effective, sort_keys=True).encode())
    return h.hexdigest()


# -- checks against a base model's dimensions (torch-free: the upload pipeline runs them on untrusted files) --
@dataclass(frozen=True, slots=True)
class BaseDims:
    """The base model's dimensions that decide every LoRA tensor's shape (from its HF config.json)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"base model {name} must be a positive integer, got {value!r}")

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> BaseDims:
        heads = int(raw["num_attention_heads"])
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        )

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> BaseDims:
        """From `base_models.params` (the same field names as this class)."""
        return cls(**{name: params[name] for name in cls.__slots__})

    def as_params(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-capable projection (the engine's module_dims)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True, slots=True)
class AdapterShape:
    """What validation learned about an adapter: stored once on its version."""

    rank: int  # the largest rank of any targeted module
    alpha: float
    target_modules: tuple[str, ...]  # modules that have tensors, in SUPPORTED_MODULES order
    num_layers: int  # layers with at least one LoRA pair
    num_parameters: int


def configured_modules(cfg: AdapterConfig) -> frozenset[str] | None:
    """The module names a list-valued target_modules selects; None for a regex (matched per tensor by PEFT)."""
    if isinstance(cfg.target_modules, str):
        return None
    return frozenset(t.split(".")[-1] for t in cfg.target_modules)


def check_tensors(header: dict[str, TensorInfo], cfg: AdapterConfig, dims: BaseDims) -> AdapterShape:
    """Every tensor is a float LoRA A/B weight of a targeted module of an existing layer, shaped for this
    base model and this config's rank, and every A has its B (the same rules as the engine's loader)."""
    if not header:
        raise AdapterFormatError("empty_adapter", "the adapter has no tensors")
    module_dims = dims.module_dims()
    targets = configured_modules(cfg)
    pairs: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    for name, info in header.items():
        key = parse_tensor_key(name)
        if key.layer >= dims.num_layers:
            raise AdapterFormatError("shape_mismatch", f"tensor {name!r} is for layer {key.layer}; the base model has {dims.num_layers} layers")
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterFormatError("bad_dtype", f"tensor {name!r} has non-float dtype {info.dtype}")
        if targets is not None and key.module not in targets:
            raise AdapterFormatError("unexpected_tensor", f"tensor {name!r} is for {key.module}, which target_modules does not list")
        rank = cfg.rank_for(key.module_key)
        d_in, d_out = module_dims[key.module]
        want = (rank, d_in) if key.which == "A" else (d_out, rank)
        if info.shape != want:
            features_ok = len(info.shape) == 2 and (info.shape[1] == d_in if key.which == "A" else info.shape[0] == d_out)
            code = "rank_mismatch" if features_ok else "shape_mismatch"
            raise AdapterFormatError(code, f"tensor {name!r} has shape {list(info.shape)}, expected {list(want)} for this base model")
        slot = pairs.setdefault((key.layer, key.module), {})
        if key.which in slot:
            raise AdapterFormatError("duplicate_tensor", f"two lora_{key.which} tensors for layer {key.layer} {key.module}")
        slot[key.which] = info
    for (layer, module), found in sorted(pairs.items()):
        if set(found) != {"A", "B"}:
            raise AdapterFormatError("missing_tensor", f"layer {layer} {module} has lora_{''.join(found)} but not its pair")
    present = {m for _, m in pairs}
    return AdapterShape(
        rank=max(info.shape[0] for found in pairs.values() for w, info in found.items() if w == "A"),
        alpha=cfg.lora_alpha,
        target_modules=tuple(m for m in SUPPORTED_MODULES if m in present),
        num_layers=len({layer for layer, _ in pairs}),
        num_parameters=sum(math.prod(info.shape) for info in header.values()),
    )


# Exponent-all-ones (NaN or Inf) masks per float dtype, read as little-endian unsigned integers.
_NONFINITE_MASKS = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000),
                    "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}


def find_non_finite(path: Path, header: dict[str, TensorInfo], *, chunk_elems: int = 1 << 22) -> str | None:
    """The first tensor holding a NaN or an Inf, by bit pattern (no float conversion, bounded memory)."""
    import numpy as np

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    base = 8 + n
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in sorted(header.items(), key=lambda kv: kv[1].start):
        if info.dtype not in _NONFINITE_MASKS or info.end == info.start:
            continue
        np_dtype, mask = _NONFINITE_MASKS[info.dtype]
        words = data[base + info.start: base + info.end].view(np.dtype(np_dtype))
        mask_arr = np.array(mask, dtype=words.dtype)
        for i in range(0, words.size, chunk_elems):
            part = words[i:i + chunk_elems]
            if np.any((part & mask_arr) == mask_arr):
                return name
    return None
