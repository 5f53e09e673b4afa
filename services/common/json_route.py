"""A FastAPI route for hot endpoints taking one JSON body model and the request: FastAPI's parsing and errors, not
its dependency machinery.

The gateway's generation endpoints are `async def f(req: Model, request: Request)`. For them FastAPI's handler
solves a dependency graph per request (query, header, cookie and body parameters, an exit stack, telemetry
scopes) to produce two arguments: ~10% of the event loop's time while the gateway admitted a burst of requests, each
of which waits its turn on that loop before it reaches an engine. `JsonBodyRoute` reads the body as FastAPI does (the
same content-type rule, `json.loads`, the same validation with the same error list and locations) and calls the
endpoint with the two arguments directly. The route stays an APIRoute: the OpenAPI schema, the body model's
documentation and every error response are unchanged (tests/gateway/test_json_route.py compares the two handlers
on generated bodies).
"""
from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

_MISSING = object()


def _is_json(content_type: str) -> bool:
    """FastAPI's rule (via email.message): application/json or application/*+json, parameters ignored."""
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    sub = sub.strip()
    return main.strip() == "application" and (sub == "json" or sub.endswith("+json"))


async def body_value(request: Request) -> Any:
    """What FastAPI validates against the body model: nothing (an empty body), the parsed JSON, or the bytes
    themselves (a body not declared as JSON: strict content type). A body that is not JSON is a validation error;
    one that cannot be read or decoded at all, FastAPI's 400."""
    try:
        body = await request.body()
        if not body:
            return _MISSING
        content_type = request.headers.get("content-type")
        return json.loads(body) if content_type and _is_json(content_type) else body
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {},
              "ctx": {"error": e.msg}}], body=e.doc) from None
    except HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 -- as FastAPI: undecodable bytes (not UTF-8/16/32), a body not readable
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


class JsonBodyRoute(APIRoute):
    """For endpoints `async def f(req: <BaseModel>, request: Request) -> Response` only (checked when the route is
    made, and the Response when it answers)."""

    def get_route_handler(self):
        params = self.dependant.body_params
        if (len(params) != 1 or self.dependant.query_params or self.dependant.header_params
                or self.dependant.cookie_params or self.dependant.path_params or self.dependant.dependencies
                or self.dependant.request_param_name is None):
            raise TypeError(f"{self.path}: JsonBodyRoute takes endpoints of one body model and the request")
        model = params[0].field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{self.path}: the body must be one pydantic model, not {model!r}")
        adapter = TypeAdapter(model)
        endpoint, body_name, request_name = self.dependant.call, params[0].name, self.dependant.request_param_name

        async def handler(request: Request):
            value = await body_value(request)
            if value is _MISSING:
                raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                               "input": None}])
            try:
                req = adapter.validate_python(value, from_attributes=True)
            except ValidationError as exc:
                raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                              for err in exc.errors(include_url=False)]) from None
            response = await endpoint(**{body_name: req, request_name: request})
            if not isinstance(response, Response):  # no response model here to serialize a value with
                raise TypeError(f"{request.url.path}: a JsonBodyRoute endpoint returns a Response")
            return response

        return handler
