"""The platform credential that internal endpoints (every engine endpoint but its probes) require.

One owner for the contract both sides import: the header (`Authorization: Bearer <token>`), how the
accepted tokens are loaded (settings `engine_tokens`: comma-separated, the first is the one clients send,
all are accepted, so a token rotates without downtime), constant-time comparison, the pure-ASGI middleware
that answers 401 in OpenAI error shape, and the headers a client (the gateway, tools, tests) sends.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Sequence
from typing import Protocol

from services.common.openai_protocol import error_body
from services.common.wire import FAULT_ENGINE, FAULT_HEADER

SCHEME = "Bearer"
ERROR_CODE = "invalid_engine_credential"
# Kubelet probes cannot carry a secret header (httpGet headers are literals): /health, which says only that
# the process and its step loop are alive, is the one open path. Readiness to take requests is not a
# probe's business here: the gateway routes by the Redis registry, which a draining engine leaves.
OPEN_PATHS = frozenset({"/health"})


class HasEngineTokens(Protocol):
    """The settings object (services.common.settings.Settings, which owns how the tokens are configured)."""

    @property
    def engine_token_list(self) -> tuple[str, ...]: ...


def engine_tokens(settings: HasEngineTokens) -> tuple[str, ...]:
    """The engine tokens this process accepts (an engine) or sends, first entry (a client)."""
    return settings.engine_token_list


def client_headers(tokens: HasEngineTokens | Sequence[str]) -> dict[str, str]:
    """What a caller of an engine endpoint sends: the first accepted token."""
    if not isinstance(tokens, Sequence):
        tokens = engine_tokens(tokens)
    return {"Authorization": f"{SCHEME} {tokens[0]}"}


def verify(presented: str | None, tokens: Iterable[str]) -> bool:
    """Constant time in the presented value, compared against every accepted token (no early exit)."""
    if not presented:
        return False
    given = presented.encode()
    ok = False
    for token in tokens:
        ok |= hmac.compare_digest(given, token.encode())
    return ok


def bearer_of(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header in raw ASGI headers, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == SCHEME.lower() else None
    return None


_UNAUTHORIZED = json.dumps(error_body(
    "This endpoint requires the platform's engine credential (Authorization: Bearer <engine token>).",
    "authentication_error", None, ERROR_CODE,
)).encode()


class InternalAuthMiddleware:
    """Pure ASGI: refuses every HTTP request (and websocket) but `open_paths` unless it carries an accepted
    token. Sits outside the app's routing, so routes added later are covered without being listed."""

    def __init__(self, app, *, tokens: Sequence[str], open_paths: frozenset[str] = OPEN_PATHS):
        if not tokens or not all(tokens):
            raise ValueError("the internal auth middleware needs at least one non-empty token")
        self.app = app
        self.tokens = tuple(tokens)
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan" or (kind == "http" and scope["path"] in self.open_paths):
            return await self.app(scope, receive, send)
        if verify(bearer_of(scope.get("headers", ())), self.tokens):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b'Bearer realm="mplex-engine"'),
                # Not the tenant request's fault: a gateway whose token this engine refuses tries another engine.
                (FAULT_HEADER.encode(), FAULT_ENGINE.encode()),
            ],
        })
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
