"""Money arithmetic for billing: exact integer amounts and the one rounding rule (see docs/billing.md).

Amounts are integer micro-USD. Before rounding they are kept exact in finer integer units:

- token charges in **pico-USD** (micro-USD / 10^6): tokens x price per 1M tokens (micro-USD) is exact;
- discounted charges in pico-USD x 10^4: times the kept basis points (10000 - discount_bps);
- compute cost in micro-USD / 3.6e9: compute microseconds x price per engine-hour (micro-USD).

An exact sum is rounded half-up to micro-USD **once per daily roll-up row**; everything above a daily row
(statement lines, statements, reports) is a sum of rounded rows and is never rounded again, so all of them
reconcile to the micro-dollar. Every quantity here is non-negative.
"""
from __future__ import annotations

from dataclasses import dataclass

MICROS_PER_USD = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are per 1M tokens
BPS = 10_000  # basis points in 100%
US_PER_HOUR = 3_600_000_000  # microseconds in an engine-hour

PICO_PER_MICRO = TOKENS_PER_PRICE_UNIT  # tokens x (micro-USD per 1M tokens) = pico-USD
DISCOUNTED_PER_MICRO = PICO_PER_MICRO * BPS


def round_half_up(numerator: int, denominator: int) -> int:
    """numerator / denominator rounded to the nearest integer, halves up. Integers only, both >= 0 / > 0."""
    if not (isinstance(numerator, int) and isinstance(denominator, int)):
        raise TypeError("money is integers: no floats, no Decimals")
    if numerator < 0 or denominator <= 0:
        raise ValueError(f"round_half_up({numerator}, {denominator}): amounts are non-negative")
    return (2 * numerator + denominator) // (2 * denominator)


@dataclass(frozen=True, slots=True)
class UnitPrices:
    """Micro-USD per 1M tokens, and the share of the amount that is billed (10000 - discount_bps)."""

    input: int
    cached_input: int
    output: int
    adapter_surcharge: int = 0
    keep_bps: int = BPS

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output", "adapter_surcharge"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer (micro-USD per 1M tokens), got {v!r}")
        if not isinstance(self.keep_bps, int) or not 0 <= self.keep_bps <= BPS:
            raise ValueError(f"keep_bps must be an integer in [0, {BPS}], got {self.keep_bps!r}")

    def usage_pico(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *, adapter: bool) -> int:
        """Exact amount in pico-USD at these unit prices, before the discount. Linear in the token counts,
        so it prices one request or the sums over many requests that share these prices alike."""
        assert 0 <= cached_tokens <= prompt_tokens and completion_tokens >= 0
        pico = (prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input + completion_tokens * self.output
        if adapter:
            pico += (prompt_tokens + completion_tokens) * self.adapter_surcharge
        return pico


@dataclass(slots=True)
class ExactAmounts:
    """Running exact sums for one roll-up row (or one request); `rounded()` applies the rule once."""

    list_pico: int = 0  # at unit prices, before discount
    billed_scaled: int = 0  # list_pico x keep_bps
    compute_scaled: int = 0  # compute_us x price per engine-hour (micro-USD)

    def add_usage(self, prices: UnitPrices, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *, adapter: bool) -> None:
        pico = prices.usage_pico(prompt_tokens, cached_tokens, completion_tokens, adapter=adapter)
        self.list_pico += pico
        self.billed_scaled += pico * prices.keep_bps

    def add_compute(self, compute_us: int, price_per_hour_micros: int) -> None:
        assert compute_us >= 0 and price_per_hour_micros >= 0
        self.compute_scaled += compute_us * price_per_hour_micros

    def rounded(self) -> RoundedAmounts:
        amount = round_half_up(self.list_pico, PICO_PER_MICRO)
        billed = round_half_up(self.billed_scaled, DISCOUNTED_PER_MICRO)
        # round_half_up is monotonic and billed_scaled <= list_pico * BPS, so the discount is never negative.
        return RoundedAmounts(amount, amount - billed, round_half_up(self.compute_scaled, US_PER_HOUR))


@dataclass(frozen=True, slots=True)
class RoundedAmounts:
    amount_micros: int
    discount_micros: int
    compute_cost_micros: int

    @property
    def billed_micros(self) -> int:
        return self.amount_micros - self.discount_micros


def compute_cost_micros(compute_us: int, price_per_hour_micros: int) -> int:
    """Cost of engine time on its own (e.g. idle time), rounded once."""
    return round_half_up(compute_us * price_per_hour_micros, US_PER_HOUR)


def prorate(amount_micros: int, numerator: int, denominator: int) -> int:
    """amount x numerator / denominator, rounded half-up (a projection: part of the period -> all of it)."""
    return round_half_up(amount_micros * numerator, denominator)


def format_usd(micros: int) -> str:
    """'12.345678' for 12345678 micro-USD: exact, for humans (exports keep the integer)."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    return f"{sign}{whole}.{frac:06d}"
