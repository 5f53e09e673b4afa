"""The engine's internal stream, one owner for both sides: the request the gateway sends to
`GENERATE_PATH` and the NDJSON lines the engine streams back, as typed models.

The gateway builds a `GenerateRequest` from values it has already validated (`SamplingParams` checks
itself, whoever builds it) and the engine validates what arrives (it trusts no caller: the endpoint is
authenticated, not assumed correct). Each stream line is one `StreamItem`: the tokens of one step; the
last adds `usage`; a failure mid-stream is an item with `error` and whose fault it was.
"""
from __future__ import annotations

from typing import Annotated

import orjson
from typing_extensions import TypedDict

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from services.common.wire import FAULT_ENGINE, FAULT_REQUEST, EngineUnavailable, InvalidRequest, SamplingParams

GENERATE_PATH = "/internal/v1/generate"
# The wire's version, sent by the gateway in WIRE_HEADER (absent: 1). An engine refuses a version it does not
# speak as its own fault (EngineUnavailable), so during a rolling upgrade the gateway tries the next engine.
WIRE_VERSION = 1
WIRE_HEADER = "x-mplex-wire"
# Sent "1" by a caller that needs the whole answer, not its steps (the gateway's non-streamed requests): after
# the first line the engine sends the rest as one line at the end. A header, not a GenerateRequest field, so an
# engine that does not know it ignores it (and streams every step, which the caller reads alike).
COALESCE_HEADER = "x-mplex-coalesce"
# The streams socket: a WebSocket on the engine's port carrying many GenerateRequests at once, each stream's
# lines batched into one frame per flush (a step) instead of one HTTP response and one write per step per request.
# See `open_command` / `stream_line` below; the per-request endpoint GENERATE_PATH stays for everything else.
STREAMS_PATH = "/internal/v1/streams"
# An engine's incoming frame limit (its WebSocket max message size). A gateway flushes before a frame grows past
# half of it and sends a request whose open command is over STREAMS_MAX_OPEN_BYTES through GENERATE_PATH instead,
# where the engine's per-request body limit applies: one large request never costs the socket everyone shares.
STREAMS_MAX_FRAME = 16 * 1024 * 1024
STREAMS_MAX_OPEN_BYTES = 1024 * 1024
_ID = r"^[A-Za-z0-9._:-]+$"


def check_wire_version(value: str | None) -> None:
    if value is not None and value.strip() != str(WIRE_VERSION):
        raise EngineUnavailable(f"this engine speaks engine wire v{WIRE_VERSION}, not {value[:16]!r}",
                                code="wire_version_unsupported")


# SamplingParams checks itself (one set of rules for both services); pydantic only hands it the JSON object.
WireSampling = Annotated[
    SamplingParams,
    PlainValidator(SamplingParams.from_wire, json_schema_input_type=dict),
    PlainSerializer(SamplingParams.to_wire, return_type=dict),
]


class AdapterSpec(BaseModel):
    """Which adapter: its content id (never its name) and where the engine may fetch it from."""

    model_config = ConfigDict(extra="forbid")

    content_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str = Field(default="", max_length=300)
    uri: str | None = Field(default=None, max_length=4096)


