"""API keys (`mpx_<prefix>_<secret><checksum>`) and secrets derived from the server's secret key.

The prefix is a public id (stored in clear, used for lookup); only a sha256 of the full key is stored.
The checksum lets the gateway refuse mistyped or invented keys without touching the database.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import zlib
from dataclasses import dataclass

from services.common.ids import base62_encode, random_base62

KEY_TAG = "mpx"
PREFIX_LEN = 8
SECRET_LEN = 32  # ~190 bits of entropy: a plain sha256 is enough, no slow hash needed
CHECKSUM_LEN = 6  # 62**6 > 2**32, so a whole CRC32 fits
KEY_LEN = len(KEY_TAG) + 1 + PREFIX_LEN + 1 + SECRET_LEN + CHECKSUM_LEN

_KEY_RE = re.compile(rf"^{KEY_TAG}_([0-9A-Za-z]{{{PREFIX_LEN}}})_([0-9A-Za-z]{{{SECRET_LEN}}})([0-9A-Za-z]{{{CHECKSUM_LEN}}})$")
# Anything that looks like one of our keys, for scrubbing text bound for logs.
_KEY_LIKE_RE = re.compile(rf"{KEY_TAG}_([0-9A-Za-z]{{{PREFIX_LEN}}})_[0-9A-Za-z]+")

# Scopes a key may carry; the gateway checks them per endpoint.
SCOPE_INFERENCE = "inference"  # /v1/chat/completions, /v1/completions, /v1/models
SCOPE_USAGE_READ = "usage:read"  # GET /api/tenant/usage, /usage/keys, /requests/{id}, /spend with the key
SCOPE_ADAPTERS_WRITE = "adapters:write"  # POST /api/tenant/adapters with the key (uploads from CI)
ALL_SCOPES = frozenset({SCOPE_INFERENCE, SCOPE_USAGE_READ, SCOPE_ADAPTERS_WRITE})
DEFAULT_SCOPES = (SCOPE_INFERENCE,)


class InvalidKeyFormat(ValueError):
    """The string is not a well-formed key (shape or checksum). Its text never contains the key."""


@dataclass(frozen=True, slots=True)
class NewKey:
    full: str  # shown to the user exactly once
    prefix: str
    hash: str  # sha256 hex of `full`; the only secret material stored

    def __repr__(self) -> str:  # keep the secret out of tracebacks and debug logs
        return f"NewKey(prefix={self.prefix!r}, hash={self.hash[:12]}…)"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    full: str
    prefix: str

    def __repr__(self) -> str:
        return f"ParsedKey(prefix={self.prefix!r})"


def _checksum(prefix: str, secret: str) -> str:
    return base62_encode(zlib.crc32(f"{prefix}_{secret}".encode()), CHECKSUM_LEN)


def hash_secret(full_key: str) -> str:
    return hashlib.sha256(full_key.encode()).hexdigest()


def generate_key() -> NewKey:
    prefix, secret = random_base62(PREFIX_LEN), random_base62(SECRET_LEN)
    full = f"{KEY_TAG}_{prefix}_{secret}{_checksum(prefix, secret)}"
    return NewKey(full=full, prefix=prefix, hash=hash_secret(full))


def parse_key(text: str) -> ParsedKey:
    """Check shape and checksum; raises InvalidKeyFormat. Does not prove the key exists."""
    if not isinstance(text, str) or len(text) != KEY_LEN:
        raise InvalidKeyFormat("malformed API key")
    m = _KEY_RE.match(text)
    if m is None:
        raise InvalidKeyFormat("malformed API key")
    prefix, secret, checksum = m.groups()
    if not hmac.compare_digest(checksum, _checksum(prefix, secret)):
        raise InvalidKeyFormat("API key checksum mismatch")
    return ParsedKey(full=text, prefix=prefix)


def verify_key(parsed: ParsedKey, stored_hash: str) -> bool:
    """Constant-time comparison of the presented key's hash with the stored one."""
    return hmac.compare_digest(hash_secret(parsed.full), stored_hash)


def redact_keys(text: str) -> str:
    """Replace every key-looking token with its public prefix, for anything that may reach a log."""
    return _KEY_LIKE_RE.sub(lambda m: f"{KEY_TAG}_{m.group(1)}_***", text)


def derive_secret(secret_key: str, purpose: str, context: str) -> bytes:
    """A 32-byte secret for one purpose and context (HMAC-SHA256 keyed by the server secret).

    Deriving instead of storing means rotating MPLEX_SECRET_KEY rotates every derived value at once.
    """
    assert purpose and ":" not in purpose
    return hmac.new(secret_key.encode(), f"{purpose}:{context}".encode(), hashlib.sha256).digest()


def tenant_cache_salt(secret_key: str, tenant_id: object) -> str:
    """The prefix-cache salt the gateway sends to engines for a tenant; clients can neither see nor set it."""
    return derive_secret(secret_key, "cache-salt", str(tenant_id)).hex()
