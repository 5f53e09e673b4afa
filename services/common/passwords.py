"""Password hashing for web sign-in (argon2id via argon2-cffi, RFC 9106 low-memory profile)."""
from __future__ import annotations

from functools import lru_cache

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

MIN_LENGTH = 10
MAX_LENGTH = 1024  # argon2 accepts anything, but a megabyte "password" is a DoS, not a secret


class WeakPassword(ValueError):
    """The password fails the policy; the message says why (never echoes the password)."""


@lru_cache(maxsize=1)
def _hasher() -> PasswordHasher:
    return PasswordHasher()  # argon2id, t=3, m=64 MiB, p=4


@lru_cache(maxsize=1)
def _dummy_hash() -> str:
    return _hasher().hash("not-a-real-password-used-for-timing-only")


def check_policy(password: str) -> None:
    if len(password) < MIN_LENGTH:
        raise WeakPassword(f"password must be at least {MIN_LENGTH} characters")
    if len(password) > MAX_LENGTH:
        raise WeakPassword(f"password must be at most {MAX_LENGTH} characters")
    if password.strip() != password or len(set(password)) < 4:
        raise WeakPassword("password is too simple")


def hash_password(password: str) -> str:
    check_policy(password)
    return _hasher().hash(password)


def verify_password(stored_hash: str | None, password: str) -> bool:
    """True when `password` matches. With no stored hash (unknown user) it still spends the same
    time on a dummy hash, so sign-in timing does not reveal which emails exist."""
    if len(password) > MAX_LENGTH:
        return False
    try:
        return _hasher().verify(stored_hash or _dummy_hash(), password) and stored_hash is not None
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def needs_rehash(stored_hash: str) -> bool:
    """True when the hash was made with weaker parameters than today's; re-hash on next sign-in."""
    return _hasher().check_needs_rehash(stored_hash)
