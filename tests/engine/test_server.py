"""The engine's HTTP server through the official OpenAI SDK: chat, completions, streaming, errors,
and client disconnects that free the sequence's KV blocks; its platform credential on every route but the
probes (with a rotation token); adapter files only from the object store or the engine's cache."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
import websockets.exceptions
import websockets.sync.client as ws_client
from prometheus_client.parser import text_string_to_metric_families

from services.adapters.storage import ObjectStore
from services.common.engine_wire import STREAMS_PATH, close_command
from services.common.internal_auth import ERROR_CODE, OPEN_PATHS, client_headers
from services.engine.lora.sources import CODE as PATH_NOT_ALLOWED

TOKEN = "engine-test-token-current-0123456789abcdef"
OLD_TOKEN = "engine-test-token-previous-0123456789abcde"  # still accepted during a rotation
AUTH = client_headers([TOKEN])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine_home(tmp_path_factory):
    """The server's MPLEX_HOME: its object store is <home>/objects."""
    return tmp_path_factory.mktemp("engine-home")


@pytest.fixture(scope="module")
def server(demo_kit, engine_home, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("engine") / "engine.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLEX_ENV": "test", "MPLEX_HOME": str(engine_home),
           "MPLEX_ENGINE_TOKENS": f"{TOKEN},{OLD_TOKEN}"}
    env.pop("MPLEX_STORAGE_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "engine", "serve", "--model", str(demo_kit.base_dir),
         "--served-model-name", demo_kit.model_name, "--port", str(port), "--kv-memory-mb", "64"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, "engine server exited"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=TOKEN, max_retries=0)


def _metric(url: str, name: str, default: float | None = None, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=AUTH).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    if default is not None:
        return default
    raise AssertionError(f"{name}{labels} is not exported")


def _wait_idle(url: str) -> None:
    deadline = time.time() + 20
    while time.time() < deadline:
        if _metric(url, "mplex_engine_requests_running") == 0 and _metric(url, "mplex_engine_kv_blocks_used") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("engine did not return to idle: running sequences or KV blocks left")


def test_models_lists_the_demo_model(client, demo_kit):
    assert [m.id for m in client.models.list().data] == [demo_kit.model_name]


