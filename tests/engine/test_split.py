"""The engine split as `mplex engine serve` runs it: a core process and front-ends over ZMQ.

Text is made on the front-end from token ids: it must be the in-process engine's text exactly (stop strings,
held-back text, finish reasons). A client that goes away frees its KV in the core at once; a front-end that
dies and comes back costs the core its requests, never itself; a core that dies is seen by its front-ends.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.common.cpu_priority import autogroup_enabled
from services.common.prompting import PromptBuilder
from services.common.wire import EngineFailed, EngineUnavailable, InvalidRequest
from services.engine.async_engine import AsyncEngine
from services.engine.core_client import CoreClient
from services.engine.launcher import (CORE_OMP_SPINCOUNT, START_BACKOFF_S, START_FAILURES_MAX, FrontendSpec,
                                      core_wait_policy, serve)
from services.engine.sequence import SamplingParams
from tests.common.test_cpu_priority import autogroup_nice
from tests.engine.conftest import collect, make_config, make_engine, split_engine



@pytest.fixture(scope="module")
def prompts(demo_kit) -> list[list[int]]:
    b = PromptBuilder(demo_kit.base_dir)
    qs = ["What is the capital of France?", "Hello", "What is 2 plus 3?", "Repeat: red blue green",
          "Name three colours.", "Count to five."]
    return [b.chat_ids([{"role": "user", "content": q}]) for q in qs]


def _in_process(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    tokens, text, reason = [], "", None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            text += o.new_text
            reason = o.finish_reason or reason
    return tokens, text, reason


def test_text_stops_and_finish_reasons_are_the_in_process_ones(demo_kit, prompts):
    """Stop strings taken from the middle of each answer (so they really fire), a stop string that never
    occurs, min_tokens holding stops back, and EOS: token ids, text and finish reason are identical."""
    engine = make_engine(demo_kit.base_dir)
    free = SamplingParams(max_tokens=32, temperature=0)
    cases = []
    for i, p in enumerate(prompts):
        _, text, _ = _in_process(engine, f"free{i}", p, free)
        words = text.split()
        stop = words[len(words) // 2][:3] if len(words) > 1 else "zzz"
        cases += [(p, SamplingParams(max_tokens=32, temperature=0, stop=(stop, "never-said"))),
                  (p, SamplingParams(max_tokens=32, temperature=0, stop=(stop,), min_tokens=6)),
                  (p, SamplingParams(max_tokens=48, temperature=0, logprobs=2))]
    expected = [_in_process(engine, f"x{i}", p, params) for i, (p, params) in enumerate(cases)]
    assert any(r == "stop" for _, _, r in expected) and any(t for _, t, _ in expected)

    async def main():
        async with split_engine(make_config(demo_kit.base_dir)) as (client, _):
            outs = await asyncio.gather(*(collect(client, f"s{i}", p, params) for i, (p, params) in enumerate(cases)))
            assert await client.op("num_in_flight") == 0 and await client.op("check_integrity")
            return outs

    for (tokens, text, reason), out in zip(expected, asyncio.run(main())):
        assert (out.new_token_ids, out.new_text, out.finish_reason) == (tokens, text, reason)


def test_a_client_that_goes_away_frees_its_kv_in_the_core_at_once(demo_kit, prompts):
    async def main():
        async with split_engine(make_config(demo_kit.base_dir)) as (client, _):
            long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            streams = [client.generate(f"g{i}", p, long) for i, p in enumerate(prompts)]
            for s in streams:
                await anext(s)
            assert (await client.op("counters"))["kv_used"] > 0
            for s in streams:
                await s.aclose()  # what the HTTP server does when the client disconnects
            for _ in range(100):
                c = await client.op("counters")
                if c["kv_used"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert c["kv_used"] == 0 and c["running"] == 0 and await client.op("check_integrity")

    asyncio.run(main())


def test_a_bad_request_is_refused_by_the_front_end_and_the_core_keeps_serving(demo_kit, prompts):
    async def main():
        async with split_engine(make_config(demo_kit.base_dir)) as (client, _):
            with pytest.raises(InvalidRequest) as exc:
                await anext(client.generate("bad", [10**9], SamplingParams(max_tokens=4)))
            assert exc.value.param
            out = await collect(client, "good", prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
            assert len(out.new_token_ids) == 4

    asyncio.run(main())


def test_a_front_end_that_dies_costs_the_core_its_requests_only(demo_kit, prompts):
    """A second front-end streams while the first one 'dies' (its socket closes mid-stream, nothing sent) and
    comes back under the same identity: the core drops the dead one's requests and serves both."""
    async def main():
        async with split_engine(make_config(demo_kit.base_dir), frontend="fe-0") as (first, _):
            other = CoreClient(first.address, "fe-1")
            await other.open()
            params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            doomed = [first.generate(f"d{i}", p, params) for i, p in enumerate(prompts)]
            for s in doomed:
                await anext(s)
            survivor = asyncio.create_task(collect(other, "alive", prompts[0], SamplingParams(
                max_tokens=60, temperature=0, ignore_eos=True)))
            first._sock.close(linger=0)  # dies: no aborts sent
            reborn = CoreClient(first.address, "fe-0")
            await reborn.open()  # Hello: the core forgets fe-0's old requests
            assert len((await survivor).new_token_ids) == 60
            c = await reborn.op("counters")
            assert c["running"] == 0 and c["kv_used"] == 0 and await reborn.op("check_integrity")
            again = await collect(reborn, "after", prompts[1], SamplingParams(max_tokens=8, ignore_eos=True))
            assert len(again.new_token_ids) == 8
            await other.close()
            await reborn.close()

    asyncio.run(main())


