"""JsonBodyRoute (services.common.json_route) answers every body exactly as FastAPI's own handler does: the same
status, the same validation errors (types, locations, messages) and the same parsed request, on generated bodies
and content types -- the generation endpoints' error responses and field names depend on it."""
from __future__ import annotations

import json

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import example, given
from hypothesis import strategies as st

from services.common.json_route import JsonBodyRoute
from services.common.openai_protocol import ChatCompletionRequest, CompletionRequest, validation_error_body
from tests.fuzzing import BOUNDARY_FLOATS, BOUNDARY_INTS, fuzz_settings


def _app() -> FastAPI:
    app = FastAPI()
    for prefix, route_class in (("/stock", None), ("/lean", JsonBodyRoute)):
        router = APIRouter(route_class=route_class) if route_class else APIRouter()

        @router.post(prefix + "/completions")
        async def completions(req: CompletionRequest, request: Request):
            return JSONResponse({"req": req.model_dump(mode="json"), "method": request.method})

        @router.post(prefix + "/chat")
        async def chat(req: ChatCompletionRequest, request: Request):
            return JSONResponse({"req": req.model_dump(mode="json"), "method": request.method})

        app.include_router(router)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        return JSONResponse({"errors": [[e["type"], list(e["loc"]), e["msg"], repr(e.get("ctx"))] for e in errors],
                             "openai": validation_error_body(errors)}, 400)

    return app


CLIENT = TestClient(_app())

CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "APPLICATION/JSON", " application/json",
                 "application/vnd.api+json", "application/jsonx", "application/json-patch+json", "text/json",
                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application",
                 "application/", ";", ""]
_json_scalars = st.none() | st.booleans() | st.sampled_from(BOUNDARY_INTS) | st.sampled_from(BOUNDARY_FLOATS[:-3]) | \
    st.text(max_size=12)
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4) |
                     st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "stream", "stop", "seed", "temperature", "logprobs",
           "top_k", "priority", "stream_options", "logit_bias", "response_format", "tools", "user"]
_requestish = st.fixed_dictionaries({"model": st.sampled_from(["base", "", 7])},
                                    optional={f: _json for f in _FIELDS if f != "model"} | {
                                        "prompt": st.sampled_from(["hi", ["a", "b"], [1, 2], [[1], [2]], [], ""]),
                                        "messages": st.sampled_from([[{"role": "user", "content": "hi"}], [],
                                                                     [{"role": "x"}], "hi"])})
BODIES = (st.builds(lambda d: json.dumps(d).encode(), _requestish)
          | st.builds(lambda v: json.dumps(v).encode(), _json)
          | st.binary(max_size=40)
          | st.sampled_from([b"", b"{", b"{}", b"[]", b"null", b'{"model": "base", "prompt": "x"', b"\xff\xfe{}",
                             b'{"model": "base", "prompt": "\\ud800"}', b"NaN", b'{"model":"base","prompt":"a","seed":1e400}',
                             "{\"model\": \"base\", \"prompt\": \"é\"}".encode("utf-16")]))


def _answer(path: str, body: bytes, content_type: str | None):
    headers = {} if content_type is None else {"content-type": content_type}
    r = CLIENT.post(path, content=body, headers=headers)
    return r.status_code, r.json()


@pytest.mark.parametrize("endpoint", ["/completions", "/chat"])
@fuzz_settings(300)
@given(body=BODIES, content_type=st.sampled_from(CONTENT_TYPES))
@example(body=b'{"model": "base", "prompt": "hello", "max_tokens": 4}', content_type="application/json")
@example(body=b'{"model": "base", "messages": [{"role": "user", "content": "hi"}]}', content_type="application/json")
@example(body=b"", content_type="application/json")
@example(body=b"{", content_type="application/json")
@example(body=b'{"model": "base", "prompt": "hello"}', content_type=None)
@example(body=b"\xff\xfe\x00", content_type="application/json")
def test_lean_route_answers_as_fastapi_does(endpoint, body, content_type):
    assert _answer("/lean" + endpoint, body, content_type) == _answer("/stock" + endpoint, body, content_type)


def test_lean_route_refuses_endpoints_it_cannot_call():
    router = APIRouter(route_class=JsonBodyRoute)
    with pytest.raises(TypeError, match="one body model and the request"):
        @router.post("/x")
        async def no_request(req: CompletionRequest, q: int):
            return {}
    with pytest.raises(TypeError, match="one body model and the request"):
        @router.post("/y")
        async def no_request_param(req: CompletionRequest):
            return {}
