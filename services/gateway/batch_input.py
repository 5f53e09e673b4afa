"""Checks a batch input file line by line, with the live endpoints' own validation: every line's body is
parsed into the same request model, resolved against the caller's models and planned (tokenized, context
length, sampling limits) exactly as `POST /v1/chat/completions` would, so a line that passes here is one the
live API would have accepted. Errors are numbered by line and name the field (`body.max_tokens`)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from pydantic import ValidationError

from services.common.batch_contract import ENDPOINTS, MAX_LINES, InputLine, LineError
from services.common.errors import ApiError
from services.common.openai_protocol import ChatCompletionRequest, CompletionRequest, validation_error_body
from services.common.openai_serving import plan_request
from services.common.wire import InvalidRequest
from services.gateway.resolve import ResolvedModel

_MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


@dataclass(slots=True)
class CheckedFile:
    lines: list[InputLine] = field(default_factory=list)  # the lines that parsed, in file order
    numbers: list[int] = field(default_factory=list)  # their line numbers (from 1)
    errors: list[LineError] = field(default_factory=list)


def parse_request(url: str, body: dict) -> ChatCompletionRequest | CompletionRequest:
    """A line's body as the live endpoint's request model (raises pydantic's ValidationError)."""
    return _MODELS[ENDPOINTS[url]].model_validate(body)


def split_lines(data: bytes) -> CheckedFile:
    """Structure only: UTF-8, one JSON object a line, OpenAI's line fields, unique custom_ids."""
    out = CheckedFile()
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1].strip() == b"":
        raw_lines.pop()  # the newline that ends the last line
    if not raw_lines:
        out.errors.append(LineError(line=1, code="empty_file", message="the file has no lines"))
        return out
    if len(raw_lines) > MAX_LINES:
        out.errors.append(LineError(line=MAX_LINES + 1, code="too_many_lines",
                                    message=f"a batch file may have at most {MAX_LINES} lines ({len(raw_lines)} sent)"))
        return out
    seen: dict[str, int] = {}
    for n, raw in enumerate(raw_lines, start=1):
        line = _parse_line(n, raw, out.errors)
        if line is None:
            continue
        if line.custom_id in seen:
            out.errors.append(LineError(line=n, param="custom_id", code="duplicate_custom_id",
                                        message=f"custom_id {line.custom_id[:64]!r} is also on line {seen[line.custom_id]}"))
            continue
        seen[line.custom_id] = n
        out.lines.append(line)
        out.numbers.append(n)
    return out


def _parse_line(n: int, raw: bytes, errors: list[LineError]) -> InputLine | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        errors.append(LineError(line=n, code="invalid_json", message=f"not valid JSON ({str(exc).split(':')[0]})"))
        return None
    if not isinstance(value, dict):
        errors.append(LineError(line=n, code="invalid_json", message="each line must be a JSON object"))
        return None
    try:
        return InputLine.model_validate(value)
    except ValidationError as exc:
        errors.append(_from_validation(n, exc, prefix=""))
        return None


def _from_validation(n: int, exc: ValidationError, prefix: str) -> LineError:
    err = validation_error_body(exc.errors(include_url=False))["error"]
    param = f"{prefix}{err['param']}" if err.get("param") else (prefix.rstrip(".") or None)
    message = err["message"]
    if err.get("param") and message.startswith(f"{err['param']}: "):
        message = message[len(err["param"]) + 2:]
    return LineError(line=n, param=param, code=err.get("code") or "invalid_value", message=message)


Resolve = Callable[[str], Awaitable[ResolvedModel]]


async def check_file(data: bytes, resolve: Resolve, builders: dict) -> CheckedFile:
    """Every line checked; `resolve(model)` is the gateway's resolver bound to the caller's tenant (so another
    tenant's adapter reads as a model that does not exist)."""
    checked = await asyncio.to_thread(split_lines, data)
    if not checked.lines:
        return checked
    resolved: dict[str, ResolvedModel | ApiError] = {}
    for line in checked.lines:
        model = line.body.get("model")
        if isinstance(model, str) and model not in resolved:
            try:
                resolved[model] = await resolve(model)
            except ApiError as exc:
                resolved[model] = exc
    body_errors = await asyncio.to_thread(_check_bodies, checked.lines, checked.numbers, resolved, builders)
    checked.errors = sorted(checked.errors + body_errors, key=lambda e: e.line)
    return checked


def _check_bodies(lines: list[InputLine], numbers: list[int], resolved: dict, builders: dict) -> list[LineError]:
    errors = []
    for n, line in zip(numbers, lines):
        err = check_body(n, line, resolved, builders)
        if err is not None:
            errors.append(err)
    return errors


def check_body(n: int, line: InputLine, resolved: dict, builders: dict) -> LineError | None:
    """One line's body as the live endpoint would judge it; None when it would be accepted."""
    try:
        req = parse_request(line.url, line.body)
    except ValidationError as exc:
        return _from_validation(n, exc, prefix="body.")
    if req.stream:
        return LineError(line=n, param="body.stream", code="unsupported_value", message="a batch line cannot stream")
    target = resolved.get(req.model)
    if isinstance(target, ApiError):
        return LineError(line=n, param="body.model", code=target.code, message=target.message)
    assert target is not None
    try:
        plan_request(ENDPOINTS[line.url], req, builders[target.base.name], target.base.max_model_len)
    except InvalidRequest as exc:
        return LineError(line=n, param=f"body.{exc.param}" if exc.param else "body", code=exc.code, message=exc.message)
    return None
