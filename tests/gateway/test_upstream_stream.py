"""The gateway's read of an engine stream (upstream._read_stream) against a real engine: steps that arrive while
the gateway is busy elsewhere reach the client as one delta (over either transport: its own HTTP stream or the
streams socket it shares) -- nothing lost, nothing reordered, the usage on the
last -- and a reader that keeps up gets the steps as they come."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from services.common.engine_wire import GenerateRequest
from services.common.wire import SamplingParams
from services.gateway.engine_streams import StreamsPool
from services.gateway.router import EngineInfo, Router
from services.gateway.upstream import StreamResult, open_choice


def _stream(stack, lag_s: float, tag: str, socket: bool) -> tuple[list, StreamResult]:
    proc = stack.engines[0]
    info = EngineInfo(proc.engine_id, proc.url, "base", frozenset(), frozenset(), 0, 0, 0.0, 256, 512)
    req = GenerateRequest(request_id=f"upstream-{tag}", prompt_token_ids=[5, 6, 7, 8, 9], tenant="t",
                          sampling=SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))

    async def main():
        result = StreamResult()
        deltas = []
        async with aiohttp.ClientSession(headers=stack.engine_headers()) as http:
            pool = StreamsPool(http, 1) if socket else None
            async for delta, usage in open_choice(http, Router(), [info], req, 0, result, time.monotonic,
                                                  streams=pool):
                deltas.append((delta, usage))
                if len(deltas) == 1 and lag_s:
                    await asyncio.sleep(lag_s)  # the gateway busy with other streams: the engine's steps pile up
            if pool is not None:
                assert sum(len(s.streams) for group in pool._sockets.values() for s in group) == 0
                await pool.aclose()
        return deltas, result

    return asyncio.run(main())


@pytest.mark.parametrize("socket", [False, True], ids=["http-stream", "streams-socket"])
def test_a_lagging_reader_gets_the_backlog_as_one_delta_and_loses_nothing(stack, socket):
    steady, steady_result = _stream(stack, 0.0, f"steady-{socket}", socket)
    lagged, lagged_result = _stream(stack, 3.0, f"lagged-{socket}", socket)
    for deltas, result in ((steady, steady_result), (lagged, lagged_result)):
        assert sum(len(d.token_ids) for d, _ in deltas) == 48 == result.delivered_tokens
        assert [u is not None for _, u in deltas] == [False] * (len(deltas) - 1) + [True]  # usage on the last only
        assert deltas[-1][1].completion_tokens == 48 and deltas[-1][0].finish_reason == "length"
    # The same greedy tokens and text either way, in order.
    assert [t for d, _ in lagged for t in d.token_ids] == [t for d, _ in steady for t in d.token_ids]
    assert "".join(d.text for d, _ in lagged) == "".join(d.text for d, _ in steady)
    # The steps made during 3 s of lag (all 47 left at up to 60 ms a step) came as one delta, not one each.
    assert max(len(d.token_ids) for d, _ in lagged) >= 16, [len(d.token_ids) for d, _ in lagged]
    # Keeping up, steps come as they are made (the engine's steps are one token each here).
    assert len(steady) >= 4, [len(d.token_ids) for d, _ in steady]
