"""The gateway's side of the internal engine stream: open it on the best engine, retrying on another
engine while nothing has been streamed yet; parse NDJSON lines into deltas; close = abort upstream.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from services.common.openai_protocol import Delta, Usage
from services.gateway.router import EngineInfo, Router

log = logging.getLogger("mplex.gateway.upstream")


class NoEngineAvailable(Exception):
    """No engine serving this model accepted the request."""


class UpstreamRefused(Exception):
    """The engine refused the request itself (4xx): passed to the client, never retried."""

    def __init__(self, status: int, body: dict[str, Any]):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(err.get("message", "refused by the engine"))
        self.status, self.body = status, body


@dataclass(slots=True)
class StreamResult:
    """What one choice's stream ended with (filled as the stream is consumed)."""

    engine_id: str = ""
    usage: Usage = field(default_factory=Usage)
    compute_seconds: float = 0.0
    finish_reason: str | None = None
    delivered_tokens: int = 0
    first_token_at: float | None = None
    attempts: int = 0


class _EngineFailed(Exception):
    pass


_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


async def open_choice(
    client: aiohttp.ClientSession,
    router: Router,
    engines: list[EngineInfo],
    payload: dict[str, Any],
    index: int,
    result: StreamResult,
    clock,
) -> AsyncIterator[tuple[Delta, Usage | None]]:
    """Yields (delta, usage-on-last) for one choice. Closing the iterator closes the engine stream."""
    request_id = payload["request_id"]
    last_error: Exception | None = None
    body = orjson.dumps(payload)
    headers = {"content-type": "application/json", "x-request-id": request_id}
    for engine in engines:
        result.attempts += 1
        resp: aiohttp.ClientResponse | None = None
        router.opened(engine.id)
        try:
            resp = await client.post(f"{engine.url}/internal/v1/generate", data=body, headers=headers)
            if 400 <= resp.status < 500:
                raise UpstreamRefused(resp.status, orjson.loads(await resp.read()))
            if resp.status >= 500:
                raise _EngineFailed(f"engine {engine.id} answered {resp.status}")
            first = await resp.content.readline()
            if not first:
                raise _EngineFailed(f"engine {engine.id} closed the stream before the first token")
        except (*_RETRYABLE, _EngineFailed) as exc:  # nothing streamed yet: the next engine may serve it
            last_error = exc
            log.warning("engine %s failed before the first token (%r); trying the next", engine.id, exc)
            if resp is not None:
                resp.close()
            router.closed(engine.id)
            continue
        except BaseException:
            if resp is not None:
                resp.close()
            router.closed(engine.id)
            raise
        # Committed to this engine: from here on a failure ends the stream (tokens were delivered).
        result.engine_id = engine.id
        finished = False
        try:
            line: bytes = first
            while line:
                line = line.strip()
                if line:
                    item = orjson.loads(line)
                    result.delivered_tokens += len(item["token_ids"])
                    if result.first_token_at is None and item["token_ids"]:
                        result.first_token_at = clock()
                    usage = None
                    if "usage" in item:
                        u = item["usage"]
                        usage = Usage(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"])
                        result.usage = usage
                        result.compute_seconds = float(u.get("compute_seconds", 0.0))
                        result.finish_reason = item["finish_reason"]
                        finished = True
                    yield Delta(index, item["text"], item["token_ids"], item.get("logprobs"), item["finish_reason"]), usage
                line = await resp.content.readline()
        finally:
            if finished:
                resp.release()  # whole body read: the connection goes back to the pool
            else:
                resp.close()  # closing the connection makes the engine abort and free the sequence's KV
            router.closed(engine.id)
        return
    raise NoEngineAvailable(f"no engine could serve the request ({last_error})")
