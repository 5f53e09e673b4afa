"""The OpenAI request flow shared by the gateway and the engine: plan choices, merge streams, format.

A request becomes one `ChoiceJob` per (prompt, n) pair; each job streams `Delta`s from an engine;
the merged stream is rendered as SSE chunks or as one response.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import orjson

from services.common.streaming import DirectBody
from services.common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    ResponseBuilder,
    Usage,
    error_of,
    resolve_max_tokens,
)
from services.common.prompting import PromptBuilder
from services.common.wire import EngineUnavailable, InvalidRequest, SamplingParams, check_prompt_ids

# Plans whose text is longer than this are tokenized on a worker thread: the Rust tokenizer releases the
# GIL, and a long prompt must not hold the event loop (every other request's I/O) while it is encoded.
INLINE_TOKENIZE_CHARS = 4096


@dataclass(slots=True)
class ChoiceJob:
    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class OpenAIPlan:
    kind: Literal["chat", "completion"]
    request: ChatCompletionRequest | CompletionRequest
    jobs: list[ChoiceJob]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(j.prompt_ids) for j in self.jobs)

    @property
    def worst_case_tokens(self) -> int:
        """Prompt plus every token the request may generate: what a quota must reserve."""
        return sum(len(j.prompt_ids) + j.params.max_tokens for j in self.jobs)

    @property
    def parses_tool_calls(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest) and self.request.parses_tool_calls

    @property
    def want_logprobs(self) -> bool:
        return self.jobs[0].params.logprobs is not None


async def plan_request_async(
    kind: Literal["chat", "completion"],
    req: ChatCompletionRequest | CompletionRequest,
    builder: PromptBuilder,
    max_model_len: int,
) -> OpenAIPlan:
    """`plan_request`, off the event loop when the request carries enough text to take a while (a text too
    long to ever fit is refused here first: no thread hop for it)."""
    if longest_prompt_chars(req) > builder.max_chars(max_model_len):
        raise _too_long(max_model_len, "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if text_chars(req) <= INLINE_TOKENIZE_CHARS:
        return plan_request(kind, req, builder, max_model_len)
    return await asyncio.to_thread(plan_request, kind, req, builder, max_model_len)


def text_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of prompt text the request asks us to tokenize (an upper bound for chat: every string)."""
    if isinstance(req, ChatCompletionRequest):
        return _chars(req.messages)
    p = req.prompt
    return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))


