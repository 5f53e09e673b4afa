"""Engine configuration: one frozen dataclass per component, validated when built."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.lora_format import BaseDims

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported (supported: {sorted(_ROPE_TYPES)})"
            )
        if self.theta <= 0:
            raise ConfigError("rope_theta must be > 0")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's shape, read from a Hugging Face `config.json`."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")

    def base_dims(self) -> BaseDims:
        """The dimensions adapter files are checked against (the same rule object as upload validation)."""
        return BaseDims(self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads, self.num_kv_heads,
                        self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_hf(raw, gen)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
        if arch is None:
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(raw.get("model_type", ""))
        if arch is None:
            raise ConfigError(f"architectures={archs!r}: only Llama, Mistral and Qwen2 decoders are supported")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        eos: list[int] = []
        for src in (generation or {}, raw):
            val = src.get("eos_token_id")
            if val is not None:
                eos = list(val) if isinstance(val, list) else [val]
                break
        window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "mistral") else None
        return cls(
            arch=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope=_rope_from_hf(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos),
        )


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("rope partial_rotary_factor != 1 is not supported")
    known = {f for f in RopeConfig.__slots__ if f not in ("theta", "rope_type")}
    kwargs = {k: v for k, v in params.items() if k in known and v is not None}
    if rope_type in ("yarn",) and "original_max_position_embeddings" not in kwargs:
        kwargs["original_max_position_embeddings"] = raw.get("max_position_embeddings")
    return RopeConfig(theta=float(theta), rope_type=rope_type, **kwargs)


SWAP_SPACE_AUTO_MAX = 4 * 2**30  # vLLM's default swap space per GPU
KV_DTYPES = ("auto", "fp8")
KV_SCALE_DTYPE = torch.float32  # fp8 KV: one scale per (block, kv head), for K and for V


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks; capacity from `num_blocks` or from a memory budget.

    kv_dtype "auto" stores K/V in the model's compute dtype; "fp8" stores float8_e4m3fn with a scale per
    (block, kv head) (kernels/kv_fp8.py): about 2x the tokens of bf16 in the same memory."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    # The host tier preempted sequences are swapped to (kv/host_pool.py): None = as many blocks as the
    # device pool, at most SWAP_SPACE_AUTO_MAX bytes (host pages are touched only when used); 0 = off
    # (preemption always recomputes).
    swap_space_bytes: int | None = None
    # How a preempted sequence gives back its KV: "auto" = swap or recompute, whichever the running cost
    # estimates say is cheaper (preemption.py); "swap" = swap whenever the host tier has room;
    # "recompute" = always recompute (as with no host tier). Forcing is for tests and benchmarks.
    preemption_mode: str = "auto"
    # Requests with the same prompt and cache extra (n > 1 choices, identical concurrent prompts) fork
    # one running request's prompt blocks copy-on-write instead of each computing them (forks.py).
    enable_prompt_sharing: bool = True
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError("num_blocks must be >= 2")
        if self.memory_bytes <= 0:
            raise ConfigError("memory_bytes must be > 0")
        if self.swap_space_bytes is not None and self.swap_space_bytes < 0:
            raise ConfigError("swap_space_bytes must be >= 0 (0 = no host tier)")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ConfigError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (fp8 = e4m3 with per-block, "
                              f"per-kv-head scales), got {self.kv_dtype!r}")

    def resolve_num_host_blocks(self, block_bytes: int, num_device_blocks: int) -> int:
        if self.swap_space_bytes is None:
            return min(num_device_blocks, SWAP_SPACE_AUTO_MAX // block_bytes)
        return self.swap_space_bytes // block_bytes

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype K/V are stored in, for a model computing in `dtype`."""
        return torch.float8_e4m3fn if self.is_fp8 else dtype

    def bytes_per_block(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V, scales included."""
        per_cache = self.block_size * model.kv_size * self.storage_dtype(dtype).itemsize
        if self.is_fp8:
            per_cache += model.num_kv_heads * KV_SCALE_DTYPE.itemsize
        return 2 * model.num_layers * per_cache

    def resolve_num_blocks(self, model: ModelConfig, dtype: torch.dtype) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        blocks = self.memory_bytes // self.bytes_per_block(model, dtype)
        if blocks < 2:
            raise ConfigError(f"memory_bytes={self.memory_bytes} holds fewer than 2 KV blocks")
        return int(blocks)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    chunked_prefill: bool = True
    # A request whose adapter cannot get a device slot for this many steps has one pinned slot drained
    # for it (no new sequences join it), so it gets one (no starvation under skewed popularity) while the
    # other slots keep batching.
    lora_starvation_steps: int = 16
    # "fair": inside a priority class, tenants share the batch by weight (fair_queue.py); "fcfs": arrival order.
    policy: str = "fair"
    # Overload (admission.py): a request whose estimated time to first token exceeds its class's budget is
    # refused at once (503 engine_overloaded + Retry-After) instead of waiting it out; None = never.
    interactive_ttft_slo_s: float | None = 2.0
    batch_ttft_slo_s: float | None = 600.0
    # Under sustained overload (interactive requests have waited, or been refused, within the last
    # `overload_window_s`), batch-class requests admitted get at most this many new tokens (reported).
    batch_max_tokens_under_overload: int | None = 256
    overload_window_s: float = 5.0
    # A request is admitted when its estimated TTFT is within this fraction of its budget: the rest is
    # for what the estimate does not see (the gateway's hop, prefill beside other work, estimate error).
    admission_headroom: float = 0.6
    # A step's lower-class (batch) prompt work, chunks included, is at most this many tokens (None: the
    # whole budget), so the step an arriving interactive request waits out is short (class_yield.py).
    lower_class_prefill_tokens: int | None = 128
    # ... and at most what this many seconds of compute buy by the fitted step cost (step_time.py), so on a
    # slow device the step an interactive arrival waits out stays short (class_yield.py). None: tokens only.
    lower_class_prompt_s: float | None = None
    # A wall-time target per step (step_time.py): prompt work is capped at what the fitted step cost leaves
    # beside the decodes, so a request arriving mid-step waits out a short step. None: the token budget only.
    max_step_s: float | None = None

    def __post_init__(self) -> None:
        if self.lower_class_prefill_tokens is not None and self.lower_class_prefill_tokens <= 0:
            raise ConfigError("lower_class_prefill_tokens must be > 0 or None")
        if self.max_step_s is not None and not self.max_step_s > 0:
            raise ConfigError("max_step_s must be > 0 or None")
        if self.lower_class_prompt_s is not None and not self.lower_class_prompt_s > 0:
            raise ConfigError("lower_class_prompt_s must be > 0 or None")
        if self.policy not in ("fair", "fcfs"):
            raise ConfigError(f"policy must be fair or fcfs, got {self.policy!r}")
        for name in ("interactive_ttft_slo_s", "batch_ttft_slo_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 or None")
        if not 0 < self.admission_headroom <= 1:
            raise ConfigError("admission_headroom must be in (0, 1]")
        if self.batch_max_tokens_under_overload is not None and self.batch_max_tokens_under_overload <= 0:
            raise ConfigError("batch_max_tokens_under_overload must be > 0 or None")
        if self.max_num_seqs <= 0:
            raise ConfigError("max_num_seqs must be > 0")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("max_num_batched_tokens must be > 0")
        if not self.chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked_prefill, max_num_batched_tokens must be >= max_model_len")


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """Adapter tiers: device slots (stacked weights) and a host-memory LRU."""

    max_loras: int = 8
    max_cpu_loras: int = 64
    max_lora_rank: int = 64
    enabled: bool = True
    # CPU only: "native" = the C SGMV kernel (kernels/sgmv_native.py, fp32), "torch" = batched torch ops
    # (kernels/sgmv_cpu.py), "auto" = native when it builds here and the dtype is fp32, else torch.
    cpu_kernel: str = "auto"
    # True: a local adapter is read on the step thread when first needed, so which step finds it resident does
    # not depend on the loader thread's timing (tests whose workloads must preempt, or speculate, the same way on
    # a loaded machine as on an idle one). Serving keeps loads off the step loop: False.
    inline_loads: bool = False

    def __post_init__(self) -> None:
        if self.cpu_kernel not in ("auto", "native", "torch"):
            raise ConfigError(f"lora cpu_kernel must be auto, native or torch, got {self.cpu_kernel!r}")
        if self.max_loras <= 0 or self.max_cpu_loras < self.max_loras:
            raise ConfigError("need max_loras > 0 and max_cpu_loras >= max_loras")
        if not 0 < self.max_lora_rank <= 512:
            raise ConfigError("max_lora_rank must be in 1..512")


DRAFTERS = ("ngram", "draft_model")
SPEC_METHODS = ("off",) + DRAFTERS + ("auto",)
SPEC_BASE_KEY = "base"


def spec_key(adapter) -> str:
    """What a speculation verdict enables: the base model, or an adapter by content (never by name). The gate
    writes verdicts under these keys and the controller looks drafters up by them (SpeculativeConfig.drafter_for)."""
    return SPEC_BASE_KEY if adapter is None else adapter.content_id


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (services/engine/spec/): a drafter proposes up to `num_speculative_tokens` tokens per
    decoding sequence and the same forward verifies them. Off by default; the controller sizes each
    sequence's draft from its measured acceptance and shrinks it as the batch fills (`max_running`: no
    speculation from that many running sequences on, nor while requests wait for admission)."""

    # "off" | "ngram" (prompt lookup) | "draft_model" (a small model, `draft_model`) | "auto" (both loaded; each
    # base model / adapter gets its own drafter: `drafters`, else the draft model for the base and prompt
    # lookup for adapters, whose tasks the draft model was not trained on).
    method: str = "off"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: Path | None = None  # HF checkpoint of the draft model; same tokenizer (vocabulary) as the target
    # A draft token at depth j is proposed while its estimated chance of acceptance (rate ** j) is at least
    # the controller's cost-model bar (spec/controller.py), and never below this floor.
    accept_threshold: float = 0.2
    max_running: int = 32
    # False: draft lengths from acceptance alone, with no measured-cost or payoff gating (tests, benchmarks
    # of the mechanism); max_running and waiting requests still turn speculation off.
    adaptive_to_load: bool = True
    # Where speculation is on: "base" and adapter content ids that passed the gate (spec/gate.py); None = all.
    enabled_for: tuple[str, ...] | None = None
    # "auto": (key, drafter) pairs the gates chose (the drafter with the higher measured gain per key).
    drafters: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if self.method in ("draft_model", "auto") and self.draft_model is None:
            raise ConfigError(f"speculative method {self.method} needs a draft_model checkpoint")
        if any(m not in DRAFTERS for _, m in self.drafters):
            raise ConfigError(f"speculative drafters must be {' or '.join(DRAFTERS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in 1..16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16")
        if not 0 < self.accept_threshold < 1:
            raise ConfigError("accept_threshold must be in (0, 1)")
        if self.max_running < 1:
            raise ConfigError("max_running must be >= 1")

    def drafter_for(self, key: str) -> str | None:
        """The drafter of a sequence of the base model ("base") or an adapter (its content id); None: no
        speculation for it."""
        if self.method == "off" or (self.enabled_for is not None and key not in self.enabled_for):
            return None
        if self.method != "auto":
            return self.method
        return dict(self.drafters).get(key, "draft_model" if key == SPEC_BASE_KEY else "ngram")

    @property
    def drafter_names(self) -> tuple[str, ...]:
        """The drafters this configuration loads."""
        return {"off": (), "auto": DRAFTERS}.get(self.method, (self.method,))

    @property
    def enabled(self) -> bool:
        return self.method != "off"


FAILPOINTS = ("step_error", "crash")
TP_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism (services/engine/parallel/): one base model sharded Megatron-style over
    `tensor_parallel_size` processes, rank 0 being the engine core. backend "auto" = NCCL on CUDA, gloo on
    the CPU. A collective that waits longer than `collective_timeout_s` (a rank died or hangs) fails, and
    the engine goes dead instead of hanging."""

    tensor_parallel_size: int = 1
    backend: str = "auto"
    collective_timeout_s: float = 60.0
    # Joining the group and loading the shards (minutes for a large model, not the same on every rank).
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ConfigError(f"tensor_parallel_size must be in 1..64, got {self.tensor_parallel_size}")
        if self.backend not in TP_BACKENDS:
            raise ConfigError(f"tensor parallel backend must be one of {', '.join(TP_BACKENDS)}, got {self.backend!r}")
        if not self.collective_timeout_s > 0 or not self.startup_timeout_s > 0:
            raise ConfigError("collective_timeout_s and startup_timeout_s must be > 0")

    def check_model(self, model: ModelConfig) -> None:
        """Refuse a size the model's shapes do not split into: every rank holds whole attention heads and
        whole KV heads (GQA groups stay on one rank) and an equal part of the MLP. The vocabulary need not
        divide: its last shard is padded (as vLLM pads), and the padding never reaches the sampler."""
        n = self.tensor_parallel_size
        for name, value in (("num_attention_heads", model.num_heads), ("num_key_value_heads", model.num_kv_heads),
                            ("intermediate_size", model.intermediate_size)):
            if value % n:
                raise ConfigError(f"tensor_parallel_size={n} does not divide the model's {name}={value}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: Path
    served_model_name: str | None = None
    dtype: str = "float32"
    weight_dtype: str = "auto"  # "auto" = same as dtype; "fp8" = float8_e4m3fn weights with per-channel scales
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = 0
    engine_id: str = "engine-0"
    adapter_cache_dir: Path | None = None  # where adapters fetched from remote storage are kept
    # Object stores (settings.storage_url) a request may name adapter files in (server: lora/sources.py);
    # with none, only the adapter cache. Engines built in-process take AdapterRefs without this check.
    adapter_stores: tuple[str, ...] = ()
    # The names an adapter's base_model_name_or_path may give for this model, as the upload validator
    # accepts them (services.common.adapter_files.base_name_matcher); None: not checked (offline use).
    adapter_base_names: tuple[str, ...] | None = None
    # CPU only: decode attention by "native" = the C paged kernel (kernels/attention_native.py, fp32),
    # "torch" = gather + SDPA, "auto" = native when it builds here and the dtype and shapes fit, else torch.
    cpu_attention: str = "auto"
    # CPU only: fp32 projections also held prepacked for oneDNN where it pays on this machine -- both paths timed at
    # load, per projection shape, the packed weight used from the fewest rows where it won (model/layers.py,
    # Linear.pack): 1.6-2.4x torch's default fp32 GEMM from 64 rows on an AVX-512 VM, a tie on an AVX2 one
    # (bench/gemm_bench.py); where packed, at twice the weights' bytes. False: F.linear only, nothing measured.
    cpu_packed_gemm: bool = True
    # Failpoints for fault-isolation and chaos tests (never in prod; the CLI refuses them there): a step
    # whose sequences hold the token id of `step_error` raises in the forward, of `crash` kills the
    # process as a native kernel fault would. See FAILPOINTS.
    failpoints: tuple[tuple[str, int], ...] = ()
    # Async scheduling (overlap.py): schedule and build step N+1's inputs while step N's forward runs on a
    # worker thread, and post-process step N during step N+1's forward. Token-identical outputs either way.
    async_scheduling: bool = False
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        for name, _ in self.failpoints:
            if name not in FAILPOINTS:
                raise ConfigError(f"unknown failpoint {name!r}; known: {', '.join(FAILPOINTS)}")
        if self.cpu_attention not in ("auto", "native", "torch"):
            raise ConfigError(f"cpu_attention must be auto, native or torch, got {self.cpu_attention!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}")
        if self.weight_dtype not in ("auto", "fp8"):
            raise ConfigError("weight_dtype must be 'auto' or 'fp8'")
        if not (Path(self.model_dir) / "config.json").exists():
            raise ConfigError(f"model_dir {self.model_dir} has no config.json")
        if self.async_scheduling and self.speculative.enabled:
            # A verified draft decides how many tokens a row keeps only after its step: the next step cannot be
            # planned during the forward (vLLM v1 refused the pair at first for the same reason).
            raise ConfigError("async_scheduling cannot be combined with speculative decoding; choose one")
        if self.parallel.tensor_parallel_size > 1:
            # The step broadcast (parallel/step_io.py) carries neither draft tokens nor placeholder fills yet.
            if self.speculative.enabled or self.async_scheduling:
                raise ConfigError("tensor_parallel_size > 1 cannot be combined with speculative decoding or "
                                  "async_scheduling yet")
            self.parallel.check_model(ModelConfig.from_dir(Path(self.model_dir)))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name
