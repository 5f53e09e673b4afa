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

from services.common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    ResponseBuilder,
    Usage,
    resolve_max_tokens,
)
from services.common.prompting import PromptBuilder
from services.common.wire import InvalidRequest, SamplingParams


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
    def want_logprobs(self) -> bool:
        return self.jobs[0].params.logprobs is not None


def plan_request(
    kind: Literal["chat", "completion"],
    req: ChatCompletionRequest | CompletionRequest,
    builder: PromptBuilder,
    max_model_len: int,
) -> OpenAIPlan:
    req.check_supported()
    jobs: list[ChoiceJob] = []
    if isinstance(req, ChatCompletionRequest):
        ids = builder.chat_ids(req.messages)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(ids), max_model_len, param)
        for c in range(req.n):
            jobs.append(ChoiceJob(c, ids, req.sampling(max_tokens, req.num_logprobs, c)))
    else:
        for p_index, prompt in enumerate(req.prompts()):
            if isinstance(prompt, list):
                if not prompt or not all(isinstance(t, int) for t in prompt):
                    raise InvalidRequest("token prompts must be non-empty lists of integers", "prompt")
                if min(prompt) < 0 or max(prompt) >= builder.vocab_size:
                    raise InvalidRequest(f"prompt token ids must be in [0, {builder.vocab_size})", "prompt")
                ids = prompt
            else:
                ids = builder.text_ids(prompt)
            if not ids:
                raise InvalidRequest("prompt must not be empty", "prompt")
            max_tokens = resolve_max_tokens(req.max_tokens, len(ids), max_model_len)
            for c in range(req.n):
                jobs.append(ChoiceJob(p_index * req.n + c, ids, req.sampling(max_tokens, req.logprobs, c)))
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


# A choice stream yields deltas; its last item carries that choice's usage.
ChoiceStream = AsyncIterator[tuple[Delta, Usage | None]]


async def merge(streams: list[ChoiceStream]) -> AsyncIterator[tuple[Delta, Usage | None]]:
    """Interleave several choices' streams as their items arrive; closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
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
) -> AsyncIterator[bytes]:
    builder = ResponseBuilder(plan.kind, response_id, model, len(plan.jobs), plan.want_logprobs)
    usage = Usage()
    try:
        async for delta, u in items:
            if u is not None:
                usage.add(u)
            if delta.text or delta.finish_reason or delta.logprobs:
                yield sse(builder.chunk(delta))
    finally:
        await _close(items)  # a client that hangs up aborts every choice upstream at once
    if on_usage is not None:
        on_usage(usage)
    if plan.request.include_usage:
        yield sse(builder.usage_chunk(usage))
    yield b"data: [DONE]\n\n"


async def collect(
    plan: OpenAIPlan, response_id: str, model: str, items: AsyncIterator[tuple[Delta, Usage | None]]
) -> tuple[dict, Usage]:
    builder = ResponseBuilder(plan.kind, response_id, model, len(plan.jobs), plan.want_logprobs)
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
