"""Password hashing (argon2id) and policy."""
import pytest

from services.common.passwords import WeakPassword, check_policy, hash_password, needs_rehash, verify_password


def test_hash_verifies_only_the_right_password():
    h = hash_password("a long enough passphrase")
    assert h.startswith("$argon2id$")
    assert verify_password(h, "a long enough passphrase")
    assert not verify_password(h, "a long enough passphrasE")
    assert not needs_rehash(h)


def test_same_password_hashes_differently():
    assert hash_password("a long enough passphrase") != hash_password("a long enough passphrase")


def test_unknown_user_and_garbage_hash_never_verify():
    assert not verify_password(None, "not-a-real-password-used-for-timing-only")
    assert not verify_password("not a hash", "whatever password")
    assert not verify_password(hash_password("a long enough passphrase"), "x" * 5000)


@pytest.mark.parametrize("bad", ["short", "aaaaaaaaaaaa", " padded password ", "x" * 2000])
def test_policy_refuses_weak_passwords(bad):
    with pytest.raises(WeakPassword):
        check_policy(bad)