def test_a_core_that_dies_is_reported_dead_and_fails_its_streams(demo_kit, prompts):
    crash = next(t for t in range(3, 1000) if all(t not in p for p in prompts))  # in no other prompt

    async def main():
        # A prompt holding `crash` kills the core as a segfault in a native kernel would (os._exit, no reply).
        config = make_config(demo_kit.base_dir, failpoints=(("crash", crash),))
        async with split_engine(config) as (client, proc):
            params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
            running = client.generate("r", prompts[0], params)
            await anext(running)
            # In the core's hands when it died: EngineFailed (502, never retried elsewhere: it may be the poison).
            with pytest.raises(EngineFailed):
                await collect(client, "poison", [crash, *prompts[1]], params)
            with pytest.raises(EngineFailed):
                async for _ in running:
                    pass
            proc.join(10)
            assert proc.exitcode == 70 and not client.alive
            with pytest.raises(EngineUnavailable) as late:  # after: this engine is dead, another may serve it
                await anext(client.generate("late", prompts[0], params))
            assert late.value.status == 503 and not isinstance(late.value, EngineFailed)

    asyncio.run(main())


def test_the_launcher_survives_a_front_end_and_exits_with_its_core(demo_kit, tmp_path):
    """`mplex engine serve`: SIGKILL the front-end -- a new one serves, the core is the same process; SIGKILL
    the core -- the launcher exits non-zero (its supervisor starts a fresh engine)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "engine.log", "wb")
    # No operator's OpenMP wait setting: the launcher's own applies (asserted below).
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "engine", "serve", "--model", str(demo_kit.base_dir),
                             "--port", str(port), "--kv-memory-mb", "32"], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    url = f"http://127.0.0.1:{port}/health"

    def wait_ok(timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("engine never became healthy")

    try:
        wait_ok()
        core, frontend = _pids(tmp_path / "engine.log")
        # The core is throughput work (`--core-nice`, default 5, and SCHED_BATCH, set before torch starts its
        # threads); the front-end answers requests and keeps the launcher's priority.
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, core) == max(ours, 5) and os.sched_getscheduler(core) == os.SCHED_BATCH
        assert all(os.getpriority(os.PRIO_PROCESS, int(t)) == max(ours, 5) for t in os.listdir(f"/proc/{core}/task"))
        assert os.getpriority(os.PRIO_PROCESS, frontend) == ours and os.sched_getscheduler(frontend) == os.SCHED_OTHER
        # Its OpenMP team spins briefly between parallel regions, then sleeps (launcher.core_wait_policy).
        with open(f"/proc/{core}/environ", "rb") as f:
            core_env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert core_env.get(b"GOMP_SPINCOUNT") == str(CORE_OMP_SPINCOUNT).encode()
        assert b"OMP_WAIT_POLICY" not in core_env
        if autogroup_enabled():  # the kernel shares the CPU by session first: the core's is its own, niced
            assert os.getsid(core) == core and autogroup_nice(core) == 5
            assert os.getsid(frontend) != core and autogroup_nice(frontend) == autogroup_nice(os.getpid())
        os.kill(frontend, signal.SIGKILL)
        time.sleep(0.5)
        wait_ok()
        assert _parent(core) == proc.pid  # the same core serves the new front-end
        os.kill(core, signal.SIGKILL)
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_front_end_that_cannot_start_stops_the_launcher_instead_of_restarting_forever(demo_kit, caplog):
    """A front-end that dies before it ever serves (here: an HTTP server option that does not exist) is tried
    START_FAILURES_MAX times, after growing pauses; then the launcher stops its core and exits non-zero, so
    that its own supervisor sees a broken engine rather than one that never becomes ready."""
    import logging
    import multiprocessing

    spec = FrontendSpec(address="", engine_tokens=("t" * 32,), registry_url=None, advertise_url="http://127.0.0.1:9",
                        max_body_bytes=2**20, max_header_bytes=2**14, uvicorn={"no_such_option": 1},
                        log_level="warning")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.ERROR, logger="mplex.engine.launcher"):
            status = serve(make_config(demo_kit.base_dir), spec, host="127.0.0.1", port=0, frontends=1, core_threads=1)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert status == 1
    said = [r.getMessage() for r in caplog.records if r.name == "mplex.engine.launcher"]
    assert sum("before it served: starting it again" in m for m in said) == START_FAILURES_MAX - 1, said
    assert sum("before it ever served" in m and "stopping the engine" in m for m in said) == 1, said
    pauses = [m.rsplit("starting it again in ", 1)[1].split(" s")[0] for m in said if "starting it again" in m]
    assert pauses == [f"{START_BACKOFF_S * 2 ** k:.1f}" for k in range(START_FAILURES_MAX - 1)], said  # doubling
    assert not [p.name for p in multiprocessing.active_children() if p.name.startswith("engine-")]  # core stopped too


@pytest.mark.parametrize("operator", [{}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}])
def test_the_cores_openmp_wait_is_a_short_spin_unless_the_operator_chose(operator):
    env = dict(operator)
    core_wait_policy(env)
    assert env == (operator or {"GOMP_SPINCOUNT": str(CORE_OMP_SPINCOUNT)})


def _pids(log) -> tuple[int, int]:
    import re

    m = re.search(r"engine core pid (\d+), front-ends \[(\d+)\]", log.read_text())
    assert m, log.read_text()[-3000:]
    return int(m[1]), int(m[2])


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_drain_through_one_front_end_stops_admission_on_every_front_end(tiny_model):
    """`/drain` reaches one front-end of several (they share the listening socket): the drain is the core's, so
    the other front-ends' new requests are refused as draining (retryable elsewhere), their /ready says so,
    and the requests already in flight on any front-end finish."""
    from services.engine.server import EngineServer

    async def main():
        async with split_engine(make_config(tiny_model), frontend="fe-0") as (first, _):
            other = CoreClient(first.address, "fe-1")
            await other.open()
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            running = first.generate("long", [5, 6, 7, 8], params)
            head = await anext(running)
            server = EngineServer(first, registry_url=None, advertise_url=None)
            assert (await server.ready())["ready"] is True
            assert await other.op("drain") == 1  # drained through the other front-end
            with pytest.raises(EngineUnavailable) as refused:
                await collect(first, "late", [9, 10, 11], params)
            assert refused.value.code == "engine_draining"
            assert (await server.ready()).status_code == 503 and server.draining
            tokens = list(head.new_token_ids)
            async for out in running:
                tokens += out.new_token_ids
            assert len(tokens) == 40  # in flight when the drain came: finished whole
            assert await first.op("num_in_flight") == 0 and await first.op("is_draining")
            await other.close()

    asyncio.run(main())


def test_a_request_id_reused_right_after_a_stop_string_gets_only_its_own_tokens(demo_kit, prompts):
    """A stop string ends a request on the front-end while the core is still generating it (the core hears of it
    with the next message): a new request under the same id, sent at once, must not receive the old one's tokens
    still on their way, nor be refused as a duplicate of it (make fuzz found both)."""
    async def main():
        async with split_engine(make_config(demo_kit.base_dir)) as (client, _):
            free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            fresh = await collect(client, "fresh", prompts[1], free)
            first = await collect(client, "warm", prompts[0], free)
            stop = first.new_text.split()[1][:3]
            for attempt in range(5):
                rid = f"reused-{attempt}"
                old = client.generate(rid, prompts[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                                                                      stop=(stop,)))
                async for out in old:
                    if out.finished:
                        break
                await old.aclose()  # as the HTTP server closes a finished stream
                assert out.finish_reason == "stop"
                again = await collect(client, rid, prompts[1], free)  # same id, at once
                assert (again.new_token_ids, again.new_text, again.finish_reason) == (
                    fresh.new_token_ids, fresh.new_text, fresh.finish_reason)
            assert await client.op("check_integrity")

    asyncio.run(main())


@pytest.mark.parametrize("where", ["split", "in_process"])
def test_a_sink_takes_steps_in_order_never_the_last_and_a_failing_one_loses_nothing(demo_kit, prompts, where):
    """`generate`'s `sink` (the client response's fast path), on the split path (CoreClient) and in-process
    (AsyncEngine): a step's output offered to it while the consumer waits with nothing queued is not yielded again
    if it took it, so sink and consumer together see every step once, in order; the last output always reaches the
    consumer; a sink that declines leaves the output to the consumer, and one that raises is dropped for that
    request only -- its stream goes on, nothing lost."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def run(client, rid, prompt, sink_kind):
        seen: list[tuple[str, list[int], bool]] = []
        calls = 0

        def sink(out):
            nonlocal calls
            calls += 1
            if sink_kind == "raises" and calls == 3:
                raise RuntimeError("a broken fast path")
            if sink_kind == "declines" or (sink_kind == "alternates" and calls % 2):
                return False
            seen.append(("sink", out.new_token_ids, out.finished))
            return True

        async for out in client.generate(rid, prompt, params, sink=None if sink_kind == "none" else sink):
            seen.append(("consumer", out.new_token_ids, out.finished))
            await asyncio.sleep(0)  # the consumer is busy now and then: outputs queue meanwhile
        return seen, calls

    async def serve(client):
        results = {}
        for kind in ("none", "takes", "alternates", "declines", "raises"):
            runs = (run(client, f"{kind}{i}", p, kind) for i, p in enumerate(prompts[:4]))
            results[kind] = await asyncio.gather(*runs)
        assert await client.op("num_in_flight") == 0 and await client.op("check_integrity")
        return results

    async def main():
        if where == "split":
            async with split_engine(make_config(demo_kit.base_dir)) as (client, _):
                return await serve(client)
        engine = AsyncEngine(make_engine(demo_kit.base_dir))
        await engine.open()
        try:
            return await serve(engine)
        finally:
            await engine.close()

    results = asyncio.run(main())
    expected = [[t for _, ids, _ in seen for t in ids] for seen, _ in results["none"]]
    assert all(len(e) == 24 for e in expected)
    for kind, runs in results.items():
        for (seen, calls), tokens in zip(runs, expected):
            assert [t for _, ids, _ in seen for t in ids] == tokens, kind  # every step once, in order
            assert seen[-1][0] == "consumer" and seen[-1][2], kind  # the last output: to the consumer
            assert not any(finished for who, _, finished in seen if who == "sink"), kind
            taken = sum(who == "sink" for who, _, _ in seen)
            if kind == "none":
                assert calls == 0
            elif kind == "takes":
                assert taken >= 12, "the sink should get most steps of an idle consumer"
            elif kind == "declines":
                assert calls > 0 and taken == 0
            elif kind == "raises":
                assert calls == 3 and taken == 2  # dropped after its fault: the rest went to the consumer
