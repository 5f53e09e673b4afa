"""Identifiers: time-ordered UUIDs for rows, request ids for the ledger, base62 for compact tokens."""
from __future__ import annotations

import os
import secrets
import string
import time
import uuid

BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
_BASE62_INDEX = {c: i for i, c in enumerate(BASE62)}


def random_base62(length: int) -> str:
    """`length` characters drawn uniformly from [0-9A-Za-z] by the OS CSPRNG."""
    assert length > 0
    return "".join(secrets.choice(BASE62) for _ in range(length))


def base62_encode(value: int, width: int) -> str:
    """Fixed-width base62 of a non-negative integer (left-padded with '0')."""
    if value < 0 or value >= 62**width:
        raise ValueError(f"{value} does not fit in {width} base62 digits")
    out = []
    for _ in range(width):
        value, digit = divmod(value, 62)
        out.append(BASE62[digit])
    return "".join(reversed(out))


def base62_decode(text: str) -> int:
    value = 0
    for ch in text:
        value = value * 62 + _BASE62_INDEX[ch]
    return value


def uuid7() -> uuid.UUID:
    """A version-7 UUID (RFC 9562): 48-bit Unix milliseconds then randomness.

    Time-ordered ids keep B-tree inserts at the right edge of the index and sort by creation,
    while staying unguessable enough that an id in a URL grants nothing by itself.
    """
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits: 12 for rand_a, 62 for rand_b (+6 spare)
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 68) & 0xFFF) << 64  # rand_a
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b
    return uuid.UUID(int=value)


def new_request_id() -> str:
    """The id a request carries end to end (gateway → engine → ledger); unique, time-sortable."""
    return f"req_{uuid7().hex}"
