"""Token-metered quotas in Redis: one Lua script checks and reserves a request's worst case against
every window of its tenant and key; another replaces the reservation by actual usage, exactly once.

Windows: tokens/min and requests/min (fixed minute windows), concurrent requests (a sorted set of
live reservations that heals itself when a holder dies) and monthly tokens (calendar month, UTC). Every
key has a TTL. A refusal's Retry-After is the time to the end of the window that refused, never a key's
TTL (minute keys outlive their minute so the usage API can still read them).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from typing import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

RESERVATION_TTL_S = 3600  # the longest a request may hold a reservation before it is presumed dead
MINUTE_TTL_S = 120
MONTH_TTL_S = 40 * 86400
# A concurrency slot frees when any in-flight request of the scope finishes, which nobody can predict: a
# short retry is the honest hint (most requests last seconds; clients back off further on their own).
CONCURRENT_RETRY_S = 1.0

_WINDOW_WORDS = {
    "tokens_per_min": "tokens per minute",
    "requests_per_min": "requests per minute",
    "concurrent": "concurrent requests",
    "monthly_tokens": "monthly token budget",
}


@dataclass(frozen=True, slots=True)
class Limits:
    tokens_per_min: int | None = None
    requests_per_min: int | None = None
    concurrent: int | None = None
    monthly_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Scope:
    kind: str  # "tenant" | "key"
    id: str
    limits: Limits


class QuotaExceeded(Exception):
    """A window refused the request. `retryable` is False when the request alone needs more than the
    limit (it can never be admitted): then there is no Retry-After, and `x-should-retry: false` tells
    OpenAI SDKs not to retry."""

    def __init__(self, window: str, scope: str, retry_after_s: float, limit: int, current: int, headers: dict[str, str],
                 needed: int = 0):
        self.window, self.scope, self.retry_after_s = window, scope, retry_after_s
        self.limit, self.current, self.headers, self.needed = limit, current, headers, needed
        super().__init__(self.message)

    @property
    def is_budget(self) -> bool:
        return self.window == "monthly_tokens"

    @property
    def retryable(self) -> bool:
        return self.needed <= self.limit

    @property
    def message(self) -> str:
        """The OpenAI error message for this refusal."""
        words = _WINDOW_WORDS.get(self.window, self.window.replace("_", " "))
        if self.retryable:
            return (f"Rate limit reached for {self.scope} {words}: limit {self.limit}, in use {self.current}, "
                    f"this request needs {self.needed}. Retry after {self.headers.get('retry-after', '1')}s.")
        if self.window == "concurrent":
            fix = ("It runs one engine sequence per prompt and per choice (n); send fewer prompts or a smaller n per "
                   "request, or ask for a higher limit.")
        elif self.window == "requests_per_min":
            fix = "Ask for a higher limit."
        else:
            fix = ("Reduce the prompt or max_tokens (the quota reserves prompt + max_tokens for every choice), or ask "
                   "for a higher limit.")
        return (f"Request too large for {self.scope} {words}: limit {self.limit}, this request needs {self.needed}, so "
                f"it can never be admitted and retrying will not help. {fix}")


class QuotaUnavailable(Exception):
    """Redis could not be reached and the gateway fails closed."""


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    tokens: int
    headers: dict[str, str]
    enforced: bool = True  # False when Redis was down and the gateway failed open


def _script(name: str) -> str:
    return resources.files("services.gateway").joinpath(name).read_text()


def _seconds_up(ms: float) -> int:
    return math.ceil(max(0, round(ms)) / 1000)  # round first: float noise must not add a second


def _duration(ms: float) -> str:
    """OpenAI's x-ratelimit-reset-* format ("1m0s", "57s", "100ms"); whole seconds round up like Retry-After."""
    if round(ms) < 1000:
        return f"{max(0, round(ms))}ms"
    s = _seconds_up(ms)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


def _too_large_headers(window: str, limit: int) -> dict[str, str]:
    headers = {"x-should-retry": "false"}
    if window in ("tokens_per_min", "requests_per_min"):
        unit = "tokens" if window == "tokens_per_min" else "requests"
        headers[f"x-ratelimit-limit-{unit}"] = str(limit)
    return headers


def window_end(window: str, now: float) -> float:
    """When the window holding `now` ends (epoch seconds), i.e. when a refusal by it can first succeed."""
    if window in ("tokens_per_min", "requests_per_min"):
        return (now // 60 + 1) * 60
    if window == "monthly_tokens":
        t = datetime.fromtimestamp(now, timezone.utc)
        return datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=timezone.utc).timestamp()
    assert window == "concurrent", window
    return now + CONCURRENT_RETRY_S


