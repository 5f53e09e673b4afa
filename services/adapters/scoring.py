"""Scores for the quality gate: exact match, token F1, ROUGE-L, greedy token agreement, and what makes an
output malformed (empty, undecodable, stuck repeating).

Text is compared as word/punctuation tokens, case-sensitively (an "uppercase" adapter must not get
credit for lowercase answers), after trimming surrounding whitespace.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from services.engine.kv_gate import token_agreement  # noqa: F401 (the adapter gate's FP8 check uses it too)

_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def exact_match(output: str, expected: str) -> float:
    return float(" ".join(output.split()) == " ".join(expected.split()))


def token_f1(output: str, expected: str) -> float:
    """SQuAD-style bag-of-tokens F1 (order-blind)."""
    out, ref = tokens(output), tokens(expected)
    if not out or not ref:
        return float(out == ref)
    common = sum((Counter(out) & Counter(ref)).values())
    if common == 0:
        return 0.0
    p, r = common / len(out), common / len(ref)
    return 2 * p * r / (p + r)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(output: str, expected: str) -> float:
    """ROUGE-L F1: longest common token subsequence (order-aware, unlike token F1)."""
    out, ref = tokens(output), tokens(expected)
    if not out or not ref:
        return float(out == ref)
    lcs = lcs_length(out, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(out), lcs / len(ref)
    return 2 * p * r / (p + r)


SCORERS = {"exact_match": exact_match, "token_f1": token_f1, "rouge_l": rouge_l}


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# -- well-formedness ------------------------------------------------------------------------------------------
REPLACEMENT_CHAR = "\ufffd"  # what the detokenizer emits for bytes that are not UTF-8
LOOP_MAX_PERIOD = 8  # a loop of up to this many tokens ...
LOOP_MIN_REPEATS = 4  # ... repeated at least this often in a row ...
LOOP_MIN_TOKENS = 16  # ... over at least this many tokens, at the end of the output


def trailing_loop(token_ids: Sequence[int]) -> int:
    """How many tokens at the end of the output are one short cycle repeated (0 if none is long enough).
    "the the the ..." or "ab ab ab ..." running into the token limit is the signature of a broken model."""
    n = len(token_ids)
    best = 0
    for period in range(1, min(LOOP_MAX_PERIOD, n // LOOP_MIN_REPEATS) + 1):
        unit = list(token_ids[n - period:])
        reps = 1
        while (reps + 1) * period <= n and list(token_ids[n - (reps + 1) * period: n - reps * period]) == unit:
            reps += 1
        if reps >= LOOP_MIN_REPEATS and reps * period >= LOOP_MIN_TOKENS:
            best = max(best, reps * period)
    return best


def malformation(text: str, token_ids: Sequence[int], expected: str) -> str | None:
    """Why an output is malformed ("empty", "undecodable", "repetition"), or None. An output the eval item
    itself asks for (an empty or replacement-character `expected`) is not held against it."""
    if not text.strip() and expected.strip():
        return "empty"
    if REPLACEMENT_CHAR in text and REPLACEMENT_CHAR not in expected:
        return "undecodable"
    if trailing_loop(token_ids):
        return "repetition"
    return None
