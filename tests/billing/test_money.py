"""The rounding rules of docs/billing.md: exact integers until one half-up rounding per daily row."""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.billing.money import (
    BPS,
    ExactAmounts,
    UnitPrices,
    compute_cost_micros,
    format_usd,
    prorate,
    round_half_up,
)


@pytest.mark.parametrize(
    ("num", "den", "expected"),
    [(0, 7, 0), (4, 10, 0), (5, 10, 1), (6, 10, 1), (14, 10, 1), (15, 10, 2), (25, 10, 3), (1, 2, 1), (1, 3, 0),
     (2, 3, 1), (999_999, 1_000_000, 1), (499_999, 1_000_000, 0), (500_000, 1_000_000, 1), (10**30 + 5, 10, 10**29 + 1)],
)
def test_round_half_up_table(num, den, expected):
    assert round_half_up(num, den) == expected


@given(st.integers(0, 10**24), st.integers(1, 10**12))
def test_round_half_up_is_nearest_with_halves_up(num, den):
    exact = Fraction(num, den)
    r = round_half_up(num, den)
    assert abs(exact - r) <= Fraction(1, 2)
    if exact - int(exact) == Fraction(1, 2):
        assert r == int(exact) + 1  # halves go up, never to even


def test_round_half_up_refuses_floats_and_negatives():
    with pytest.raises(TypeError):
        round_half_up(1.5, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        round_half_up(-1, 2)
    with pytest.raises(ValueError):
        round_half_up(1, 0)


def test_unit_prices_validate():
    with pytest.raises(ValueError):
        UnitPrices(-1, 0, 0)
    with pytest.raises(ValueError):
        UnitPrices(1, 0, 0, keep_bps=BPS + 1)
    with pytest.raises(ValueError):
        UnitPrices(1.5, 0, 0)  # type: ignore[arg-type]


def test_request_price_components():
    # 1000 prompt tokens of which 400 cached, 250 completion, on an adapter:
    # 600 x 0.20 + 400 x 0.10 + 250 x 0.60 + 1250 x 0.05 = 120 + 40 + 150 + 62.5 = 372.5 micro-USD.
    p = UnitPrices(input=200_000, cached_input=100_000, output=600_000, adapter_surcharge=50_000)
    assert p.usage_pico(1000, 400, 250, adapter=True) == 372_500_000
    assert p.usage_pico(1000, 400, 250, adapter=False) == 310_000_000  # no surcharge on the base model
    e = ExactAmounts()
    e.add_usage(p, 1000, 400, 250, adapter=True)
    r = e.rounded()
    assert (r.amount_micros, r.discount_micros, r.billed_micros) == (373, 0, 373)  # 372.5 -> 373 (half up)


def test_discount_is_rounded_on_the_aggregate_not_per_request():
    # 3 requests of 1 output token at 0.60 micro each with a 15% discount: per request 0.51 micro.
    p = UnitPrices(input=0, cached_input=0, output=600_000, keep_bps=BPS - 1500)
    e = ExactAmounts()
    for _ in range(3):
        e.add_usage(p, 0, 0, 1, adapter=False)
    r = e.rounded()
    assert r.amount_micros == 2  # 1.8 -> 2
    assert r.billed_micros == 2  # 1.53 -> 2 (per-request rounding would have given 3 x 1 = 3)
    assert r.discount_micros == 0


def test_discount_never_negative_and_full_discount_bills_zero():
    p = UnitPrices(input=333_333, cached_input=1, output=777_777, keep_bps=0)
    e = ExactAmounts()
    e.add_usage(p, 12345, 345, 678, adapter=False)
    r = e.rounded()
    assert r.billed_micros == 0 and r.discount_micros == r.amount_micros > 0


@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000), st.booleans()), min_size=1, max_size=30),
    st.integers(0, 3_000_000), st.integers(0, 3_000_000), st.integers(0, 3_000_000), st.integers(0, 500_000), st.integers(0, BPS),
)
def test_aggregate_rounding_matches_exact_rational(reqs, pin, pcached, pout, psur, keep):
    p = UnitPrices(pin, pcached, pout, psur, keep)
    e = ExactAmounts()
    exact_list = exact_billed = Fraction(0)
    for prompt, cached, completion, adapter in reqs:
        cached = min(cached, prompt)
        e.add_usage(p, prompt, cached, completion, adapter=adapter)
        amount = Fraction((prompt - cached) * pin + cached * pcached + completion * pout + ((prompt + completion) * psur if adapter else 0), 10**6)
        exact_list += amount
        exact_billed += amount * Fraction(keep, BPS)
    r = e.rounded()
    assert abs(r.amount_micros - exact_list) <= Fraction(1, 2)
    assert abs(r.billed_micros - exact_billed) <= Fraction(1, 2)
    assert 0 <= r.discount_micros <= r.amount_micros


def test_compute_cost_per_engine_hour():
    # One engine-hour at $2.50 is 2,500,000 micro-USD; 1 ms of it is 0.694 micro -> 1.
    assert compute_cost_micros(3_600_000_000, 2_500_000) == 2_500_000
    assert compute_cost_micros(1_000, 2_500_000) == 1
    assert compute_cost_micros(720, 2_500_000) == 1  # 0.5 exactly -> up
    assert compute_cost_micros(719, 2_500_000) == 0


def test_prorate_and_format():
    assert prorate(1_000_000, 30, 10) == 3_000_000
    assert prorate(1, 1, 2) == 1
    assert format_usd(12_345_678) == "12.345678"
    assert format_usd(5) == "0.000005"
    assert format_usd(-1_500_000) == "-1.500000"
