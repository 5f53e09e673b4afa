"""Shared hypothesis strategies and settings for the fuzz suites (tests/*/test_fuzz*.py).

`make test` runs every fuzz test bounded and derandomized (the same examples every run: a failure
reproduces); `make fuzz` sets MPLEX_FUZZ_SCALE (x20 by default) and a fresh random seed per run, to find
new cases.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_SCALE = os.environ.get("MPLEX_FUZZ_SCALE")


def fuzz_settings(examples: int) -> settings:
    """`examples` in `make test`; MPLEX_FUZZ_SCALE times as many, randomly seeded, under `make fuzz`."""
    scaled = FUZZ_SCALE is not None
    n = max(examples, int(float(FUZZ_SCALE) * examples)) if scaled else examples
    return settings(max_examples=n, deadline=None, derandomize=not scaled, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# Integers a client library may send, around every boundary our types have.
BOUNDARY_INTS = [0, 1, -1, 2, 5, 8, 9, 20, 21, 64, 65, 255, 256, 511, 512, 1535, 1536, 4096, 2**15, 2**31 - 1, 2**31,
                 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**31), -(2**63), -(2**63) - 1, 10**30, -(10**30)]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-320, 5e-324, 1e-45, 1e-8, 1e-5, 9.99e-6, 0.5, 1.0, 1.0000001, 2.0, 100.0, 100.5, 1e30,
                   1e308, -1e-8, -1.0, float("inf"), float("-inf"), float("nan")]
# Text that has broken servers: lone surrogates, NUL, RTL/bidi controls, combining marks, emoji, BOM,
# JSON-looking text, very long runs.
ODD_TEXT = ["", " ", "\x00", "\ud800", "a\udfffb", "\ufeff", "\u202e\u2066", "e\u0301\u0301\u0301", "🙂" * 20,
            '{"a": [1, 2]}', "\\u0000", "\r\n\r\n", "data: [DONE]\n\n", "x" * 300, "word " * 3000, "\U0010ffff"]

ints = st.one_of(st.sampled_from(BOUNDARY_INTS), st.integers(-(2**70), 2**70), st.integers(-3, 40))
floats = st.one_of(st.sampled_from(BOUNDARY_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(0, 2))
texts = st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=40), st.text(alphabet=st.characters(), max_size=8))
wrong = st.one_of(st.none(), st.booleans(), st.just([]), st.just({}), st.just({"a": 1}), st.just([1, "a", None]), texts)


def valid_unicode(s: str) -> bool:
    try:
        s.encode()
        return True
    except UnicodeEncodeError:
        return False


# Odd but valid text: what a well-behaved client may send, and the engines must serve.
good_text = st.one_of(st.sampled_from([t for t in ODD_TEXT if valid_unicode(t) and len(t) < 1000]),
                      st.text(max_size=30).filter(valid_unicode))


def number_like(base):
    """A field's plausible values, its boundaries and values of the wrong type."""
    return st.one_of(base, base, base, ints, floats, wrong)


def lists_of(elem, max_size: int = 12):
    return st.one_of(st.lists(elem, max_size=max_size), st.lists(elem, min_size=60, max_size=80), wrong)


def json_schemas():
    """Schemas inside the supported structured-output subset (structured.SUPPORTED_KEYWORDS), nested."""
    leaf = st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.lists(st.one_of(st.text("abc", max_size=3), st.integers(-3, 3)), min_size=1, max_size=4, unique=True)
        .map(lambda v: {"enum": v}),
        st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    )

    def extend(children):
        props = st.dictionaries(st.text("abcxyz", min_size=1, max_size=4), children, min_size=1, max_size=3)
        return st.one_of(
            props.flatmap(lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
                lambda req: {"type": "object", "properties": p, "required": req, "additionalProperties": False})),
            st.builds(lambda it, lo, span: {"type": "array", "items": it, "minItems": lo, "maxItems": lo + span},
                      children, st.integers(0, 2), st.integers(0, 2)),
            st.lists(children, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
        )

    return st.recursive(leaf, extend, max_leaves=6)
