"""Settings: defaults, environment variables, and refusal of unsafe production configuration."""
import os
import stat
import subprocess
import sys

import pytest
from pydantic import ValidationError

from services.common.embedded import default_broker_url
from services.common.internal_auth import client_headers, engine_tokens
from services.common.settings import Settings, get_settings, normalize_database_url, redact_url

STRONG = "Zq8v1XKp3mN7rT2wY5bC9dF4gH6jL0sA"
ENGINE_TOKEN = "Kd7Qw2Lr9Xv4Tb1Nm6Hs3Jc8Gf5Pz0Ye"


def prod(**overrides):
    values = dict(env="prod", secret_key=STRONG, engine_tokens=ENGINE_TOKEN,
                  database_url="postgresql://u:p@db:5432/mplex",
                  redis_url="rediss://:tok@cache:6379/0", storage_url="s3://bucket/adapters")
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("MPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_defaults_in_dev(clean_env):
    s = Settings()
    assert s.env == "dev" and s.home == clean_env / ".mplex"
    assert s.database_url is None and s.redis_url is None
    assert s.storage_url == f"file://{clean_env / '.mplex' / 'objects'}"
    assert not s.redis_fail_open and 0 < s.key_cache_ttl_s <= 30
    assert not s.session_cookie_secure


def test_environment_variables_use_the_mplex_prefix(clean_env, monkeypatch):
    monkeypatch.setenv("MPLEX_REDIS_FAIL_OPEN", "true")
    monkeypatch.setenv("MPLEX_KEY_CACHE_TTL_S", "3")
    monkeypatch.setenv("MPLEX_DATABASE_URL", "postgres://u:p@h/db")
    monkeypatch.setenv("MPLEX_HOME", str(clean_env / "elsewhere"))
    s = get_settings()
    assert s.redis_fail_open and s.key_cache_ttl_s == 3
    assert s.database_url == "postgresql+psycopg://u:p@h/db"
    assert s.home == clean_env / "elsewhere"
    assert get_settings() is s  # one validated object per process


def test_dev_secret_is_generated_once_and_private(clean_env):
    first = Settings(home=clean_env / "h").secret()
    path = clean_env / "h" / "secret_key"
    assert len(first) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Settings(home=clean_env / "h").secret() == first
    assert Settings(home=clean_env / "other").secret() != first


def test_concurrent_first_starts_agree_on_one_secret(clean_env):
    code = ("from services.common.settings import Settings; s = Settings(home=%r); "
            "print(s.secret(), s.engine_tokens.get_secret_value())" % str(clean_env / "race"))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    secrets_seen = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(secrets_seen) == 1
    key, token = secrets_seen.pop().split()
    assert (clean_env / "race" / "secret_key").read_text().strip() == key
    assert (clean_env / "race" / "engine_token").read_text().strip() == token != key


def test_dev_engine_token_is_generated_once_per_home_and_private(clean_env):
    """`make up`, tests and a standalone `mplex engine serve` on one home agree without configuration."""
    first = engine_tokens(Settings(home=clean_env / "h"))
    path = clean_env / "h" / "engine_token"
    assert len(first) == 1 and len(first[0]) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert engine_tokens(Settings(home=clean_env / "h")) == first
    assert engine_tokens(Settings(home=clean_env / "other")) != first


def test_engine_tokens_are_a_rotation_list_the_first_is_sent(clean_env, monkeypatch):
    monkeypatch.setenv("MPLEX_ENGINE_TOKENS", " new-token , old-token ,")
    s = Settings(home=clean_env / "h")
    assert engine_tokens(s) == ("new-token", "old-token")
    assert client_headers(s) == {"Authorization": "Bearer new-token"}
    assert "new-token" not in repr(s)
    assert not (clean_env / "h" / "engine_token").exists()  # an explicit list is never persisted


def test_an_engine_token_list_without_a_token_is_refused_everywhere(clean_env):
    with pytest.raises(ValidationError, match="MPLEX_ENGINE_TOKENS holds no token"):
        Settings(home=clean_env / "h", engine_tokens=" , ")


def test_explicit_secret_wins_and_is_not_persisted(clean_env):
    s = Settings(home=clean_env / "h", secret_key="x" * 8)
    assert s.secret() == "x" * 8  # weak keys are tolerated outside prod
    assert not (clean_env / "h" / "secret_key").exists()


def test_prod_accepts_a_complete_safe_configuration(clean_env):
    s = prod()
    assert s.session_cookie_secure
    assert s.database_url.startswith("postgresql+psycopg://")


@pytest.mark.parametrize(
    ("overrides", "complaint"),
    [
        ({"secret_key": None}, "MPLEX_SECRET_KEY is required"),
        ({"secret_key": "short-but-random-Q1"}, "shorter than"),
        ({"secret_key": "changeme" * 5}, "placeholder"),
        ({"secret_key": "ab" * 20}, "distinct"),
        ({"database_url": None}, "MPLEX_DATABASE_URL is required"),
        ({"redis_url": None}, "MPLEX_REDIS_URL is required"),
        ({"storage_url": None}, "MPLEX_STORAGE_URL is required"),
        ({"cookie_secure": False}, "COOKIE_SECURE"),
        ({"engine_tokens": None}, "MPLEX_ENGINE_TOKENS is required"),
        ({"engine_tokens": "short-but-random-Q1"}, "MPLEX_ENGINE_TOKENS token 1 is unsafe: shorter than"),
        ({"engine_tokens": f"{ENGINE_TOKEN},changeme-please-rotate-this-token-now"}, "token 2 is unsafe: a well-known"),
    ],
)
def test_prod_refuses_unsafe_settings(clean_env, overrides, complaint):
    with pytest.raises(ValidationError) as info:
        prod(**overrides)
    assert complaint in str(info.value)
    assert not (clean_env / ".mplex" / "secret_key").exists()  # prod never invents a secret
    assert not (clean_env / ".mplex" / "engine_token").exists()


def test_validation_errors_do_not_print_secrets(clean_env):
    with pytest.raises(ValidationError) as info:
        prod(secret_key="changeme-super-secret-value-123456", database_url="postgresql://u:hunter2@db/x",
             engine_tokens="weak-engine-token")
    assert "hunter2" not in str(info.value) and "super-secret" not in str(info.value)
    assert "weak-engine-token" not in str(info.value)


def test_database_urls_are_normalized_to_psycopg_and_others_refused():
    assert normalize_database_url("postgresql://a@b/c") == "postgresql+psycopg://a@b/c"
    assert normalize_database_url("postgres://a@b/c") == "postgresql+psycopg://a@b/c"
    with pytest.raises(ValueError):
        normalize_database_url("mysql://a@b/c")


def test_repr_hides_url_passwords(clean_env):
    s = Settings(database_url="postgresql://user:hunter2@db/x", redis_url="redis://:tok3n@r:6379/0")
    assert "hunter2" not in repr(s) and "tok3n" not in repr(s)
    assert redact_url("redis://:tok3n@r:6379/0") == "redis://:***@r:6379/0"


def test_broker_defaults_to_the_next_redis_database():
    assert default_broker_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/1"
    assert default_broker_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379/1"
    assert default_broker_url("rediss://:pw@h:6380/3?ssl_cert_reqs=required") == "rediss://:pw@h:6380/4?ssl_cert_reqs=required"
