"""Fuzzing the request path end to end: a request can only fail itself.

Hypothesis builds OpenAI requests with every field the API documents and the engine's extensions,
boundary integers (2^31, 2^63, 2^64, -2^63-1, 10^30), non-finite and denormal floats, long lists, odd
Unicode (lone surrogates, NUL, bidi controls) and wrong types, and sends them to the gateway (real
engines behind it) and straight to an engine (its internal stream and its own OpenAI endpoints, with the
platform credential). Every answer must be a success or an OpenAI-shaped 4xx naming what is wrong, never
a 5xx; after every case every engine answers /health, and every few cases a normal request is served.

`make test` runs a bounded, derandomized sample; `make fuzz` many more with fresh seeds.
"""
from __future__ import annotations

import itertools
import json
from collections import Counter

import httpx
import pytest
import websockets.exceptions
import websockets.sync.client as ws_client
from hypothesis import event, given
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from services.common.engine_wire import STREAMS_PATH, close_command, open_command
from tests.factories import make_api_key, make_tenant
from tests.fuzzing import (
    BOUNDARY_INTS,
    ODD_TEXT,
    floats,
    fuzz_settings,
    good_text,
    ints,
    json_schemas,
    lists_of,
    number_like,
    texts,
    wrong,
)

ALLOWED = {200, 400, 404, 409, 413, 429}
CHECK_EVERY = 10  # cases between full "is every engine still serving" checks


# -- strategies ----------------------------------------------------------------------------------------
# Each strategy has two modes, mixed half and half: `valid` draws every field from its valid range and
# edges (so the requests reach the engines and run there: seeds over all 64 bits, denormal temperatures,
# top_k = vocab, stop strings of odd but valid Unicode, n x prompts at the caps), `adversarial` also
# draws out-of-range values and wrong types.
def _f(adversarial: bool, valid, bad=None):
    if not adversarial:
        return valid
    return st.one_of(valid, valid, number_like(valid) if bad is None else bad)


def _common(model: str, adv: bool):
    return {
        "max_tokens": _f(adv, st.integers(1, 6)),
        "temperature": _f(adv, st.one_of(st.floats(0, 2), st.sampled_from([0.0, 5e-324, 1e-5, 100.0]))),
        "top_p": _f(adv, st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1.0]))),
        "n": _f(adv, st.integers(1, 3)),
        "stream": _f(adv, st.booleans(), wrong),
        "stream_options": _f(adv, st.just({"include_usage": True}), st.one_of(st.just({"include_usage": "x"}), wrong)),
        "stop": _f(adv, st.one_of(good_text.filter(bool), st.lists(good_text.filter(bool), max_size=8)),
                   st.one_of(texts, lists_of(texts, 10), wrong)),
        "seed": _f(adv, st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([2**63, 2**64 - 1, -(2**63)]))),
        "user": _f(adv, good_text, st.one_of(texts, st.text(min_size=257, max_size=300), wrong)),
        "presence_penalty": _f(adv, st.just(0)),
        "frequency_penalty": _f(adv, st.just(0)),
        "logit_bias": _f(adv, st.just({}), st.one_of(st.just({"5": 1.0}), st.dictionaries(texts, floats, max_size=3), wrong)),
        "top_k": _f(adv, st.one_of(st.integers(-1, 50), st.just(1536))),
        "min_tokens": _f(adv, st.integers(0, 1)),
        "ignore_eos": _f(adv, st.booleans(), wrong),
        "stop_token_ids": _f(adv, st.lists(st.integers(0, 1535), max_size=64), st.one_of(lists_of(st.integers(-2, 1600)), lists_of(ints))),
        "skip_special_tokens": _f(adv, st.booleans(), wrong),
        "priority": _f(adv, st.sampled_from(["interactive", "batch", "BATCH", 0, 1]),
                       st.one_of(st.sampled_from([2, "urgent", -1]), wrong)),
        "cache_salt": texts,  # not ours to set: must be ignored
        "tenant": texts,  # same
    }


def _messages(adv: bool):
    if not adv:
        part = st.fixed_dictionaries({"type": st.just("text"), "text": good_text})
        content = st.one_of(good_text, st.lists(part, max_size=3))
        role = st.sampled_from(["user", "system", "assistant", "developer"])
        return st.lists(st.fixed_dictionaries({"role": role, "content": content}), min_size=1, max_size=4)
    content = st.one_of(
        texts, texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3),
        st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", "x"]), "text": texts}), max_size=2),
        wrong, ints,
    )
    message = st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer"]), texts, wrong), "content": content},
        optional={"name": texts, "tool_calls": wrong},
    )
    return st.one_of(st.lists(message, min_size=1, max_size=4), st.lists(message, min_size=0, max_size=0),
                     st.lists(message, min_size=40, max_size=60), wrong)


