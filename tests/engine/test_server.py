"""The engine's HTTP server through the official OpenAI SDK: chat, completions, streaming, errors,
and client disconnects that free the sequence's KV blocks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(demo_kit, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("engine") / "engine.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "engine", "serve", "--model", str(demo_kit.base_dir),
         "--served-model-name", demo_kit.model_name, "--port", str(port), "--kv-memory-mb", "64"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, "engine server exited"
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _metric(url: str, name: str, default: float | None = None, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
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
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
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
        httpx.post(f"{server}/v1/completions", json=body, timeout=0.1)
    _wait_idle(server)
    assert _metric(server, "mplex_engine_requests_total", finish_reason="abort") == aborted + 1
