"""OpenAI request models and response builders, shared by the gateway and the engine's own endpoints.

Requests are validated into our `SamplingParams`; every refusal names the offending field. Responses
are plain dicts in OpenAI's shapes (chat.completion, chat.completion.chunk, text_completion).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.structured import (
    GUIDE_JSON_OBJECT,
    GUIDE_JSON_SCHEMA,
    GUIDE_TOOL_CALLS,
    Guide,
    ToolSpec,
    check_schema,
    check_tool,
)
from services.common.tool_calls import ToolCallStream, split_output
from services.common.wire import (
    MAX_CHOICES,
    MAX_GUIDE_CHARS,
    EngineUnavailable,
    MAX_N,
    MAX_PROMPTS,
    InvalidRequest,
    Priority,
    SamplingParams,
    check_text,
)

MAX_MESSAGES = 2048
MAX_TOOLS = 128


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-compatible extensions that benchmark tools send.
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: str | int | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # Before anything else reads a string: a lone surrogate would fail in the tokenizer, the JSON
        # encoder or a log line, far from here and as a 500.
        if isinstance(data, dict):
            for key, value in data.items():
                check_text(value, key if isinstance(key, str) else "body")
        return data

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        return [v] if isinstance(v, str) else v

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be between 1 and {MAX_N}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):  # NaN and infinities are truthy too: refused with the rest
                raise InvalidRequest(f"{name} is not supported by this server; omit it or send 0", name)
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def guide(self) -> Guide | None:
        """What the output is constrained to (chat only: response_format, forced tool calls)."""
        return None

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Choice 0's params; choice k's are `.with_seed_offset(k)` of these."""
        guide = self.guide()
        return SamplingParams(
            guide=guide.text if guide is not None else None,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def priority_class(self) -> Priority:
        return Priority.parse(self.priority)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported by this server", "echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise InvalidRequest("logprobs must be between 0 and 5", "logprobs")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if len(p) > MAX_PROMPTS:
            raise InvalidRequest(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(p)}", "prompt")
        if len(p) * self.n > MAX_CHOICES:
            raise InvalidRequest(f"prompts x n may be at most {MAX_CHOICES}, got {len(p)} x {self.n}", "n")
        return list(p)


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if len(self.messages) > MAX_MESSAGES:
            raise InvalidRequest(f"messages may hold at most {MAX_MESSAGES} messages", "messages")
        self.guide()  # checks response_format, tools and tool_choice, naming the field
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", "top_logprobs")

    def tool_specs(self) -> list[ToolSpec]:
        """`tools` checked -- OpenAI function tools with names unique and schemas in the supported subset --
        as the specs a guide constrains calls to."""
        if self.tools is None:
            return []
        if not isinstance(self.tools, list) or len(self.tools) > MAX_TOOLS:
            raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
        specs: list[ToolSpec] = []
        seen: set[str] = set()
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                raise InvalidRequest("only tools of type 'function' with a 'function' object are supported",
                                     f"tools[{i}]")
            spec = check_tool(t["function"], f"tools[{i}].function")
            if spec.name in seen:
                raise InvalidRequest(f"tool name {spec.name!r} appears twice", f"tools[{i}].function.name")
            seen.add(spec.name)
            specs.append(spec)
        return specs

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named (tool_choice names a function). Without tools: none."""
        c = self.tool_choice
        if not self.tools:
            if c not in (None, "none", "auto"):
                raise InvalidRequest("tool_choice needs tools", "tool_choice")
            return "none"
        if c is None:
            return "auto"
        if c in ("none", "auto", "required"):
            return c
        if isinstance(c, dict) and c.get("type") == "function" and isinstance(c.get("function"), dict):
            return "named"
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_mode != "none"

    def guide(self) -> Guide | None:
        guide = self._guide()
        if guide is not None and len(guide.text) > MAX_GUIDE_CHARS:
            param = "tools" if guide.kind == GUIDE_TOOL_CALLS else "response_format"
            raise InvalidRequest(f"the {param} JSON is longer than {MAX_GUIDE_CHARS} characters", param)
        return guide

    def _guide(self) -> Guide | None:
        specs = self.tool_specs()
        mode = self.tool_mode
        fmt = _response_format(self.response_format)
        if mode in ("required", "named"):
            if fmt is not None:
                raise InvalidRequest("response_format cannot be combined with a forced tool call", "response_format")
            if mode == "named":
                name = self.tool_choice["function"].get("name")
                specs = [s for s in specs if s.name == name]
                if not specs:
                    raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
            return Guide(GUIDE_TOOL_CALLS, tools=tuple(specs), parallel=self.parallel_tool_calls and mode == "required")
        if fmt is not None and mode == "auto":
            raise InvalidRequest("response_format cannot be combined with tools under tool_choice 'auto'",
                                 "response_format")
        if mode == "auto" and not self.min_tokens:
            # The model decides; a call it opens is held to the tools' schemas, so it always parses. (With
            # min_tokens, which bans the end token, the grammar could be left without a legal token.)
            return Guide(GUIDE_TOOL_CALLS, tools=tuple(specs), parallel=self.parallel_tool_calls, optional=True)
        return fmt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _response_format(rf: Any) -> Guide | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format.type")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return Guide(GUIDE_JSON_OBJECT)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidRequest("response_format.json_schema must be an object with a name and a schema",
                             "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.replace("_", "").replace("-", "").isalnum():
        raise InvalidRequest("response_format.json_schema.name must be 1-64 letters, digits, underscores or dashes",
                             "response_format.json_schema.name")
    if not isinstance(js.get("strict", False), bool) and js.get("strict") is not None:
        raise InvalidRequest("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    if "schema" not in js:
        raise InvalidRequest("response_format.json_schema.schema is required", "response_format.json_schema.schema")
    return Guide(GUIDE_JSON_SCHEMA, schema=check_schema(js["schema"], "response_format.json_schema.schema"))


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str = "max_tokens") -> int:
    """Chat requests without max_tokens may use the rest of the context (as OpenAI does)."""
    if requested is None:
        left = max_model_len - prompt_len
        if left <= 0:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} tokens.",
                "messages", code="context_length_exceeded",
            )
        return left
    if requested <= 0:
        raise InvalidRequest(f"{param} must be a positive integer, got {requested}", param)
    return requested


# -- streaming deltas and responses ---------------------------------------------------------------
@dataclass(slots=True)
class Delta:
    """One piece of one choice, as streamed by the engine."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None  # [{"token", "logprob", "bytes", "top": [{"token","logprob","bytes"}]}]
    finish_reason: str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding: draft tokens verified for the request, and of those the ones accepted. Reported in
    # OpenAI's `completion_tokens_details` (its predicted-outputs fields) when anything was drafted; billing
    # counts `completion_tokens` only -- the tokens emitted, the same with and without speculation.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        self.draft_tokens += other.draft_tokens
        self.accepted_draft_tokens += other.accepted_draft_tokens

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.draft_tokens:
            # accepted: drafted tokens that are in the completion (a stop string can cut some accepted ones off);
            # rejected: drafted tokens the target model did not produce (computed, never emitted nor billed).
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": min(self.accepted_draft_tokens, self.completion_tokens),
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens}
        return out


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None


