"""The streams socket (engine_wire.STREAMS_PATH; services.engine.streams, services.gateway.engine_streams) against
real engines: many requests on one WebSocket give the tokens and answers the per-request HTTP stream gives; a
refusal is the HTTP error; a stream the gateway closes is aborted on the engine; the socket lost fails the requests
on it and nothing else; garbage on a socket costs that socket only; an engine without the socket is asked over HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import httpx
import pytest
import websockets.sync.client as ws_client

from services.common.engine_wire import STREAMS_PATH, AdapterSpec, GenerateRequest, close_command, open_command
from services.common.wire import SamplingParams
from services.gateway.engine_streams import StreamsPool, StreamsUnsupported
from services.gateway.router import EngineInfo, Router
from services.gateway.upstream import EngineLost, StreamResult, UpstreamRefused, open_choice


def _info(proc) -> EngineInfo:
    return EngineInfo(proc.engine_id, proc.url, "base", frozenset(), frozenset(), 0, 0, 0.0, 256, 512)


def _req(tag: str, prompt: list[int], **sampling) -> GenerateRequest:
    sampling = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **sampling}
    return GenerateRequest(request_id=f"streams-{tag}", prompt_token_ids=prompt, tenant="t",
                           sampling=SamplingParams(**sampling))


async def _run(http, pool, info, req: GenerateRequest, router: Router | None = None):
    """(token ids, text, finish reason, usage) of one request, or the exception it ended with."""
    result = StreamResult()
    ids, text, finish, usage = [], "", None, None
    try:
        async for delta, u in open_choice(http, router or Router(), [info], req, 0, result, time.monotonic,
                                          streams=pool):
            ids += delta.token_ids
            text += delta.text
            finish, usage = delta.finish_reason or finish, u or usage
    except Exception as exc:  # noqa: BLE001 -- compared between the transports
        return exc
    return ids, text, finish, (usage.prompt_tokens, usage.completion_tokens)


def _both(stack, reqs: list[GenerateRequest], per_engine: int = 1):
    """Each request over the streams socket (all at once) and over HTTP: (socket answers, HTTP answers, pool)."""
    info = _info(stack.engines[0])

    async def main():
        async with aiohttp.ClientSession(headers=stack.engine_headers()) as http:
            pool = StreamsPool(http, per_engine)
            try:
                on_socket = await asyncio.gather(*(_run(http, pool, info, r) for r in reqs))
                sockets = [s for group in pool._sockets.values() for s in group]
                left_open = sum(len(s.streams) for s in sockets)
                over_http = await asyncio.gather(*(_run(http, None, info, r) for r in reqs))
            finally:
                await pool.aclose()
            return on_socket, over_http, len(sockets), left_open

    return asyncio.run(main())


def test_many_requests_on_one_socket_answer_as_http_does(stack):
    reqs = [_req(f"ok{i}", [5 + i, 6, 7, 8 + i], max_tokens=8 + i) for i in range(12)]
    reqs += [_req("stop", [5, 6, 7], max_tokens=30, stop=("e",)), _req("lp", [9, 9], max_tokens=5, logprobs=2)]
    on_socket, over_http, sockets, left_open = _both(stack, reqs)
    assert sockets == 1 and left_open == 0  # every request shared one socket; none left registered on it
    for got, want, r in zip(on_socket, over_http, reqs):
        assert not isinstance(got, Exception), got
        assert got == want, r.request_id  # greedy: the same tokens, text, finish reason and usage
        assert len(got[0]) == got[3][1]


def test_refusals_on_the_socket_are_the_http_errors(stack):
    reqs = [
        _req("too-long", list(range(5, 600)), max_tokens=8),  # past the model's context: refused naming the field
        _req("bad-stop-id", [5, 6], stop_token_ids=(10**6,)),
        GenerateRequest.model_construct(request_id="streams-bad-adapter", prompt_token_ids=[5, 6], tenant="t",
                                        sampling=SamplingParams(max_tokens=4),
                                        adapter=AdapterSpec(content_id="0" * 64, name="x", uri="/etc/passwd")),
        _req("fine", [5, 6, 7]),  # served beside them
    ]
    on_socket, over_http, _, left_open = _both(stack, reqs)
    assert left_open == 0
    for got, want in zip(on_socket[:3], over_http[:3]):
        assert isinstance(got, UpstreamRefused) and isinstance(want, UpstreamRefused), (got, want)
        assert (got.status, got.body) == (want.status, want.body)
        assert 400 <= got.status < 500 and got.body["error"]["message"]
    assert on_socket[0].body["error"]["param"]
    assert on_socket[3] == over_http[3] and not isinstance(on_socket[3], Exception)


def test_a_request_too_large_for_the_socket_goes_over_http(stack):
    big = _req("big", [511] * 400_000)  # an open command past STREAMS_MAX_OPEN_BYTES
    on_socket, over_http, sockets, _ = _both(stack, [big])
    assert sockets == 0  # never put on a socket
    assert isinstance(on_socket[0], UpstreamRefused) and on_socket[0].status == over_http[0].status


def _metric(url: str, name: str, headers) -> float:
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_a_stream_the_gateway_closes_is_aborted_on_the_engine(stack):
    proc, auth = stack.engines[1], stack.engine_headers()
    info = _info(proc)

    async def main():
        async with aiohttp.ClientSession(headers=auth) as http:
            pool = StreamsPool(http, 1)
            streams = [open_choice(http, Router(), [info], _req(f"abort{i}", [5, 6, 7 + i], max_tokens=400), 0,
                                   StreamResult(), time.monotonic, streams=pool) for i in range(3)]
            try:
                for s in streams:
                    await anext(s)  # each has its first token: running on the engine
                running = await asyncio.to_thread(_metric, proc.url, "mplex_engine_requests_running", auth)
                for s in streams[:2]:
                    await s.aclose()  # two clients hang up; the third goes on on the same socket
                deadline = time.time() + 10
                while time.time() < deadline:
                    left = await asyncio.to_thread(_metric, proc.url, "mplex_engine_requests_running", auth)
                    if left <= 1:
                        break
                    await asyncio.sleep(0.1)
                rest = [d async for d, _ in streams[2]]
                return running, left, sum(len(d.token_ids) for d in rest)
            finally:
                await pool.aclose()

    running, left, rest_tokens = asyncio.run(main())
    assert running >= 3 and left <= 1  # aborted within 10 s of the close, not run to 400 tokens
    assert rest_tokens > 0  # the one still open kept streaming to its end


@pytest.mark.parametrize("garbage", [b'{"open": "x"}\nnot json at all\n', b"[" * 5000 + b"\n"],
                         ids=["no-stream-id", "nested-past-the-parsers"])
def test_garbage_on_a_socket_drops_that_socket_only(stack, garbage):
    proc, auth = stack.engines[0], stack.engine_headers()
    url = proc.url.replace("http://", "ws://") + STREAMS_PATH
    good = _req(f"beside-garbage-{len(garbage)}", [5, 6, 7], max_tokens=40)
    with ws_client.connect(url, additional_headers=auth) as keep, ws_client.connect(url, additional_headers=auth) as bad:
        keep.send(open_command(0, good.encode(), False))
        bad.send(garbage)
        with pytest.raises(Exception):  # the engine drops the socket that broke the protocol
            bad.recv(timeout=10)
            bad.recv(timeout=10)
        events = []
        while not events or not events[-1].endswith(b" ."):
            events += [e for e in keep.recv(timeout=30).split(b"\n") if e]
    items = [json.loads(e.split(b" ", 1)[1]) for e in events[:-1]]
    assert items[-1]["usage"]["completion_tokens"] == 40 and not any("error" in i for i in items)
    assert httpx.get(f"{proc.url}/health").json()["status"] == "ok"


def test_unknown_and_repeated_stream_ids_get_their_own_answer(stack):
    proc, auth = stack.engines[0], stack.engine_headers()
    url = proc.url.replace("http://", "ws://") + STREAMS_PATH
    req = _req("dup", [5, 6], max_tokens=30).encode()
    with ws_client.connect(url, additional_headers=auth) as ws:
        ws.send(close_command(77) + open_command(3, req, False) + open_command(3, req, False))
        events: list[bytes] = []
        while not any(e.startswith(b"3 .") for e in events):
            events += [e for e in ws.recv(timeout=30).split(b"\n") if e]
    refusals = [json.loads(e[3:]) for e in events if e.startswith(b"3 !")]
    assert len(refusals) == 1 and refusals[0]["status"] == 400 and refusals[0]["body"]["error"]["param"] == "open"
    assert json.loads([e for e in events if e.startswith(b"3 {")][-1][2:])["usage"]["completion_tokens"] == 30


def test_an_engine_without_the_socket_is_asked_over_http(stack):
    """The gateway's own port has no streams socket (as an engine from before it): the pool says so and stops asking."""
    async def main():
        async with aiohttp.ClientSession() as http:
            pool = StreamsPool(http, 2)
            with pytest.raises(StreamsUnsupported):
                await pool.open(stack.gw.url, lambda sid: b"")
            return pool.usable(stack.gw.url), pool.usable(stack.engines[0].url)

    assert asyncio.run(main()) == (False, True)


def test_an_engine_lost_fails_every_request_on_its_socket_and_none_is_retried(stack, demo_kit):
    victim = stack.engine(demo_kit.base_dir, demo_kit.model_name, f"eng-victim-{os.getpid()}")
    info = _info(victim)
    router = Router()

    async def main():
        async with aiohttp.ClientSession(headers=stack.engine_headers()) as http:
            pool = StreamsPool(http, 1)
            streams = [open_choice(http, router, [info], _req(f"lost{i}", [5, 6, 7 + i], max_tokens=400), 0,
                                   StreamResult(), time.monotonic, streams=pool) for i in range(4)]
            try:
                for s in streams:
                    await anext(s)
                os.kill(victim.popen.pid, signal.SIGKILL)  # the whole engine (front-end included) vanishes
                outcomes = []
                for s in streams:
                    try:
                        async for _ in s:
                            pass
                        outcomes.append("finished")
                    except EngineLost:
                        outcomes.append("lost")
                return outcomes
            finally:
                await pool.aclose()

    try:
        assert asyncio.run(main()) == ["lost"] * 4
        assert router.breakers[victim.engine_id].failures >= 1  # counted against the engine that lost them
    finally:
        stack.stop(victim)
