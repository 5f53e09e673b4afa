"""Billing knobs: one frozen config, validated on construction, built from the platform settings."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import Settings


@dataclass(frozen=True, slots=True)
class BillingConfig:
    # Engines that never sent a usage report are costed at this engine type's price (settings.engine_type).
    default_engine_type: str = "cpu"
    # A roll-up takes ledger rows recorded at least this long ago (and before every open transaction):
    # a row committed late with an early `recorded_at` default must not slip behind the cursor.
    settle_lag_s: float = 10.0
    engine_sample_interval_s: float = 15.0  # registry -> engine_usage_reports windows
    rollup_interval_s: float = 300.0  # ledger -> usage_daily
    statements_interval_s: float = 3600.0  # closed months -> statements (unchanged months are no-ops)
    statement_months_back: int = 2  # closed months re-checked by the periodic statement run
    price_cache_ttl_s: float = 5.0  # the gateway's in-process price book
    max_report_days: int = 400

    def __post_init__(self) -> None:
        if not self.default_engine_type:
            raise ValueError("default_engine_type must name an engine type")
        for name in ("engine_sample_interval_s", "rollup_interval_s", "statements_interval_s", "price_cache_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.settle_lag_s < 0:
            raise ValueError("settle_lag_s must be >= 0")
        if self.statement_months_back < 1:
            raise ValueError("statement_months_back must be >= 1")
        if self.max_report_days < 1:
            raise ValueError("max_report_days must be >= 1")

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: object) -> BillingConfig:
        return cls(default_engine_type=settings.engine_type, **overrides)  # type: ignore[arg-type]