class GenerateRequest(BaseModel):
    """One choice of one request, already tokenized and authorized by the gateway."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200, pattern=_ID)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: WireSampling = Field(default_factory=SamplingParams)
    priority: str | int | None = None
    cache_salt: str = Field(default="", max_length=256, pattern=r"^[\x21-\x7e]*$")
    adapter: AdapterSpec | None = None
    client_request_id: str | None = Field(default=None, max_length=128, pattern=_ID)
    # Who the request is for and its plan's share weight: set by the gateway from the authenticated key,
    # never by a client (this endpoint needs the platform credential). Fair sharing and per-tenant metrics.
    tenant: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9._:-]*$")
    weight: float = Field(default=1.0, gt=0, le=1000)

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_defaults=True).encode()


class TopLogprob(TypedDict):
    token: str
    token_id: int
    logprob: float | None  # -inf (a token top-k or a grammar masked out) travels as null, as OpenAI sends it


class LogprobItem(TypedDict):
    """One generated token's logprob and its top alternatives (plain dicts on both sides: OpenAI's shape)."""

    token: str
    token_id: int
    logprob: float | None
    top: list[TopLogprob]


class StreamUsage(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    compute_seconds: float = 0.0
    engine_id: str = ""
    draft_tokens: int = 0  # speculative decoding: drafted / accepted for this request (openai_protocol.Usage)
    accepted_draft_tokens: int = 0


class StreamError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class StreamItem(BaseModel):
    """One NDJSON line: a step's tokens (text held back for stop strings may come later), or the end."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[LogprobItem] | None = None
    finish_reason: str | None = None
    usage: StreamUsage | None = None  # on the last line
    error: StreamError | None = None  # the request failed mid-stream (and this is the last line)
    fault: str | None = None  # with `error`: FAULT_REQUEST or FAULT_ENGINE

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode() + b"\n"

    def extend(self, later: StreamItem) -> None:
        """Append a later step's item to this one (a coalesced stream): text, tokens and logprobs in order, the
        later end (finish reason, usage)."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason, self.usage = later.finish_reason, later.usage

    @staticmethod
    def step_line(text: str, token_ids: list[int]) -> bytes:
        """`StreamItem(text=text, token_ids=token_ids).encode()`, the line of a step that is not the last (most of a
        stream's lines), at a tenth of the model's cost per token."""
        return orjson.dumps({"text": text, "token_ids": token_ids}) + b"\n"

    @staticmethod
    def step_of(line: bytes) -> tuple[str, list[int]] | None:
        """The text and tokens of a plain step's line (what `step_line` writes), or None for any other line -- the
        last, an error, logprobs, anything unexpected -- which `decode` then reads. Most of a stream's lines are
        plain steps; this reads one at a fifth of the model's cost (the gateway relays every one)."""
        try:
            d = orjson.loads(line)
        except orjson.JSONDecodeError:
            return None
        if type(d) is dict and len(d) == 2:
            text, token_ids = d.get("text"), d.get("token_ids")
            if type(text) is str and type(token_ids) is list and all(type(t) is int for t in token_ids):
                return text, token_ids
        return None

    @classmethod
    def decode(cls, line: bytes) -> StreamItem:
        return cls.model_validate_json(line)

    @classmethod
    def failure(cls, exc: InvalidRequest | EngineUnavailable) -> StreamItem:
        if isinstance(exc, InvalidRequest):
            error = StreamError(message=exc.message, type=exc.error_type, param=exc.param, code=exc.code)
            return cls(error=error, fault=FAULT_REQUEST)
        return cls(error=StreamError(message=exc.message, type="server_error", code=exc.code), fault=FAULT_ENGINE)

    def raise_error(self) -> None:
        """The failure this item carries, as the exception both services share."""
        err = self.error
        assert err is not None
        if self.fault == FAULT_ENGINE:
            raise EngineUnavailable(err.message, code=err.code or "engine_unavailable")
        raise InvalidRequest(err.message, err.param, err.code, 500 if err.type == "server_error" else 400)


# -- the streams socket ------------------------------------------------------------------------------------
# Gateway -> engine: frames of command lines, `{"open": sid, "coalesce": bool, "request": GenerateRequest}` or
# `{"close": sid}` (abort: the client hung up). A stream id is the gateway's, unique on its socket while open.
# Engine -> gateway: frames of event lines, each `<sid> <event>`: a StreamItem line as GENERATE_PATH streams it,
# `!` + a StreamRefusal (the request was not taken: what GENERATE_PATH answers as an HTTP error) or `+` + the
# value of CLAMPED_HEADER (sent before the first item when overload clamped the request's max_tokens), or `.`: the
# stream ended (where GENERATE_PATH's body ends; a stream that ends before an item with usage or error was lost).
REFUSED, CLAMPED, END = b"!", b"+", b"."


class StreamRefusal(BaseModel):
    """A request the engine did not take on the streams socket: the HTTP error GENERATE_PATH would have answered."""

    status: int
    fault: str | None = None  # FAULT_HEADER's value: whose fault it was
    retry_after: int | None = None
    body: dict = Field(default_factory=dict)  # the OpenAI error body


def open_command(sid: int, request: bytes, coalesce: bool) -> bytes:
    """`request`: a GenerateRequest's encoding (`GenerateRequest.encode`)."""
    return b'{"open":%d,"coalesce":%s,"request":%s}\n' % (sid, b"true" if coalesce else b"false", request)


def close_command(sid: int) -> bytes:
    return b'{"close":%d}\n' % sid


def stream_line(sid: int, line: bytes) -> bytes:
    """An event line: `line` is a StreamItem's encoding (ending in a newline) or REFUSED / CLAMPED + payload."""
    return b"%d %s" % (sid, line)