def _model(model: str, adv: bool):
    return _f(adv, st.just(model), st.one_of(texts, wrong))


def chat_bodies(model: str):
    return st.booleans().flatmap(lambda adv: st.fixed_dictionaries(
        {"model": _model(model, adv), "messages": _messages(adv)}, optional={
            **_common(model, adv),
            "max_completion_tokens": _f(adv, st.integers(1, 6)),
            "logprobs": _f(adv, st.booleans(), wrong),
            "top_logprobs": _f(adv, st.integers(0, 20)),
            "response_format": _f(adv, st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}),
                                                 json_schemas().map(lambda s: {"type": "json_schema", "json_schema": {
                                                     "name": "fz", "schema": s, "strict": True}})),
                                  st.one_of(st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": wrong}),
                                            st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                                                   st.fixed_dictionaries({"name": texts, "schema": wrong})}),
                                            wrong)),
            "tools": _f(adv, st.one_of(st.just([]), st.lists(json_schemas().map(lambda s: {
                "type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": s}}}}),
                max_size=1)), st.one_of(wrong, st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                                               "function": wrong}), max_size=2))),
            "tool_choice": _f(adv, st.sampled_from([None, "none", "auto", "required"]), wrong),
            "parallel_tool_calls": _f(adv, st.booleans(), wrong),
        }))


def completion_bodies(model: str):
    def build(adv: bool):
        ids = st.lists(st.integers(0, 1535), min_size=1, max_size=20)
        if adv:
            ids = st.lists(st.one_of(st.integers(0, 1535), st.sampled_from(BOUNDARY_INTS)), min_size=0, max_size=20)
        prompt = st.one_of(good_text.filter(bool), ids, st.lists(good_text.filter(bool), min_size=1, max_size=5),
                           st.lists(ids, min_size=1, max_size=3))
        if adv:
            prompt = st.one_of(prompt, texts, st.lists(texts, max_size=5), st.lists(st.just("a"), min_size=65, max_size=120),
                               wrong, ints)
        return st.fixed_dictionaries({"model": _model(model, adv), "prompt": prompt}, optional={
            **_common(model, adv),
            "logprobs": _f(adv, st.integers(0, 5)),
            "echo": _f(adv, st.just(False), wrong),
            "suffix": _f(adv, st.none(), st.one_of(texts, wrong)),
        })

    return st.booleans().flatmap(build)


def generate_payloads():
    """The engine's internal stream request, as the gateway sends it -- and as anyone on the network might."""
    def build(adv: bool):
        sampling = st.fixed_dictionaries({}, optional={
            "max_tokens": _f(adv, st.integers(1, 6)), "temperature": _f(adv, st.floats(0, 2)),
            "top_p": _f(adv, st.floats(0, 1, exclude_min=True)), "top_k": _f(adv, st.integers(-1, 1536)),
            "seed": _f(adv, st.integers(-(2**63), 2**64 - 1)), "min_tokens": _f(adv, st.integers(0, 1)),
            "stop": _f(adv, st.lists(good_text.filter(bool), max_size=8), st.one_of(lists_of(texts, 10), texts, wrong)),
            "stop_token_ids": _f(adv, st.lists(st.integers(0, 1535), max_size=64),
                                 lists_of(st.one_of(st.integers(-2, 1600), ints))),
            "ignore_eos": _f(adv, st.booleans(), wrong), "logprobs": st.one_of(st.none(), _f(adv, st.integers(0, 20))),
            "skip_special_tokens": _f(adv, st.booleans(), wrong),
            "guide": _f(adv, json_schemas().map(lambda s: json.dumps({"type": "json_schema", "schema": s})),
                        st.one_of(texts, wrong, st.just('{"type": "tool_calls", "tools": []}'))),
            **({"bogus": wrong} if adv else {}),
        })
        adapter = st.one_of(st.none(), st.fixed_dictionaries({
            "content_id": st.one_of(st.text("0123456789abcdef", min_size=64, max_size=64), texts),
            "name": texts,
            "uri": st.one_of(st.sampled_from(["file:///etc", "/etc/passwd", "../../x", "s3://other/x", "http://169.254.169.254/",
                                              "file:///proc/self/environ", "memory://x"]), texts, wrong),
        }), wrong)
        ids = st.lists(st.integers(0, 1535), min_size=1, max_size=40)
        return st.fixed_dictionaries({
            "request_id": _f(adv, st.text("abcdef0123456789", min_size=8, max_size=16).map(lambda s: "fz-" + s),
                             st.one_of(texts, wrong)),
            "prompt_token_ids": _f(adv, ids, st.one_of(lists_of(ints), st.lists(st.integers(0, 1535), min_size=500, max_size=600))),
            "sampling": _f(adv, sampling, wrong),
        }, optional={"priority": _f(adv, st.sampled_from(["batch", "interactive", 1]), wrong),
                     "cache_salt": _f(adv, st.text("abcdef0123456789", max_size=64), texts),
                     **({"adapter": adapter} if adv else {}),
                     "client_request_id": _f(adv, st.text("abc123._:-", min_size=1, max_size=20), st.one_of(texts, wrong))})

    return st.booleans().flatmap(build)


