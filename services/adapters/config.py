"""The adapter pipeline's knobs: upload and archive limits, quality-gate defaults, how engines serve.

One frozen config, validated on construction. `from_env()` reads `MPLEX_ADAPTERS_*` (e.g.
`MPLEX_ADAPTERS_MAX_UPLOAD_BYTES`), so the gateway, the workers and the CLI of one deployment agree.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

GATE_METRICS = ("exact_match", "rouge_l", "token_f1")


@dataclass(frozen=True, slots=True)
class ArchiveLimits:
    """Caps that make a hostile archive cost a bounded amount of work before it is refused."""

    max_upload_bytes: int = 1 << 30  # the request body (archive or the two files)
    max_unpacked_bytes: int = 2 << 30  # total bytes an archive may expand to
    max_files: int = 64  # archive members, directories included
    max_ratio: float = 100.0  # uncompressed / compressed; a LoRA's float weights compress ~1.1x
    ratio_floor_bytes: int = 1 << 20  # below this many unpacked bytes the ratio is not judged (tiny files compress well)

    def __post_init__(self) -> None:
        if min(self.max_upload_bytes, self.max_unpacked_bytes, self.max_files, self.ratio_floor_bytes) <= 0:
            raise ValueError("archive limits must be > 0")
        if self.max_ratio < 1:
            raise ValueError("max_ratio must be >= 1")


@dataclass(frozen=True, slots=True)
class GateDefaults:
    """The quality gate's thresholds when an upload names none, and how much of an eval set it runs
    (docs/adapters.md, "Quality gate", says why each default is what it is)."""

    metric: str = "rouge_l"  # the similarity both quality checks are measured in (see services.adapters.scoring)
    min_margin: float = 0.05  # with a task eval set: adapter score - base score must be at least this
    # Without one: on the base-capability set, the one-sided upper confidence bound of the mean per-item drop
    # (base score - adapter score) must be at most `max_regression`.
    max_regression: float = 0.05
    regression_confidence: float = 0.95
    max_malformed_rate: float = 0.02  # outputs newly empty / undecodable / looping, as a share of the items
    min_fp8_agreement: float = 0.90  # greedy tokens of the served (FP8) adapter that match full precision
    max_examples: int = 64  # a task eval set is sampled (deterministically) down to this many items
    base_max_examples: int = 200  # the base-capability set likewise
    min_base_examples: int = 100  # fewer usable base-capability items than this: the gate cannot judge
    base_eval_set: str = ""  # a JSONL base-capability set for this deployment's base model ("" = the bundled one)
    max_new_tokens: int = 48
    latency_samples: int = 3  # single requests timed with and without the adapter

    def __post_init__(self) -> None:
        if self.metric not in GATE_METRICS:
            raise ValueError(f"gate metric must be one of {GATE_METRICS}")
        if not -1 <= self.min_margin <= 1:
            raise ValueError("min_margin must be in [-1, 1]")
        if not 0 <= self.min_fp8_agreement <= 1:
            raise ValueError("min_fp8_agreement must be in [0, 1]")
        if not 0 <= self.max_regression <= 1 or not 0 <= self.max_malformed_rate <= 1:
            raise ValueError("max_regression and max_malformed_rate must be in [0, 1]")
        if not 0.5 <= self.regression_confidence < 1:
            raise ValueError("regression_confidence must be in [0.5, 1)")
        if self.max_examples < 1 or self.max_new_tokens < 1 or self.latency_samples < 0:
            raise ValueError("max_examples and max_new_tokens must be >= 1, latency_samples >= 0")
        if not 2 <= self.min_base_examples <= self.base_max_examples:
            raise ValueError("min_base_examples must be in [2, base_max_examples]")

    def thresholds(self, *, min_margin: float | None = None, min_fp8_agreement: float | None = None,
                   metric: str | None = None, **rest: float | None) -> dict[str, Any]:
        """The gate config stored on a version at upload: the caller's values over these defaults."""
        chosen = dataclasses.replace(
            self,
            min_margin=self.min_margin if min_margin is None else float(min_margin),
            min_fp8_agreement=self.min_fp8_agreement if min_fp8_agreement is None else float(min_fp8_agreement),
            metric=metric or self.metric,
            **{k: float(v) for k, v in rest.items() if v is not None},
        )
        return {"metric": chosen.metric, "min_margin": chosen.min_margin, "min_fp8_agreement": chosen.min_fp8_agreement,
                "max_regression": chosen.max_regression, "regression_confidence": chosen.regression_confidence,
                "max_malformed_rate": chosen.max_malformed_rate}


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    archive: ArchiveLimits = ArchiveLimits()
    gate: GateDefaults = GateDefaults()
    max_eval_set_bytes: int = 8 << 20
    max_eval_items: int = 5000
    # How engines serve adapters: the gate scores the adapter on this base ("fp8" = FP8 weights), and
    # compares it with full precision for the FP8-agreement check.
    serve_weight_dtype: str = "fp8"
    compute_dtype: str = "float32"
    max_lora_rank: int = 64  # the engines' LoraConfig.max_lora_rank (a base model row may lower it)
    max_eval_attempts: int = 3  # a gate run that breaks (not the adapter) is retried as a new attempt
    max_deliveries: int = 3  # a task whose worker process died this often (OOM, a crash) refuses its version
    stalled_after_s: float = 900.0  # a version with no progress this long is re-enqueued by the sweeper
    retired_window_s: float = 86_400.0  # how long a deleted adapter's content id stays in the retired set
    accepted_base_names: tuple[str, ...] = ()  # extra base_model_name_or_path values accepted as ours
    # Storage hygiene (services.adapters.retention, docs/adapters.md "Storage"): files of rejected versions and
    # of deleted adapters are removed this long after the rejection / deletion (a rejected version can be
    # overridden until then), objects no version references after a grace period that covers an upload's
    # write-then-commit, and leftover temporary files / sandboxes after the longest upload or ingest.
    rejected_retention_s: float = 7 * 86_400.0
    deleted_retention_s: float = 7 * 86_400.0
    orphan_grace_s: float = 3_600.0
    staging_max_age_s: float = 6 * 3_600.0
    storage_quota_bytes: int = 10 << 30  # per tenant, unless its tenant_limits row says otherwise

    def __post_init__(self) -> None:
        if self.serve_weight_dtype not in ("auto", "fp8"):
            raise ValueError("serve_weight_dtype must be 'auto' or 'fp8'")
        if self.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("compute_dtype must be float32, bfloat16 or float16")
        if not 0 < self.max_lora_rank <= 512:
            raise ValueError("max_lora_rank must be in 1..512")
        if self.max_eval_set_bytes <= 0 or self.max_eval_items <= 0 or self.max_eval_attempts < 1 or self.max_deliveries < 1:
            raise ValueError("eval-set caps must be > 0, max_eval_attempts and max_deliveries >= 1")
        if self.stalled_after_s <= 0 or self.retired_window_s <= 0:
            raise ValueError("stalled_after_s and retired_window_s must be > 0")
        if min(self.rejected_retention_s, self.deleted_retention_s, self.orphan_grace_s, self.staging_max_age_s) < 0:
            raise ValueError("retention periods and grace times must be >= 0")
        if self.storage_quota_bytes < 0:
            raise ValueError("storage_quota_bytes must be >= 0")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PipelineConfig:
        """Defaults overridden by MPLEX_ADAPTERS_<FIELD> (archive and gate fields by their own names)."""
        env = os.environ if environ is None else environ

        def pick(obj) -> dict[str, Any]:
            out = {}
            for f in dataclasses.fields(obj):
                raw = env.get(f"MPLEX_ADAPTERS_{f.name.upper()}")
                if raw is None or dataclasses.is_dataclass(f.default):
                    continue
                if f.type in ("int", int):
                    out[f.name] = int(raw)
                elif f.type in ("float", float):
                    out[f.name] = float(raw)
                elif f.name == "accepted_base_names":
                    out[f.name] = tuple(n.strip() for n in raw.split(",") if n.strip())
                else:
                    out[f.name] = raw
            return out

        return cls(archive=ArchiveLimits(**pick(ArchiveLimits)), gate=GateDefaults(**pick(GateDefaults)), **pick(cls))
