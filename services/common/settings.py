"""Platform settings: one validated object read from `MPLEX_*` environment variables, via `get_settings()`.

Unset database/Redis URLs mean "start the embedded servers" (services.common.embedded) — allowed in
dev and test only; production must name its services and carry a strong secret key and engine tokens.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


Env = Literal["dev", "test", "prod"]

SECRET_KEY_FILE = "secret_key"
ENGINE_TOKEN_FILE = "engine_token"
MIN_SECRET_KEY_LEN = 32
# Values people paste from tutorials; refusing them is cheaper than a leaked session-signing key.
_KNOWN_WEAK_SECRETS = {"changeme", "changethis", "secret", "password", "mplex", "multiplex", "dev", "test", "example"}


def parse_tokens(value: str) -> tuple[str, ...]:
    """`new,old` -> ("new", "old"): the accepted tokens, the one to send first; blanks dropped."""
    return tuple(t for t in (part.strip() for part in value.split(",")) if t)


class UnsafeSettings(ValueError):
    """A setting is missing or unsafe for the environment (raised through pydantic's ValidationError)."""


class Settings(BaseSettings):
    # hide_input_in_errors: a validation error must not print the database password or secret key.
    model_config = SettingsConfigDict(env_prefix="MPLEX_", extra="ignore", frozen=True, hide_input_in_errors=True)

    env: Env = "dev"
    home: Path = Field(default_factory=lambda: Path.cwd() / ".mplex")

    # Services. None = embedded (dev/test); see services.common.embedded.resolve_urls.
    database_url: str | None = None
    redis_url: str | None = None
    broker_url: str | None = None  # Celery; default: the Redis server, next database index
    storage_url: str | None = None  # adapter object store (fsspec URL); default file://<home>/objects

    secret_key: SecretStr | None = None  # signs sessions, derives per-tenant cache salts
    # The platform credential of engine endpoints (services.common.internal_auth): comma-separated accepted
    # tokens, the first is the one clients send. Unset in dev/test: one per home, in <home>/engine_token.
    engine_tokens: SecretStr | None = None

    # Gateway behaviour.
    redis_fail_open: bool = False  # Redis down: False -> 503 (quotas unenforceable); True -> serve unmetered by quota
    key_cache_ttl_s: float = Field(10.0, gt=0, le=300)  # upper bound on how long a revoked key keeps working
    # An engine that refused a tenant's class as overloaded is not asked again for it for the shorter of its
    # Retry-After and this (services.gateway.router.Router.refused); while every engine holds one, the gateway
    # refuses that tenant's class itself, before a quota reservation.
    refusal_hold_s: float = Field(0.25, ge=0, le=30)
    # Streams sockets per engine per gateway process (engine_wire.STREAMS_PATH: many requests on one WebSocket,
    # one frame per step); 0: one HTTP stream per request (GENERATE_PATH) only. More than one spreads a gateway's
    # requests over an engine's front-end processes.
    engine_stream_sockets: int = Field(2, ge=0, le=16)
    # Request size limits of the gateway and engines (services.common.http_limits): 413 / 431 past them.
    max_request_bytes: int = Field(4 * 2**20, ge=64 * 2**10)
    max_header_bytes: int = Field(32 * 2**10, ge=8 * 2**10)
    session_ttl_s: int = Field(12 * 3600, gt=0)
    cookie_secure: bool | None = None  # None: True in prod, False otherwise (local http)

    # Database pool per process.
    db_pool_size: int = Field(10, ge=1)
    db_max_overflow: int = Field(20, ge=0)

    # Serving.
    base_model_name: str = Field("mplex-demo", min_length=1)
    base_model_dir: Path | None = None  # HF checkpoint directory of the base model (engines, eval workers)
    engine_type: str = Field("cpu", min_length=1)  # engine-hour price row this machine's engines are charged at
    engine_advertise_url: str | None = None
    # Share weights of the plans (tenants.plan) on the engines' tenant-fair scheduler; plans not listed weigh
    # 1. JSON in the environment: MPLEX_PLAN_WEIGHTS='{"default": 1, "pro": 4}'.
    plan_weights: dict[str, float] = Field(default_factory=lambda: {"default": 1.0})

    # The Batch API's pacing (services.batch.pacing): batch lines in flight per engine at most, and the
    # engine figures above which batch work yields to interactive load.
    batch_max_in_flight_per_engine: int = Field(8, ge=1, le=256)
    batch_yield_kv_usage: float = Field(0.8, gt=0, le=1)
    batch_yield_interactive_running: int = Field(4, ge=0)
    # CPU niceness of a batch run's threads (0: as the worker): where the runner shares cores with the
    # serving path (the gateway, an engine on the CPU), the OS scheduler then favours interactive requests.
    batch_cpu_nice: int = Field(10, ge=0, le=19)

    @field_validator("plan_weights", mode="after")
    @classmethod
    def _positive_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if not 0 < w <= 1000}
        if bad:
            raise ValueError(f"plan weights must be in (0, 1000]: {bad}")
        return v

    def plan_weight(self, plan: str) -> float:
        return self.plan_weights.get(plan, 1.0)

    @field_validator("home", mode="after")
    @classmethod
    def _absolute_home(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("database_url", mode="after")
    @classmethod
    def _psycopg_dialect(cls, v: str | None) -> str | None:
        return None if v is None else normalize_database_url(v)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.env == "prod":
            self._check_prod()
        if self.storage_url is None:
            object.__setattr__(self, "storage_url", f"file://{self.home / 'objects'}")
        if self.secret_key is None:
            object.__setattr__(self, "secret_key", SecretStr(_local_secret(self.home, SECRET_KEY_FILE)))
        if self.engine_tokens is None:
            object.__setattr__(self, "engine_tokens", SecretStr(_local_secret(self.home, ENGINE_TOKEN_FILE)))
        elif not parse_tokens(self.engine_tokens.get_secret_value()):
            raise UnsafeSettings("MPLEX_ENGINE_TOKENS holds no token (a comma-separated list, the one to send first)")
        return self

    def _check_prod(self) -> None:
        problems = []
        key = self.secret_key.get_secret_value() if self.secret_key else ""
        if not key:
            problems.append("MPLEX_SECRET_KEY is required in prod")
        elif weak_secret_reason(key):
            problems.append(f"MPLEX_SECRET_KEY is unsafe: {weak_secret_reason(key)}")
        tokens = parse_tokens(self.engine_tokens.get_secret_value()) if self.engine_tokens else ()
        if not tokens:
            problems.append("MPLEX_ENGINE_TOKENS is required in prod (the engines' platform credential)")
        for i, token in enumerate(tokens, 1):
            if weak_secret_reason(token):
                problems.append(f"MPLEX_ENGINE_TOKENS token {i} is unsafe: {weak_secret_reason(token)}")
        if not self.database_url:
            problems.append("MPLEX_DATABASE_URL is required in prod (no embedded Postgres)")
        if not self.redis_url:
            problems.append("MPLEX_REDIS_URL is required in prod (no embedded Redis)")
        if not self.storage_url:
            problems.append("MPLEX_STORAGE_URL is required in prod (a local directory is not shared by replicas)")
        if self.cookie_secure is False:
            problems.append("MPLEX_COOKIE_SECURE=false is not allowed in prod")
        if problems:
            raise UnsafeSettings("; ".join(problems))

    @property
    def session_cookie_secure(self) -> bool:
        return self.cookie_secure if self.cookie_secure is not None else self.env == "prod"

    @property
    def state_dir(self) -> Path:
        """Where embedded servers keep their data and ports."""
        return self.home / "state"

    @property
    def engine_token_list(self) -> tuple[str, ...]:
        """The engine tokens accepted (all) and sent (the first): services.common.internal_auth's input."""
        assert self.engine_tokens is not None  # set by the validator
        return parse_tokens(self.engine_tokens.get_secret_value())

    def secret(self) -> str:
        assert self.secret_key is not None  # set by the validator
        return self.secret_key.get_secret_value()

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, (redact_url(value) if name.endswith("_url") and isinstance(value, str) else value)


def weak_secret_reason(key: str) -> str | None:
    if len(key) < MIN_SECRET_KEY_LEN:
        return f"shorter than {MIN_SECRET_KEY_LEN} characters"
    if key.lower() in _KNOWN_WEAK_SECRETS or any(key.lower().startswith(w) for w in ("changeme", "changethis")):
        return "a well-known placeholder"
    if len(set(key)) < 10:
        return "too few distinct characters"
    return None


def normalize_database_url(url: str) -> str:
    """Use the psycopg 3 driver whatever Postgres scheme was given (`postgres://`, `postgresql://`)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("database URL must look like postgresql+psycopg://user:pass@host:port/db")
    if scheme in ("postgres", "postgresql", "postgresql+psycopg", "postgresql+psycopg2"):
        return f"postgresql+psycopg://{rest}"
    raise ValueError(f"unsupported database URL scheme {scheme!r}: Multiplex runs on PostgreSQL")


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and reprs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


def _local_secret(home: Path, name: str) -> str:
    """Dev/test: generate a secret once per home and keep it in <home>/<name> (0600).

    Published with link(2) from a private temp file, so concurrent first starts agree on one value.
    """
    path = home / name
    if path.exists():
        return path.read_text().strip()
    home.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=home, prefix=f".{name}.")
    try:
        os.write(fd, (secrets.token_urlsafe(48) + "\n").encode())
        os.fsync(fd)
        os.close(fd)
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race; use its value
    finally:
        os.unlink(tmp)
    return path.read_text().strip()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, validated once. Tests that change MPLEX_* call `get_settings.cache_clear()`."""
    return Settings()
