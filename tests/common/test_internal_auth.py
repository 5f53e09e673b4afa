"""The engine credential's contract: parsing, comparison, and the middleware on scopes other than plain HTTP
(the engine's routes themselves are checked against a real engine in tests/engine/test_server.py)."""
import asyncio

import pytest

from services.common.internal_auth import InternalAuthMiddleware, bearer_of, client_headers, verify
from services.common.settings import parse_tokens


def test_tokens_parse_as_a_rotation_list():
    assert parse_tokens("new, old ,,") == ("new", "old")
    assert parse_tokens(" , ") == ()
    assert client_headers(["new", "old"]) == {"Authorization": "Bearer new"}


def test_every_accepted_token_verifies_and_nothing_else():
    tokens = ("new-token", "old-token")
    assert verify("new-token", tokens) and verify("old-token", tokens)
    for presented in (None, "", "new-toke", "new-tokenx", "new-token,old-token", "NEW-TOKEN"):
        assert not verify(presented, tokens)


def test_bearer_is_read_from_raw_headers():
    assert bearer_of([(b"Authorization", b"bearer  tok ")]) == "tok"
    assert bearer_of([(b"authorization", b"Basic tok")]) is None
    assert bearer_of([(b"x-other", b"Bearer tok")]) is None


def _run(app, scope) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_websockets_need_the_token_and_lifespan_passes():
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["type"])

    app = InternalAuthMiddleware(inner, tokens=["tok"])
    assert _run(app, {"type": "websocket", "path": "/ws", "headers": []}) == [{"type": "websocket.close", "code": 1008}]
    _run(app, {"type": "websocket", "path": "/ws", "headers": [(b"authorization", b"Bearer tok")]})
    _run(app, {"type": "lifespan"})
    assert reached == ["websocket", "lifespan"]
    with pytest.raises(ValueError):
        InternalAuthMiddleware(inner, tokens=[])