def longest_prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of the longest single prompt (a chat's messages make one prompt)."""
    if isinstance(req, ChatCompletionRequest):
        return _chars(req.messages)
    p = req.prompt
    return len(p) if isinstance(p, str) else max((len(x) for x in p if isinstance(x, str)), default=0)


def _chars(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


def plan_request(
    kind: Literal["chat", "completion"],
    req: ChatCompletionRequest | CompletionRequest,
    builder: PromptBuilder,
    max_model_len: int,
) -> OpenAIPlan:
    req.check_supported()
    # No prompt of more characters than this can fit the context, whatever its tokens: refuse it
    # before spending time on tokenizing it.
    max_chars = builder.max_chars(max_model_len)
    jobs: list[ChoiceJob] = []
    if isinstance(req, ChatCompletionRequest):
        if _chars(req.messages) > max_chars:
            raise _too_long(max_model_len, "messages")
        ids = builder.chat_ids(req.messages, req.tools or None)  # as sent: check_supported checked them
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(ids), max_model_len, param)
        params = req.sampling(max_tokens, req.num_logprobs)
        params.check_for_model(builder.vocab_size)
        for c in range(req.n):
            jobs.append(ChoiceJob(c, ids, params.with_seed_offset(c)))
    else:
        for p_index, prompt in enumerate(req.prompts()):
            if isinstance(prompt, list):
                check_prompt_ids(prompt, builder.vocab_size)
                ids = prompt
            elif len(prompt) > max_chars:
                raise _too_long(max_model_len, "prompt")
            else:
                ids = builder.text_ids(prompt)
            if not ids:
                raise InvalidRequest("prompt must not be empty", "prompt")
            max_tokens = resolve_max_tokens(req.max_tokens, len(ids), max_model_len)
            params = req.sampling(max_tokens, req.logprobs)
            params.check_for_model(builder.vocab_size)
            for c in range(req.n):
                jobs.append(ChoiceJob(p_index * req.n + c, ids, params.with_seed_offset(c)))
    for job in jobs:
        if len(job.prompt_ids) >= max_model_len or len(job.prompt_ids) + job.params.max_tokens > max_model_len:
            n = len(job.prompt_ids)
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{n + job.params.max_tokens} tokens ({n} in the prompt, {job.params.max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                "messages" if kind == "chat" and n >= max_model_len else ("prompt" if n >= max_model_len else "max_tokens"),
                code="context_length_exceeded",
            )
    return OpenAIPlan(kind, req, jobs)


def _too_long(max_model_len: int, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"This model's maximum context length is {max_model_len} tokens, and the {param} is longer than any "
        f"text of that many tokens can be.", param, code="context_length_exceeded",
    )


# A choice stream yields deltas; its last item carries that choice's usage.
ChoiceStream = AsyncIterator[tuple[Delta, Usage | None]]


def merge(streams: list[ChoiceStream]) -> AsyncIterator[tuple[Delta, Usage | None]]:
    """Interleave several choices' streams as their items arrive; closing this closes them all. One choice: its
    own stream (a pass-through generator would cost a hop per step per stream)."""
    return streams[0] if len(streams) == 1 else _merge(streams)


async def _merge(streams: list[ChoiceStream]) -> AsyncIterator[tuple[Delta, Usage | None]]:
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(s: ChoiceStream) -> None:
        try:
            async for item in s:
                await q.put(item)
        except BaseException as exc:  # re-raised in the consumer below
            await q.put(exc)
        finally:
            await q.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            close = getattr(s, "aclose", None)
            if close is not None:
                try:
                    await close()
                except RuntimeError:
                    pass  # already running its own cleanup in the cancelled pump task


def sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def stream_sse(
    plan: OpenAIPlan,
    response_id: str,
    model: str,
    items: AsyncIterator[tuple[Delta, Usage | None]],
    on_usage: Callable[[Usage], None] | None = None,
    on_sent: Callable[[int, int], None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    direct: DirectBody | None = None,
) -> AsyncIterator[bytes]:
    """SSE chunks of the merged choice streams. `on_sent(choice, tokens)` is called once a chunk has been
    handed to the connection, for the tokens it carries (a hung-up client is billed for those only). A
    refusal or engine failure mid-stream ends the stream with an OpenAI error event (`on_error` hears of
    it), not a broken connection. `direct`: the response's fast path (services.common.streaming.DirectBody), taken
    for one choice without logprobs or tool calls: a step's text rendered here, on the producer's call."""
    builder = ResponseBuilder(plan.kind, response_id, model, len(plan.jobs), plan.want_logprobs, plan.parses_tool_calls)
    usage = Usage()
    pending = [0] * len(plan.jobs)  # tokens received per choice whose text has not been sent yet

    def render(delta: Delta) -> bytes | None:  # a step's tokens on the fast path: never the last item, no usage
        chunk = sse(builder.chunk(delta)) if delta.text else None  # first: a failure here leaves nothing counted
        pending[0] += len(delta.token_ids)
        if chunk is not None:
            if on_sent is not None:
                on_sent(0, pending[0])
            pending[0] = 0
        return chunk

    if direct is not None and len(plan.jobs) == 1 and not plan.want_logprobs and not plan.parses_tool_calls:
        direct.render = render
    # The stream's last chunk (its last choice's finish) is held and sent with the usage chunk and [DONE]: one write
    # to the connection where there were three.
    last: bytes = b""
    last_sent: tuple[int, int] | None = None  # (choice, tokens) that `last` carries, counted once it is sent
    unfinished = len(plan.jobs)
    try:
        async for delta, u in items:
            if u is not None:
                usage.add(u)
            pending[delta.index] += len(delta.token_ids)
            if delta.text or delta.finish_reason or delta.logprobs:
                chunk = sse(builder.chunk(delta))
                if delta.finish_reason:
                    unfinished -= 1
                    if unfinished == 0:
                        last, last_sent = chunk, (delta.index, pending[delta.index])
                        pending[delta.index] = 0
                        continue
                yield chunk
                if on_sent is not None:
                    on_sent(delta.index, pending[delta.index])
                pending[delta.index] = 0
    except (InvalidRequest, EngineUnavailable) as exc:
        if on_error is not None:
            on_error(exc)
        yield last + sse(error_of(exc))
        if on_sent is not None and last_sent is not None:
            on_sent(*last_sent)
        return
    finally:
        if direct is not None:
            direct.render = None
        await _close(items)  # a client that hangs up aborts every choice upstream at once
    if on_usage is not None:
        on_usage(usage)
    tail = last + sse(builder.usage_chunk(usage)) if plan.request.include_usage else last
    yield tail + b"data: [DONE]\n\n"
    if on_sent is not None and last_sent is not None:
        on_sent(*last_sent)


async def collect(
    plan: OpenAIPlan, response_id: str, model: str, items: AsyncIterator[tuple[Delta, Usage | None]]
) -> tuple[dict, Usage]:
    builder = ResponseBuilder(plan.kind, response_id, model, len(plan.jobs), plan.want_logprobs, plan.parses_tool_calls)
    usage = Usage()
    try:
        async for delta, u in items:
            if u is not None:
                usage.add(u)
            builder.add(delta)
    finally:
        await _close(items)
    return builder.response(usage), usage


async def _close(items: AsyncIterator) -> None:
    close = getattr(items, "aclose", None)
    if close is not None:
        await close()