class _PipelinedScript:
    """One Lua script whose calls of one event-loop iteration go to Redis as one pipeline (each call still atomic,
    each caller its own answer). One EVALSHA per call -- a pooled connection checked out under a timeout, a
    health-check ping on one idle past its interval, a write and a read each -- was a fifth of the gateway loop's
    CPU with 256 streamed requests at once (README, serving stop 49). A caller waits for at most the batch it
    joined. A script Redis lost (a restart) is loaded again and its calls sent again; a batch that fails raises to
    each of its callers, none is left waiting. `orphaned(args, answer)`: a call that succeeded after its caller was
    cancelled (the client hung up)."""

    BATCH = 512

    def __init__(self, redis: aioredis.Redis, src: str, orphaned: Callable[[list, object], None] | None = None):
        self.redis, self.src, self.orphaned = redis, src, orphaned
        self.sha: str | None = None
        self._calls: list[tuple[list[str], list, asyncio.Future]] = []
        self._flushing = False

    async def call(self, keys: list[str], args: list):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.append((keys, args, fut))
        if not self._flushing:
            self._flushing = True
            loop.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._calls:
                await asyncio.sleep(0)  # let the calls of this loop iteration join the batch
                batch, self._calls = self._calls[:self.BATCH], self._calls[self.BATCH:]
                try:
                    if self.sha is None:
                        self.sha = await self.redis.script_load(self.src)
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for keys, args, _ in batch:
                            pipe.evalsha(self.sha, len(keys), *keys, *args)
                        results = await pipe.execute(raise_on_error=False)
                except Exception as exc:  # noqa: BLE001 -- RedisError/OSError: the store is down; anything else a fault
                    results = [exc] * len(batch)  # of this batch: every caller hears it
                retry = []
                for call, r in zip(batch, results):
                    keys, args, fut = call
                    if isinstance(r, NoScriptError):  # Redis restarted and lost its script cache
                        self.sha = None
                        retry.append(call)
                    elif fut.done():  # its caller was cancelled while the batch ran
                        if self.orphaned is not None and not isinstance(r, Exception):
                            self.orphaned(args, r)
                    elif isinstance(r, Exception):
                        fut.set_exception(r)
                    else:
                        fut.set_result(r)
                self._calls = retry + self._calls
        finally:
            self._flushing = False