def test_chat_completion_is_sensible(client, demo_kit):
    r = client.chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_streaming_chat_with_usage(client, demo_kit):
    stream = client.chat.completions.create(
        model=demo_kit.model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_many_concurrent_streams_are_the_non_streamed_answers_chunk_by_chunk(server, demo_kit):
    """Streamed replies take the fast path (the front-end's dispatch writes each step's chunk to the connection
    while the response waits): 48 concurrent streams through the real OpenAI SDK -- completions and chat, with
    and without a stop string -- carry exactly the non-streamed answers' text, one well-formed chunk per event,
    the finish reason last and the usage after it."""
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=TOKEN, max_retries=0)
    words = ["Hello", "What is the capital of France?", "Count to five.", "Name three colours.", "Repeat: red blue"]
    cases = []
    for i in range(48):
        kw = {"model": demo_kit.model_name, "max_tokens": 24 + i % 9, "temperature": 0}
        if i % 3 == 2:
            kw["stop"] = [" the", "."]
        if i % 2:
            cases.append(("chat", {**kw, "messages": [{"role": "user", "content": words[i % len(words)]}]}))
        else:
            cases.append(("completion", {**kw, "prompt": words[i % len(words)] + f" {i}", "extra_body": {"ignore_eos": i % 4 == 0}}))

    async def one(kind, kw):
        api = aclient.chat.completions if kind == "chat" else aclient.completions
        full = await api.create(**kw)
        chunks = [c async for c in await api.create(**kw, stream=True, stream_options={"include_usage": True})]
        pieces = [c.choices[0].delta.content if kind == "chat" else c.choices[0].text for c in chunks if c.choices]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        expected = full.choices[0].message.content if kind == "chat" else full.choices[0].text
        assert "".join(p or "" for p in pieces) == expected
        assert reasons[-1] == full.choices[0].finish_reason and not any(reasons[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        return len(chunks)

    async def main():
        try:
            return await asyncio.gather(*(one(kind, kw) for kind, kw in cases))
        finally:
            await aclient.close()

    counts = asyncio.run(main())
    assert sum(counts) > 48 * 10  # a chunk a step, not one at the end
    _wait_idle(server)


def test_completions_and_n_choices(client, demo_kit):
    r = client.completions.create(model=demo_kit.model_name, prompt="Hello", max_tokens=5, n=2, temperature=0.8, seed=3)
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 10
    s = list(client.completions.create(model=demo_kit.model_name, prompt="Hello", max_tokens=5, stream=True))
    assert sum(len(c.choices[0].text) for c in s if c.choices) > 0


def test_repeated_prompt_reports_cached_tokens(client, demo_kit):
    messages = [{"role": "system", "content": "Answer briefly. " * 20}, {"role": "user", "content": "Hello"}]
    client.chat.completions.create(model=demo_kit.model_name, messages=messages, max_tokens=3)
    r = client.chat.completions.create(model=demo_kit.model_name, messages=messages, max_tokens=3)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(client, demo_kit, kwargs, param):
    args = {"model": demo_kit.model_name, "messages": [{"role": "user", "content": "Hello"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**args)
    err = exc.value.body
    assert exc.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]
    ok = client.chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"


def test_client_disconnect_mid_stream_aborts_and_frees_kv(server, demo_kit):
    body = {"model": demo_kit.model_name, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert _metric(server, "mplex_engine_requests_running") >= 1
    _wait_idle(server)
    assert _metric(server, "mplex_engine_requests_total", finish_reason="abort") >= 1


def test_client_disconnect_on_a_non_streaming_request_aborts(server, demo_kit):
    # The server checks for a hang-up every 0.1 s; 480 tokens take several times the 0.1 s timeout plus that.
    body = {"model": demo_kit.model_name, "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
    aborted = _metric(server, "mplex_engine_requests_total", 0.0, finish_reason="abort")  # 0 before any abort
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=0.1)
    _wait_idle(server)
    assert _metric(server, "mplex_engine_requests_total", finish_reason="abort") == aborted + 1


# -- the platform credential -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_routes(tiny_model) -> list[tuple[str, str]]:
    """(method, path) of every route of the engine app, path parameters filled in: read from `create_app` itself,
    so a route added later is covered without being listed here."""
    from starlette.routing import Route, WebSocketRoute

    from services.engine.async_engine import AsyncEngine
    from services.engine.server import create_app
    from tests.engine.conftest import make_engine

    core = make_engine(tiny_model)
    app = create_app(AsyncEngine(core), engine_tokens=[TOKEN])
    routes = []
    for route in app.routes:
        if isinstance(route, WebSocketRoute):  # the streams socket: the middleware closes it before the handshake
            routes.append(("WEBSOCKET", route.path))
            continue
        assert isinstance(route, Route), f"{route!r}: check how the middleware covers it"
        path = route.path.replace("{name}", "some-adapter")
        assert "{" not in path, path
        routes += [(method, path) for method in sorted(route.methods or ())]
    core.adapters.shutdown()
    return routes


def test_every_route_but_the_probes_requires_the_engine_credential(server, engine_routes):
    paths = {p for _, p in engine_routes}
    assert {"/internal/v1/generate", "/internal/v1/adapters", "/drain", "/metrics", "/v1/chat/completions",
            "/openapi.json"} <= paths and OPEN_PATHS <= paths
    for method, path in engine_routes:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            if method == "WEBSOCKET":
                with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                    ws_client.connect(server.replace("http://", "ws://") + path, additional_headers=headers).close()
                assert refused.value.response.status_code == 403, (path, headers)
                continue
            r = httpx.request(method, f"{server}{path}", headers=headers, json={} if method == "POST" else None)
            if path in OPEN_PATHS:
                assert r.status_code == 200, (method, path, r.status_code)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"].startswith("Bearer")
            if method != "HEAD":
                err = r.json()["error"]
                assert err["code"] == ERROR_CODE and err["type"] == "authentication_error" and err["message"]
                assert set(err) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # all an unauthenticated probe learns
    assert ("WEBSOCKET", STREAMS_PATH) in engine_routes
    with ws_client.connect(server.replace("http://", "ws://") + STREAMS_PATH, additional_headers=AUTH) as ws:
        ws.send(close_command(1))  # with the credential: the socket is open and takes commands
        ws.ping().wait(10)


@pytest.mark.parametrize("value", [
    f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN},{OLD_TOKEN}", "Bearer",
])
def test_near_miss_credentials_are_refused(server, value):
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": value}).status_code == 401


def test_the_current_and_the_rotation_token_both_work(server, demo_kit):
    for token in (TOKEN, OLD_TOKEN):
        client = openai.OpenAI(base_url=f"{server}/v1", api_key=token, max_retries=0)
        assert [m.id for m in client.models.list().data] == [demo_kit.model_name]
        assert httpx.get(f"{server}/metrics", headers=client_headers([token])).status_code == 200
    assert httpx.get(f"{server}/v1/models", headers={"authorization": f"bearer {TOKEN}"}).status_code == 200


# -- adapter files only from the stores -----------------------------------------------------------------------------
def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == PATH_NOT_ALLOWED and err["type"] == "invalid_request_error"


def test_adapter_paths_outside_the_stores_are_refused_and_the_engine_keeps_serving(server, engine_home, demo_kit,
                                                                                   client):
    store = engine_home / "objects"
    demo = demo_kit.adapters["uppercase"]
    stored = ObjectStore(f"file://{store}").put_version(demo.path)
    link = store / "adapters" / "link-out"
    link.symlink_to(demo.path, target_is_directory=True)  # inside the store, pointing out of it
    load = f"{server}/internal/v1/adapters"
    for path in ("/etc", "file:///tmp/x", str(demo.path), str(link), f"file://{link}",
                 f"{store}/{os.path.relpath(demo.path, store)}", f"{store}/../../etc", "s3://elsewhere/adapters/x"):
        with_id = {"name": "evil", "path": path, "content_id": stored.sha256}
        _refused(httpx.post(load, headers=AUTH, json=with_id), "path")
        _refused(httpx.post(load, headers=AUTH, json={"name": "evil", "path": path}), "path")

    def generate(uri: str) -> httpx.Response:
        return httpx.post(f"{server}/internal/v1/generate", headers=AUTH, timeout=60, json={
            "request_id": uuid.uuid4().hex, "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2},
            "adapter": {"content_id": stored.sha256, "name": "upper", "uri": uri}})

    for uri in ("/etc", str(demo.path), f"file://{link}", "file:///tmp/x"):
        _refused(generate(uri), "adapter.uri")
    assert generate(stored.uri).status_code == 200  # the same adapter from the store: loaded on demand, served

    r = httpx.post(load, headers=AUTH, timeout=60, json={"name": "upper", "path": stored.uri})
    assert r.status_code == 200, r.text
    assert r.json()["content_id"] == stored.sha256
    prompt = [{"role": "user", "content": "hello world"}]
    assert client.chat.completions.create(model="upper", messages=prompt, max_tokens=4).choices[0].message.content
    assert client.chat.completions.create(model=demo_kit.model_name, messages=prompt, max_tokens=4).choices
    assert "evil" not in [m.id for m in client.models.list().data]


def test_the_internal_stream_speaks_one_wire_version(server):
    """The gateway sends the wire version it speaks; an engine that speaks another refuses as its own fault (so
    the gateway tries the next engine) before reading the body, and every line of a stream is a StreamItem."""
    from services.common.engine_wire import GENERATE_PATH, WIRE_HEADER, WIRE_VERSION, GenerateRequest, StreamItem
    from services.common.wire import FAULT_ENGINE, FAULT_HEADER, SamplingParams

    body = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=3, temperature=0.0)).encode()
    url = f"{server}{GENERATE_PATH}"
    newer = httpx.post(url, headers={**AUTH, WIRE_HEADER: str(WIRE_VERSION + 1)}, content=b'{"v2": true}', timeout=60)
    assert newer.status_code == 503 and newer.headers[FAULT_HEADER] == FAULT_ENGINE
    assert newer.json()["error"]["code"] == "wire_version_unsupported"
    ok = httpx.post(url, headers={**AUTH, WIRE_HEADER: str(WIRE_VERSION), "content-type": "application/json"},
                    content=body, timeout=60)
    assert ok.status_code == 200, ok.text
    items = [StreamItem.decode(line) for line in ok.content.splitlines() if line.strip()]
    assert sum(len(i.token_ids) for i in items) == 3 and items[-1].usage is not None
    assert items[-1].usage.completion_tokens == 3 and items[-1].finish_reason == "length"


def test_structured_outputs_on_an_adapter_through_the_sdk(server, engine_home, demo_kit, client):
    """`parse` with pydantic models on an adapter, streamed and not, greedy and sampled: every answer parses;
    a schema outside the supported subset is a 400 naming the field and the engine serves on."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.structured_models import MODELS

    stored = ObjectStore(f"file://{engine_home / 'objects'}").put_version(demo_kit.adapters["reverse"].path)
    r = httpx.post(f"{server}/internal/v1/adapters", headers=AUTH, timeout=60, json={"name": "rev-s", "path": stored.uri})
    assert r.status_code == 200, r.text

    def one(i: int):
        fmt = MODELS[i % len(MODELS)]
        kw = dict(model="rev-s", messages=[{"role": "user", "content": f"Reverse the words: a b {i}"}],
                  response_format=fmt, temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=400)
        if i % 4 < 2:
            return fmt, client.chat.completions.parse(**kw).choices[0]
        with client.chat.completions.stream(**kw) as s:
            return fmt, s.get_final_completion().choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(40)))
    for fmt, choice in results:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, fmt), choice

    bad = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "rev-s", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}}}}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "response_format"  # the grammar engine's own refusal
    assert client.chat.completions.create(model="rev-s", messages=[{"role": "user", "content": "hi"}], max_tokens=3)


def test_a_coalesced_internal_stream_is_the_same_answer_in_two_lines(server):
    """The gateway's non-streamed requests ask for the first step and then the rest in one line
    (COALESCE_HEADER): the same tokens, text and usage as the line-per-step stream."""
    from services.common.engine_wire import COALESCE_HEADER, GENERATE_PATH, WIRE_HEADER, WIRE_VERSION, GenerateRequest, StreamItem
    from services.common.wire import SamplingParams

    def run(coalesce: bool) -> list[StreamItem]:
        body = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 2, 3, 4, 5],
                               sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                       logprobs=1)).encode()
        headers = {**AUTH, WIRE_HEADER: str(WIRE_VERSION), "content-type": "application/json"}
        if coalesce:
            headers[COALESCE_HEADER] = "1"
        r = httpx.post(f"{server}{GENERATE_PATH}", headers=headers, content=body, timeout=60)
        assert r.status_code == 200, r.text
        return [StreamItem.decode(line) for line in r.content.splitlines() if line.strip()]

    steps, whole = run(False), run(True)
    assert len(steps) == 12 and len(whole) == 2
    for key in ("token_ids", "logprobs"):
        assert [x for i in steps for x in getattr(i, key)] == [x for i in whole for x in getattr(i, key)]
    assert "".join(i.text for i in steps) == "".join(i.text for i in whole)
    assert whole[-1].usage.completion_tokens == 12 and whole[-1].finish_reason == steps[-1].finish_reason == "length"