# -- checks --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def key(db_engine):
    from sqlalchemy.orm import Session

    with Session(db_engine, expire_on_commit=False) as db:
        tenant = make_tenant(db, limits={"tokens_per_min": 10_000_000, "requests_per_min": 1_000_000,
                                         "concurrent_requests": 256})
        return make_api_key(db, tenant=tenant).secret


class Liveness:
    """After every case: each engine answers /health; every CHECK_EVERY cases it also serves a request."""

    def __init__(self, stack, model: str):
        self.statuses: Counter[int] = Counter()
        self.engines = [e.url for e in stack.engines]
        self.auth = stack.engine_headers()
        self.model = model
        self.cases = 0

    def check(self, client: httpx.Client) -> None:
        self.cases += 1
        for url in self.engines:
            r = client.get(f"{url}/health", timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "ok", f"engine {url} is {r.status_code} {r.text}"
        if self.cases % CHECK_EVERY == 0:
            self.serves(client)

    def serves(self, client: httpx.Client) -> None:
        for url in self.engines:
            r = client.post(f"{url}/v1/completions", headers=self.auth, timeout=60,
                            json={"model": self.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def _send(client: httpx.Client, url: str, body, headers: dict[str, str]) -> httpx.Response:
    # ensure_ascii escapes lone surrogates as \\udXXX (what a client library would send); NaN/Infinity
    # go out as the literals Python's json (and so FastAPI) accepts.
    data = json.dumps(body, ensure_ascii=True)
    with client.stream("POST", url, content=data, headers={**headers, "content-type": "application/json"}, timeout=120) as r:
        r.read()
    return r


def _check_answer(r: httpx.Response, where: str, live: Liveness | None = None) -> None:
    if live is not None:
        live.statuses[r.status_code] += 1
    assert r.status_code in ALLOWED, f"{where} -> {r.status_code}: {r.text[:500]}"
    if currently_in_test_context():
        event(f"{where} {r.status_code}")
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [x for x in r.text.splitlines() if x.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text[-300:]
        assert not any('"error"' in x[:12] for x in lines), r.text[:500]  # an accepted request must not fail
    elif r.headers["content-type"].startswith("application/x-ndjson"):
        items = [json.loads(x) for x in r.text.splitlines() if x.strip()]
        assert "usage" in items[-1] and not any("error" in i for i in items), r.text[:500]
    else:
        assert r.json()["choices"], r.text[:300]


# -- the suites ----------------------------------------------------------------------------------------
def test_fuzz_gateway(stack, demo_kit, key):
    live = Liveness(stack, demo_kit.model_name)
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.gw.url) as client:

        @given(kind=st.sampled_from(["chat", "completion"]), data=st.data())
        @fuzz_settings(150)
        def case(kind, data):
            if kind == "chat":
                body = data.draw(chat_bodies(demo_kit.model_name))
                r = _send(client, "/v1/chat/completions", body, auth)
            else:
                body = data.draw(completion_bodies(demo_kit.model_name))
                r = _send(client, "/v1/completions", body, auth)
            _check_answer(r, f"gateway {kind}", live)
            live.check(client)

        case()
        live.serves(client)
    print(f"\n[fuzz] gateway: {live.cases} cases, engines alive after each; answers {dict(live.statuses)}")


def test_fuzz_engine_internal_stream(stack, demo_kit):
    live = Liveness(stack, demo_kit.model_name)
    engine = stack.engines[0].url
    with httpx.Client() as client:

        @given(payload=generate_payloads())
        @fuzz_settings(150)
        def case(payload):
            r = _send(client, f"{engine}/internal/v1/generate", payload, live.auth)
            _check_answer(r, "engine generate", live)
            live.check(client)

        case()
        live.serves(client)
    print(f"\n[fuzz] engine internal stream: {live.cases} cases, engines alive after each; answers {dict(live.statuses)}")


def test_fuzz_engine_streams_socket(stack, demo_kit):
    """The streams socket fed what the internal stream's fuzzer sends, several requests to a frame, now and then a
    close (of a stream open or not) and lines that are no command at all: each open is refused with an OpenAI error
    or served to its end; a line the engine cannot read drops that socket only; the engines stay up throughout."""
    live = Liveness(stack, demo_kit.model_name)
    url = stack.engines[0].url.replace("http://", "ws://") + STREAMS_PATH

    def connect():
        return ws_client.connect(url, additional_headers=live.auth).__enter__()  # closed by hand below

    sockets = [connect()]
    sids = itertools.count()
    outcomes: Counter[str] = Counter()
    garbage = st.one_of(st.binary(min_size=1, max_size=40), st.sampled_from(
        [b'{"open": -1}', b'{"open": true}', b'{"close": "a"}', b"[1, 2]", b"null", b'{"open": 1e999}']))
    with httpx.Client() as client:

        @given(payloads=st.lists(generate_payloads(), min_size=1, max_size=3), close=st.booleans(),
               junk=st.one_of(st.none(), garbage))
        @fuzz_settings(60)
        def case(payloads, close, junk):
            frame, waiting = b"", set()
            for payload in payloads:
                sid = next(sids)
                frame += open_command(sid, json.dumps(payload, ensure_ascii=True).encode(), False)  # as _send does
                waiting.add(sid)
            if close:
                frame += close_command(min(waiting))
                waiting.discard(min(waiting))
            if junk is not None:
                frame += junk.replace(b"\n", b" ") + b"\n"
            ws = sockets[0]
            ws.send(frame)
            items: dict[int, list[dict]] = {}
            done: set[int] = set()
            try:
                while waiting - done:
                    for line in ws.recv(timeout=120).split(b"\n"):
                        if not line:
                            continue
                        sid_text, ev = line.split(b" ", 1)
                        sid = int(sid_text)
                        if ev[:1] == b"!":  # refused: an OpenAI error, a status the HTTP endpoint may answer
                            refusal = json.loads(ev[1:])
                            assert refusal["status"] in ALLOWED and refusal["body"]["error"]["message"], refusal
                            outcomes[f"refused {refusal['status']}"] += 1
                            done.add(sid)
                        elif ev[:1] == b".":  # ended: served to its end without an error
                            got = items.pop(sid, [])
                            assert got and "usage" in got[-1] and not any("error" in i for i in got), got[-1:]
                            outcomes["served"] += 1
                            done.add(sid)
                        elif ev[:1] != b"+":
                            items.setdefault(sid, []).append(json.loads(ev))
            except websockets.exceptions.ConnectionClosed:
                # Only a line the engine could not read drops the socket (junk may be a valid close by chance).
                assert junk is not None, "the engine dropped a socket that kept to the protocol"
                outcomes["socket dropped"] += 1
            if junk is not None:  # dropped now or about to be (its opens may all have answered first): a new one
                ws.close()
                sockets[0] = connect()
            live.check(client)

        case()
        sockets[0].close()
        live.serves(client)
    print(f"\n[fuzz] engine streams socket: {live.cases} cases, engines alive after each; outcomes {dict(outcomes)}")


def test_fuzz_engine_openai_endpoints(stack, demo_kit):
    live = Liveness(stack, demo_kit.model_name)
    engine = stack.engines[1].url
    with httpx.Client() as client:

        @given(kind=st.sampled_from(["chat", "completion"]), data=st.data())
        @fuzz_settings(100)
        def case(kind, data):
            body = data.draw(chat_bodies(demo_kit.model_name) if kind == "chat" else completion_bodies(demo_kit.model_name))
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            r = _send(client, f"{engine}{path}", body, live.auth)
            _check_answer(r, f"engine {kind}", live)
            live.check(client)

        case()
        live.serves(client)
    print(f"\n[fuzz] engine OpenAI endpoints: {live.cases} cases, engines alive after each; answers {dict(live.statuses)}")


def test_odd_text_is_refused_or_served_never_a_server_error(stack, demo_kit, key):
    """Every odd string in every text field, deterministically (the fuzzers sample them)."""
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.gw.url) as client:
        for text in ODD_TEXT:
            for body in (
                {"model": demo_kit.model_name, "messages": [{"role": "user", "content": text}], "max_tokens": 2},
                {"model": demo_kit.model_name, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}], "max_tokens": 2},
                {"model": demo_kit.model_name, "prompt": text or "x", "max_tokens": 2, "stop": [text] if text else None},
                {"model": demo_kit.model_name, "prompt": [text, "hi"], "max_tokens": 2},
                {"model": demo_kit.model_name, "prompt": "hi", "max_tokens": 2, "user": text},
            ):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                r = _send(client, path, body, auth)
                _check_answer(r, "odd text")
    Liveness(stack, demo_kit.model_name).serves(httpx.Client())