class Quotas:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        fail_open: bool = False,
        prefix: str = "q",
        month_usage: Callable[[str, str], Awaitable[int]] | None = None,
    ):
        self.redis = redis
        self.fail_open = fail_open
        self.prefix = prefix
        self.month_usage = month_usage  # (scope kind, id) -> tokens used this month per the ledger
        self._reserve = _PipelinedScript(redis, _script("quota_reserve.lua"), self._release_orphan)
        self._settle = _PipelinedScript(redis, _script("quota_settle.lua"))
        self._releasing: set[asyncio.Task] = set()
        self._keys_minute: int | None = None
        self._keys_cache: dict[tuple[str, str], dict[str, str]] = {}

    def _keys(self, scope: Scope, now: float) -> dict[str, str]:
        """The scope's window keys at `now`: the same for a whole minute (a month ends on a minute's end), so kept
        for the minute -- the month's date formatting per scope per request was a few percent of the gateway's loop.
        The cache holds the scopes seen this minute only."""
        minute = int(now // 60)
        if self._keys_minute != minute:
            self._keys_minute, self._keys_cache = minute, {}
        cached = self._keys_cache.get((scope.kind, scope.id))
        if cached is not None:
            return cached
        month = datetime.fromtimestamp(minute * 60, timezone.utc).strftime("%Y%m")
        base = f"{self.prefix}:{scope.kind}:{scope.id}"
        keys = self._keys_cache[(scope.kind, scope.id)] = {
            "tokens_per_min": f"{base}:tpm:{minute}",
            "requests_per_min": f"{base}:rpm:{minute}",
            "concurrent": f"{base}:conc",
            "monthly_tokens": f"{base}:tok:{month}",
        }
        return keys

    def _release_orphan(self, args: list, answer) -> None:
        """A reservation made for a request cancelled meanwhile is released now, not held for its hour-long TTL."""
        if int(answer[0]) == 1:
            task = asyncio.get_running_loop().create_task(self.settle(Reservation(args[1], 0, {}), 0))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def reserve(self, request_id: str, scopes: list[Scope], tokens: int, now: float | None = None, *,
                      concurrency: int = 1) -> Reservation:
        """Reserve `tokens` (the worst case) and one request against every window of `scopes`.

        `concurrency` is how many engine sequences the request runs at once (prompts x n): it holds that
        many units of the concurrent window until settled; requests/min still counts it once."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {concurrency}")
        now = time.time() if now is None else now
        keys = [f"{self.prefix}:res:{request_id}"]
        args: list = [int(now * 1000), request_id, RESERVATION_TTL_S, 0]
        checks: list[tuple[Scope, str]] = []
        for scope in scopes:
            names = self._keys(scope, now)
            for window, kind, amount, ttl in (
                ("tokens_per_min", "add", tokens, MINUTE_TTL_S),
                ("requests_per_min", "add", 1, MINUTE_TTL_S),
                ("concurrent", "concurrent", concurrency, RESERVATION_TTL_S),
                ("monthly_tokens", "add", tokens, MONTH_TTL_S),
            ):
                limit = getattr(scope.limits, window)
                if limit is None and window in ("concurrent", "monthly_tokens"):
                    continue  # nothing to enforce; tokens/requests per minute are always counted for headers
                if limit is not None and amount > limit:  # waiting cannot help: refuse now, touching nothing
                    raise QuotaExceeded(window, scope.kind, 0, limit, 0, _too_large_headers(window, limit), amount)
                keys.append(names[window])
                args += [kind, -1 if limit is None else limit, amount, ttl, f"{scope.kind}:{window}"]
                checks.append((scope, window))
        args[3] = len(checks)
        try:
            await self._seed_months(scopes, now)
            result = await self._reserve.call(keys, args)
        except (RedisError, OSError) as exc:
            if self.fail_open:
                return Reservation(request_id, tokens, {}, enforced=False)
            raise QuotaUnavailable(f"quota store unavailable: {exc.__class__.__name__}") from None
        if int(result[0]) == 1:
            return Reservation(request_id, tokens, self._headers(checks, [int(x) for x in result[1:]], now))
        name = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        if name == "duplicate_request":
            raise QuotaExceeded("duplicate_request", "request", 0, 0, 0, {})
        scope_kind, window = name.split(":", 1)
        limit, current = int(result[2]), int(result[3])
        retry_ms = (window_end(window, now) - now) * 1000
        headers = {"retry-after": str(max(1, _seconds_up(retry_ms)))}
        if window in ("tokens_per_min", "requests_per_min"):
            unit = "tokens" if window == "tokens_per_min" else "requests"
            headers |= {f"x-ratelimit-limit-{unit}": str(limit), f"x-ratelimit-remaining-{unit}": str(max(0, limit - current)),
                        f"x-ratelimit-reset-{unit}": _duration(retry_ms)}
        needed = {"requests_per_min": 1, "concurrent": concurrency}.get(window, tokens)
        raise QuotaExceeded(window, scope_kind, retry_ms / 1000, limit, current, headers, needed)

    async def _seed_months(self, scopes: list[Scope], now: float) -> None:
        """A missing monthly counter (new month, or Redis lost it) starts from the ledger, not from zero."""
        for scope in scopes:
            if scope.limits.monthly_tokens is None or self.month_usage is None:
                continue
            key = self._keys(scope, now)["monthly_tokens"]
            if not await self.redis.exists(key):
                used = await self.month_usage(scope.kind, scope.id)
                await self.redis.set(key, used, nx=True, ex=MONTH_TTL_S)

    def _headers(self, checks: list[tuple[Scope, str]], remaining: list[int], now: float) -> dict[str, str]:
        headers: dict[str, str] = {}
        reset = _duration((window_end("tokens_per_min", now) - now) * 1000)
        for unit, window in (("tokens", "tokens_per_min"), ("requests", "requests_per_min")):
            best: tuple[int, int] | None = None
            for (scope, w), left in zip(checks, remaining):
                limit = getattr(scope.limits, w)
                if w == window and limit is not None and (best is None or left < best[1]):
                    best = (limit, left)
            if best is not None:
                headers[f"x-ratelimit-limit-{unit}"] = str(best[0])
                headers[f"x-ratelimit-remaining-{unit}"] = str(max(0, best[1]))
                headers[f"x-ratelimit-reset-{unit}"] = reset
        return headers

    async def settle(self, reservation: Reservation, actual_tokens: int) -> bool:
        """Replace the reservation by actual usage. True if this call settled it (exactly-once).

        Concurrent settles share one pipelined round trip (they run after the response is sent). Redis down: False
        (reservations expire on their own; windows heal within their TTL)."""
        if not reservation.enforced:
            return False
        rid = reservation.request_id
        try:
            r = await self._settle.call([f"{self.prefix}:res:{rid}"], [actual_tokens, rid])
        except (RedisError, OSError):
            return False
        return isinstance(r, int) and r == 1
