"""API key format, checksum, hashing and derived secrets."""
import re

import pytest

from services.common.keys import (
    CHECKSUM_LEN,
    KEY_LEN,
    PREFIX_LEN,
    SECRET_LEN,
    InvalidKeyFormat,
    derive_secret,
    generate_key,
    hash_secret,
    parse_key,
    redact_keys,
    tenant_cache_salt,
    verify_key,
)

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def test_generated_key_has_the_documented_shape():
    key = generate_key()
    assert re.fullmatch(r"mpx_[0-9A-Za-z]{8}_[0-9A-Za-z]{38}", key.full)
    assert len(key.full) == KEY_LEN
    assert key.full.split("_")[1] == key.prefix and len(key.prefix) == PREFIX_LEN
    assert key.hash == hash_secret(key.full) and re.fullmatch(r"[0-9a-f]{64}", key.hash)


def test_parse_round_trips_and_verifies():
    key = generate_key()
    parsed = parse_key(key.full)
    assert parsed.prefix == key.prefix
    assert verify_key(parsed, key.hash)
    assert not verify_key(parsed, generate_key().hash)


def test_every_single_character_change_is_rejected_by_the_checksum():
    key = generate_key().full
    start = len("mpx_")
    body_positions = [i for i in range(start, KEY_LEN) if key[i] != "_"]
    assert len(body_positions) == PREFIX_LEN + SECRET_LEN + CHECKSUM_LEN
    for i in body_positions:
        replacement = ALPHABET[(ALPHABET.index(key[i]) + 1) % len(ALPHABET)]
        with pytest.raises(InvalidKeyFormat):
            parse_key(key[:i] + replacement + key[i + 1 :])


GARBAGE = ["", "mpx_", "sk-abc", "Bearer mpx_x", None, 123, "mpx_" + "a" * (KEY_LEN - 4)]
MANGLED = {"wrong-prefix": lambda k: "xpm" + k[3:], "one-char-long": lambda k: k + "a", "one-char-short": lambda k: k[:-1],
           "dashes": lambda k: k.replace("_", "-")}


# Mangled keys are made in the test, not at collection: ids must be the same in every pytest-xdist worker.
@pytest.mark.parametrize("garbage", [*GARBAGE, *MANGLED], ids=[*map(repr, GARBAGE), *MANGLED])
def test_garbage_is_rejected_without_echoing_it(garbage):
    if garbage in MANGLED:
        garbage = MANGLED[garbage](generate_key().full)
    with pytest.raises(InvalidKeyFormat) as info:
        parse_key(garbage)
    if isinstance(garbage, str) and len(garbage) > 8:
        assert garbage[8:] not in str(info.value)


def test_keys_are_unique():
    keys = [generate_key() for _ in range(5000)]
    assert len({k.full for k in keys}) == len(keys)
    assert len({k.prefix for k in keys}) == len(keys)


def test_reprs_and_redaction_keep_the_secret_out_of_logs():
    key = generate_key()
    secret_part = key.full.split("_")[2]
    assert secret_part not in repr(key) and secret_part not in repr(parse_key(key.full))
    line = f"auth failed for Authorization: Bearer {key.full} from 10.0.0.1"
    redacted = redact_keys(line)
    assert secret_part not in redacted and key.prefix in redacted and "10.0.0.1" in redacted


def test_derived_secrets_depend_on_key_purpose_and_context():
    a = tenant_cache_salt("k" * 40, "tenant-a")
    assert a == tenant_cache_salt("k" * 40, "tenant-a")
    assert a != tenant_cache_salt("k" * 40, "tenant-b")
    assert a != tenant_cache_salt("j" * 40, "tenant-a")
    assert derive_secret("k" * 40, "cache-salt", "x") != derive_secret("k" * 40, "session", "x")
