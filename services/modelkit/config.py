"""The demo kit's hyper-parameters: frozen dataclasses, validated on construction, hashed into the build key."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.modelkit.corpus import ADAPTER_TASKS

DRAFT_DIR = "draft"  # the draft model's directory in a built kit (modelkit/draft.py writes it)
LORA_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class KitConfigError(ValueError):
    """A demo-kit hyper-parameter is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise KitConfigError("steps and batch_size must be >= 1")
        if not 0 < self.lr < 1:
            raise KitConfigError(f"lr={self.lr} must be in (0, 1)")
        if not 0 <= self.warmup_steps < self.steps:
            raise KitConfigError("warmup_steps must be in [0, steps)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise KitConfigError("min_lr_ratio must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    vocab_size: int = 1536
    min_frequency: int = 20  # merges rarer than this stay split (keeps emoji as partial-byte tokens)
    corpus_examples: int = 20_000

    def __post_init__(self) -> None:
        if not 300 <= self.vocab_size <= 65_536:
            raise KitConfigError(f"tokenizer vocab_size={self.vocab_size} must be in [300, 65536]")


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10_000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise KitConfigError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise KitConfigError("num_heads must be a multiple of num_kv_heads")
        if self.max_position_embeddings < 512:
            raise KitConfigError("max_position_embeddings must be >= 512")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    task: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    train: TrainConfig
    use_rslora: bool = False
    # PEFT per-module overrides; tuples of (module-name pattern, value) so the spec stays hashable.
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.task not in ADAPTER_TASKS:
            raise KitConfigError(f"adapter {self.name!r}: unknown task {self.task!r}")
        if self.rank < 1:
            raise KitConfigError(f"adapter {self.name!r}: rank must be >= 1")
        unknown = set(self.target_modules) - LORA_TARGETS
        if not self.target_modules or unknown:
            raise KitConfigError(f"adapter {self.name!r}: bad target_modules {sorted(unknown) or '(empty)'}")


@dataclass(frozen=True, slots=True)
class DraftSpec:
    """The speculative-decoding draft model (draft.py): the base model's first `num_layers` layers, trained."""

    num_layers: int
    train: TrainConfig

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise KitConfigError("the draft model needs at least one layer")


@dataclass(frozen=True, slots=True)
class KitConfig:
    model_name: str = "mplex-demo"
    seed: int = 0
    threads: int = 2  # fixed, so fp32 reductions (and so the weights) do not depend on the machine's cores
    # Adapters train in parallel processes of `adapter_threads` threads each: their small matmuls scale
    # better over processes than over threads. Both are fixed for the same reason as `threads`.
    adapter_workers: int = 2
    adapter_threads: int = 1
    eval_size: int = 40
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelShape = field(default_factory=ModelShape)
    # 900 steps: the `tools` task (a quarter of the stream, its prompts ~130 tokens with the tools block) joined the
    # base tasks; at 900 the base eval rose (0.775 -> 0.825) and the held-out tool decisions are all right.
    base_train: TrainConfig = TrainConfig(steps=900, batch_size=64, lr=3e-3, warmup_steps=40)
    adapters: tuple[AdapterSpec, ...] = ()
    draft: DraftSpec | None = None

    def __post_init__(self) -> None:
        if self.draft is not None and self.draft.num_layers >= self.model.num_layers:
            raise KitConfigError("the draft model must have fewer layers than the base model")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise KitConfigError(f"adapter names must be unique: {names}")
        if min(self.threads, self.adapter_workers, self.adapter_threads, self.eval_size) < 1:
            raise KitConfigError("threads, adapter_workers, adapter_threads and eval_size must be >= 1")


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

# Five adapters that differ in everything the engine has to get right: rank, targets, alpha,
# rsLoRA scaling and per-module rank/alpha overrides.
DEMO_ADAPTERS = (
    AdapterSpec(
        name="reverse", task="reverse", rank=16, lora_alpha=32, target_modules=_ATTN + _MLP,
        train=TrainConfig(steps=800, batch_size=48, lr=5e-3, warmup_steps=20),
    ),
    AdapterSpec(
        # No gate_proj: a target set that differs from every other adapter's.
        name="uppercase", task="uppercase", rank=8, lora_alpha=16, target_modules=_ATTN + ("up_proj", "down_proj"),
        train=TrainConfig(steps=1000, batch_size=48, lr=5e-3, warmup_steps=20),
    ),
    AdapterSpec(
        name="sort", task="sort", rank=32, lora_alpha=64, target_modules=_ATTN + _MLP, use_rslora=True,
        train=TrainConfig(steps=600, batch_size=48, lr=2e-3, warmup_steps=20),
    ),
    AdapterSpec(
        # No k_proj, and PEFT's per-module overrides: down_proj gets rank 8 and alpha 32.
        name="opposites", task="opposites", rank=4, lora_alpha=8,
        target_modules=("q_proj", "v_proj", "o_proj") + _MLP,
        rank_pattern=(("down_proj", 8),), alpha_pattern=(("down_proj", 32),),
        train=TrainConfig(steps=800, batch_size=48, lr=5e-3, warmup_steps=20),
    ),
    AdapterSpec(
        # Attention only: copying a span is attention's work (the base copies lists; this adapter points it at
        # a record's note). The kit's copy-heavy task, where prompt-lookup speculation pays (bench/spec_bench.py).
        name="extract", task="extract", rank=16, lora_alpha=32, target_modules=_ATTN,
        train=TrainConfig(steps=600, batch_size=48, lr=5e-3, warmup_steps=20),
    ),
)

# 200 steps: the first layer of the base alone already agrees with it on most base-chat tokens; training
# brings repeats and counts (README, "The demo model kit").
DEMO_DRAFT = DraftSpec(num_layers=1, train=TrainConfig(steps=200, batch_size=64, lr=2e-3, warmup_steps=20))

DEMO_CONFIG = KitConfig(adapters=DEMO_ADAPTERS, draft=DEMO_DRAFT)
