"""OpenAI request models and response builders, shared by the gateway and the engine's own endpoints.

Requests are validated into our `SamplingParams`; every refusal names the offending field. Responses
are plain dicts in OpenAI's shapes (chat.completion, chat.completion.chunk, text_completion).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.wire import (
    MAX_CHOICES,
    EngineUnavailable,
    MAX_N,
    MAX_PROMPTS,
    InvalidRequest,
    Priority,
    SamplingParams,
    check_text,
)

MAX_MESSAGES = 2048


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

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Choice 0's params; choice k's are `.with_seed_offset(k)` of these."""
        return SamplingParams(
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
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if len(self.messages) > MAX_MESSAGES:
            raise InvalidRequest(f"messages may hold at most {MAX_MESSAGES} messages", "messages")
        if self.tools:
            raise InvalidRequest("tools are not supported by this model", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise InvalidRequest("only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None


class ResponseBuilder:
    """Builds OpenAI chunks while streaming, or one response at the end, for one HTTP request."""

    def __init__(self, kind: Literal["chat", "completion"], response_id: str, model: str, n: int, want_logprobs: bool):
        self.kind, self.id, self.model = kind, response_id, model
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.choices = [_Choice(logprobs=[] if want_logprobs else None) for _ in range(n)]
        self._started = [False] * n

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
            delta: dict[str, Any] = {"content": d.text}
            if not self._started[d.index]:
                delta = {"role": "assistant", "content": d.text}
                self._started[d.index] = True
            choice: dict[str, Any] = {"index": d.index, "delta": delta, "finish_reason": d.finish_reason}
            choice["logprobs"] = {"content": [_chat_lp(x) for x in d.logprobs]} if self.want_logprobs and d.logprobs else None
        else:
            choice = {"index": d.index, "text": d.text, "finish_reason": d.finish_reason}
            choice["logprobs"] = _completion_lp(d.logprobs) if self.want_logprobs and d.logprobs else None
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [], "usage": usage.to_dict()}

    def response(self, usage: Usage) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.kind == "chat":
                item: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": c.finish_reason,
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