class ResponseBuilder:
    """Builds OpenAI chunks while streaming, or one response at the end, for one HTTP request."""

    def __init__(self, kind: Literal["chat", "completion"], response_id: str, model: str, n: int, want_logprobs: bool,
                 parse_tools: bool = False):
        self.kind, self.id, self.model = kind, response_id, model
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.choices = [_Choice(logprobs=[] if want_logprobs else None) for _ in range(n)]
        self._started = [False] * n
        # Chat with tools offered: each choice's text is split into content and tool calls as it streams.
        self._tools = [ToolCallStream() for _ in range(n)] if parse_tools and kind == "chat" else None

    def add(self, d: Delta) -> None:
        c = self.choices[d.index]
        c.text.append(d.text)
        if c.logprobs is not None and d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.finish_reason:
            c.finish_reason = d.finish_reason

    def chunk(self, d: Delta) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        if self.kind == "chat":
            delta, finish = self._chat_delta(d)
            if not self._started[d.index]:
                delta = {"role": "assistant", **delta}
                self._started[d.index] = True
            choice: dict[str, Any] = {"index": d.index, "delta": delta, "finish_reason": finish}
            choice["logprobs"] = {"content": [_chat_lp(x) for x in d.logprobs]} if self.want_logprobs and d.logprobs else None
        else:
            choice = {"index": d.index, "text": d.text, "finish_reason": d.finish_reason}
            choice["logprobs"] = _completion_lp(d.logprobs) if self.want_logprobs and d.logprobs else None
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _chat_delta(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        if self._tools is None:
            return {"content": d.text}, d.finish_reason
        stream = self._tools[d.index]
        before = len(stream.calls)
        content, calls = stream.push(d.text)
        if d.finish_reason:
            tail, _ = stream.flush()
            content += tail
        delta: dict[str, Any] = {"content": content if content or not calls else None}
        if calls:
            delta["tool_calls"] = [{"index": before + k, **c.to_message()} for k, c in enumerate(calls)]
        return delta, _finish_with_calls(d.finish_reason, bool(stream.calls))

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [], "usage": usage.to_dict()}

    def response(self, usage: Usage) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if self._tools is not None:
                    content, calls = split_output(text)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.to_message() for call in calls]
                    finish = _finish_with_calls(finish, bool(calls))
                item: dict[str, Any] = {
                    "index": i,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": {"content": [_chat_lp(x) for x in c.logprobs]} if c.logprobs is not None else None,
                }
            else:
                item = {
                    "index": i,
                    "text": text,
                    "finish_reason": c.finish_reason,
                    "logprobs": _completion_lp(c.logprobs) if c.logprobs is not None else None,
                }
            choices.append(item)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage.to_dict()}


def _finish_with_calls(reason: str | None, called: bool) -> str | None:
    """A choice that ended on its own after calling tools finished with `tool_calls` (as OpenAI reports)."""
    return "tool_calls" if called and reason == "stop" else reason


def _chat_lp(x: dict[str, Any]) -> dict[str, Any]:
    return {
        "token": x["token"],
        "logprob": x["logprob"],
        "bytes": list(x["token"].encode()),
        "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())} for t in x.get("top", [])],
    }


def _completion_lp(items: list[dict[str, Any]]) -> dict[str, Any]:
    offsets, pos = [], 0
    for x in items:
        offsets.append(pos)
        pos += len(x["token"])
    return {
        "tokens": [x["token"] for x in items],
        "token_logprobs": [x["logprob"] for x in items],
        "top_logprobs": [{t["token"]: t["logprob"] for t in x.get("top", [])} for x in items],
        "text_offset": offsets,
    }


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The 400 body for a request body that failed to parse (FastAPI's RequestValidationError.errors()): the
    first error, its location as the param; our own InvalidRequest raised inside a validator keeps its
    own param, message and code."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequest):
        return error_of(cause)
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return error_body(f"{param or 'body'}: {err.get('msg')}", "invalid_request_error", param)


def error_of(exc: InvalidRequest | EngineUnavailable) -> dict[str, Any]:
    """The OpenAI error body of a refusal or failure raised by either service."""
    if isinstance(exc, InvalidRequest):
        return error_body(exc.message, exc.error_type, exc.param, exc.code)
    return error_body(exc.message, "server_error", None, exc.code)
