"""Isolation (issue 18): how much big or hostile requests slow other clients' small requests.

A real gateway and one engine on the demo model. One sequential client times a small chat completion
(max_tokens=1) and GET /health through the gateway, in phases that alternate with phases where it runs
alone (alone, attack, alone, attack, ...; the attack order reversed every other round), so that drift of a
shared VM lands on both alike; each attack phase is compared with the alone phases on either side of it.
During an attack phase three other clients (threads of one process, raw sockets, a new connection per
request) loop for the whole phase on one kind of request:

  body-413      a 10 MB body with its Content-Length declared     -> 413 once the head is read
  body-chunked  a 10 MB chunked body, 64 KiB every 5 ms            -> 413 once 4 MiB have arrived
  prompt-1mb    valid JSON, a 1 MB string in messages[0].content   -> 400 context_length_exceeded, untokenized
  header-1mb    a 1 MB Authorization header                        -> 431 at the transport
  control       GET /health, a new connection each                 -> 200 (no target: the cost of three
                                                                      clients looping, whatever they send)

Each attack runs twice: *paced* (each attacker sends 20 requests/s: 60 hostile requests/s, 600 MB/s of
10 MB bodies offered -- more than three clients' links deliver; the targets are checked on it) and *flood*
(each attacker sends the next request as soon as the last is answered: 1,000-2,000 requests/s over loopback;
reported, no target: on this 2-core VM the attackers' own CPU and the request rate, not what is sent, set
the slowdown, as the control flood shows).

An attack request's "decision" time runs from the moment the server had all it needs to refuse it (the
head; the byte past the 4 MiB limit; the whole 1 MB prompt; 32 KiB of head) to the first byte of its answer.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.common import Target, pct, table, write_results
from bench.gateway_bench import _free_port, _seed_key, _wait, stop_procs

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = int(os.environ.get("MPLEX_BENCH_ISOLATION_ROUNDS", "3"))
PAIRS = int(os.environ.get("MPLEX_BENCH_ISOLATION_PAIRS", "150"))  # chat + health requests per phase per round
ATTACKERS = 3
# Requests/s each attacker sends, per mode; 0: as fast as the server answers (closed loop).
MODES = (("paced", float(os.environ.get("MPLEX_BENCH_ISOLATION_ATTACK_RATE", "20"))), ("flood", 0.0))
ATTACK_WARMUP_S = 0.5  # attacks in flight (a trickled body reaches the limit after ~0.35 s) before timing
REDIS_DB = 9  # a registry, key cache and quota space of its own on the shared embedded Redis
BIG_BODY = 10 * 10**6
BIG_PROMPT = 10**6
BIG_HEADER = 10**6
CHUNK = 64 * 2**10
TRICKLE_PAUSE_S = 0.005
MAX_BODY = 4 * 2**20  # the servers' default max_request_bytes (MPLEX_MAX_REQUEST_BYTES)
MAX_HEAD = 32 * 2**10  # default max_header_bytes
RATIO_GOAL = 1.2
DECISION_GOAL_MS = 100.0
EXPECTED_GOAL = 0.99
SMALL_PROMPT = "Say hello to the benchmark, please."
ATTACKS = ("body-413", "body-chunked", "prompt-1mb", "header-1mb", "control")
EXPECTED = {"body-413": "413", "body-chunked": "413", "prompt-1mb": "400 context_length_exceeded",
            "header-1mb": "431", "control": "200"}


@dataclass(frozen=True)
class Attack:
    """What one attacking request sends: `pieces` one after the other (`pause_s` between them)."""

    pieces: tuple[bytes, ...]
    pause_s: float
    decidable_at: int  # bytes sent after which the server has all it needs to refuse


@dataclass(frozen=True)
class Outcome:
    answer: str  # "413", "400 context_length_exceeded", "reset", "timeout", ...
    total_s: float  # connect to first byte of the answer
    decision_s: float  # from `decidable_at` to the first byte of the answer
    sent: int  # bytes the server let in before it answered or closed


def _split(data: bytes, size: int = CHUNK) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _head(method: str, path: str, host: str, extra: list[str]) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", f"Host: {host}", *extra, "Connection: close", "", ""]).encode()


def build_attacks(host: str, key: str, model: str) -> dict[str, Attack]:
    auth = f"Authorization: Bearer {key}"
    json_ct = "Content-Type: application/json"
    chat = "/v1/chat/completions"
    out: dict[str, Attack] = {}

    body = b"a" * BIG_BODY  # never parsed: refused on its size
    head = _head("POST", chat, host, [auth, json_ct, f"Content-Length: {len(body)}"])
    out["body-413"] = Attack((head, *_split(body)), 0.0, len(head))

    head = _head("POST", chat, host, [auth, json_ct, "Transfer-Encoding: chunked"])
    frames = [f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in _split(body)] + [b"0\r\n\r\n"]
    past_limit = MAX_BODY // CHUNK + 1  # the frame carrying the byte past the limit
    out["body-chunked"] = Attack((head, *frames), TRICKLE_PAUSE_S, len(head) + sum(len(f) for f in frames[:past_limit]))

    words = "the quick brown fox jumps over the lazy dog and keeps on running far away "
    text = (words * (BIG_PROMPT // len(words) + 1))[:BIG_PROMPT]
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    head = _head("POST", chat, host, [auth, json_ct, f"Content-Length: {len(body)}"])
    out["prompt-1mb"] = Attack((head, *_split(body)), 0.0, len(head) + len(body))

    head = _head("POST", chat, host, [f"Authorization: Bearer {'a' * BIG_HEADER}", json_ct, "Content-Length: 2"]) + b"{}"
    out["header-1mb"] = Attack(tuple(_split(head)), 0.0, MAX_HEAD + 1)

    head = _head("GET", "/health", host, [])
    out["control"] = Attack((head,), 0.0, len(head))
    return out


def _answer(buf: bytes) -> str | None:
    """The status (and OpenAI error code) of a complete response head + body, None while incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head, body = buf[:end].decode("latin-1"), buf[end + 4 :]
    status = head.split(" ", 2)[1]
    length = next((int(v) for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:])
                   if k.strip().lower() == "content-length"), None)
    if length is not None and len(body) < length:
        return None
    if status.startswith("4"):
        try:
            code = orjson.loads(body).get("error", {}).get("code")
        except (orjson.JSONDecodeError, AttributeError):
            code = None
        if code and status == "400":
            return f"{status} {code}"
    return status


def exchange(addr: tuple[str, int], attack: Attack, timeout: float = 10.0) -> Outcome:
    """Send `attack` on a new connection, reading whenever the server speaks; stop at its answer."""
    t0 = time.perf_counter()
    s = socket.create_connection(addr, timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    pieces, i = attack.pieces, 0
    view = memoryview(pieces[0])
    sent = 0
    decidable = first_byte = None
    next_send = t0
    buf = b""
    deadline = t0 + timeout

    def done(answer: str) -> Outcome:
        at = first_byte or time.perf_counter()
        return Outcome(answer, at - t0, at - (decidable or t0), sent)

    try:
        while True:
            now = time.perf_counter()
            if now > deadline:
                return done(_answer(buf) or "timeout")
            writing = i < len(pieces) and now >= next_send
            wait = 0 if writing else (next_send - now if i < len(pieces) else deadline - now)
            readable, writable, _ = select.select([s], [s] if writing else [], [], max(0.0, wait))
            if readable:
                try:
                    data = s.recv(1 << 16)
                except ConnectionResetError:
                    return done(_answer(buf) or "reset")
                first_byte = first_byte or time.perf_counter()
                if not data:
                    return done(_answer(buf) or "closed")
                buf += data
                if (answer := _answer(buf)) is not None:
                    return done(answer)
            if writable:
                before = time.perf_counter()  # a loopback send may run the server before it returns
                try:
                    n = s.send(view)
                except (BrokenPipeError, ConnectionResetError):  # the server closed: see what it said
                    first_byte = first_byte or time.perf_counter()
                    s.setblocking(True)
                    s.settimeout(1.0)
                    try:
                        while (data := s.recv(1 << 16)) and _answer(buf + data) is None:
                            buf += data
                        buf += data
                    except OSError:
                        pass
                    return done(_answer(buf) or "reset")
                sent += n
                if decidable is None and sent >= attack.decidable_at:
                    decidable = before
                view = view[n:]
                if not view:
                    i += 1
                    if i < len(pieces):
                        view = memoryview(pieces[i])
                        next_send = time.perf_counter() + attack.pause_s
    finally:
        s.close()


def attacker(addr: tuple[str, int], key: str, model: str, commands, results, stop) -> None:
    """A process of ATTACKERS threads: for each attack name from `commands`, loop on it until `stop`."""
    attacks = build_attacks(f"{addr[0]}:{addr[1]}", key, model)
    while (command := commands.get()) is not None:
        name, rate = command
        outcomes: list[Outcome] = []
        t0 = time.perf_counter()

        def loop() -> None:
            due = time.perf_counter()
            while not stop.is_set():
                outcomes.append(exchange(addr, attacks[name]))
                if rate:
                    due += 1 / rate
                    stop.wait(max(0.0, due - time.perf_counter()))

        threads = [threading.Thread(target=loop) for _ in range(ATTACKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.put((outcomes, time.perf_counter() - t0))


def _measure(client: httpx.Client, base: str, body: dict, pairs: int) -> tuple[list[float], list[float]]:
    chat, health = [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        r = client.post(f"{base}/v1/chat/completions", json=body)
        chat.append(time.perf_counter() - t0)
        r.raise_for_status()
        t0 = time.perf_counter()
        r = client.get(f"{base}/health")
        health.append(time.perf_counter() - t0)
        r.raise_for_status()
    return chat, health


def _ms(values: list[float]) -> dict[str, float]:
    return {f"p{q}_ms": 1000 * pct(values, q) for q in (50, 90, 99)} | {"n": len(values)}


def _start_stack(urls, settings, kit, logs: Path) -> tuple[list[subprocess.Popen], str, str]:
    import redis as sync_redis

    from services.common.migrate import upgrade

    redis_url = f"{urls.redis_url.rsplit('/', 1)[0]}/{REDIS_DB}"
    sync_redis.Redis.from_url(redis_url).flushdb()
    upgrade(urls.database_url)
    key = _seed_key(urls.database_url)
    env = {**os.environ, **urls.as_env(), "MPLEX_REDIS_URL": redis_url, "MPLEX_HOME": str(settings.home),
           "MPLEX_BASE_MODEL_DIR": str(kit.base_dir), "MPLEX_BASE_MODEL_NAME": kit.model_name, "OMP_NUM_THREADS": "1"}
    procs = []
    engine_port, gw_port = _free_port(), _free_port()
    engine_id = f"isolation-{os.getpid()}"  # a run's own: another run's engine must never be picked
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "services.cli", "engine", "serve", "--model", str(kit.base_dir), "--served-model-name",
         kit.model_name, "--port", str(engine_port), "--engine-id", engine_id, "--kv-memory-mb", "64", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=open(logs / "engine.log", "wb"), stderr=subprocess.STDOUT))
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "serve", "--port", str(gw_port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=open(logs / "gateway.log", "wb"), stderr=subprocess.STDOUT))
    try:
        _wait(f"http://127.0.0.1:{engine_port}/health", procs[0])  # the engine's one open endpoint
        _wait(f"http://127.0.0.1:{gw_port}/ready", procs[1])
        registry = sync_redis.Redis.from_url(redis_url)
        deadline = time.time() + 30
        while not registry.get(f"mplex:engine:{engine_id}"):
            if time.time() > deadline:
                raise RuntimeError("the engine never registered")
            time.sleep(0.2)
    except BaseException:
        stop_procs(procs)
        raise
    return procs, f"http://127.0.0.1:{gw_port}", key


@dataclass
class Phase:
    name: str
    chat: list[float]
    health: list[float]
    wall_s: float
    cpu_s: dict[str, float]  # CPU seconds each process used during the phase


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc); pid 0: the whole machine,
    every process and the kernel's interrupt work (other users of a shared machine included)."""
    if pid == 0:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(name: str, pids: dict[str, int], measure) -> Phase:
    before = {k: _cpu_s(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    chat, health = measure()
    wall = time.perf_counter() - t0
    return Phase(name, chat, health, wall, {k: _cpu_s(p) - before[k] for k, p in pids.items()})


def run_phases(base: str, key: str, model: str, pids: dict[str, int]) -> tuple[list[Phase], dict[str, list]]:
    """Alone, attack, alone, attack, ...: every attack phase sits between two alone phases."""
    host, port = base.removeprefix("http://").split(":")
    ctx = mp.get_context("spawn")
    commands, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=attacker, args=((host, int(port)), key, model, commands, results, stop), daemon=True)
    proc.start()
    pids = {**pids, "attackers": proc.pid, "client": os.getpid(), "machine": 0}
    body = {"model": model, "messages": [{"role": "user", "content": SMALL_PROMPT}], "max_tokens": 1}
    phases: list[Phase] = []
    attack_runs: dict[str, list] = {f"{name} {mode}": [] for mode, _ in MODES for name in ATTACKS}
    try:
        with httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
            def measure():
                return _measure(client, base, body, PAIRS)

            _measure(client, base, body, 20)  # warm-up: connection, key cache, prefix cache
            phases.append(_timed("alone", pids, measure))
            for r in range(ROUNDS):
                for mode, rate in MODES:
                    for name in (ATTACKS if r % 2 == 0 else ATTACKS[::-1]):
                        commands.put((name, rate))
                        time.sleep(ATTACK_WARMUP_S)
                        phases.append(_timed(f"{name} {mode}", pids, measure))
                        stop.set()
                        attack_runs[f"{name} {mode}"].append(results.get(timeout=60))
                        stop.clear()
                        phases.append(_timed("alone", pids, measure))
                print(f"  round {r + 1}/{ROUNDS} done", flush=True)
    finally:
        commands.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return phases, attack_runs


def _cpu_share(phases: list[Phase]) -> dict[str, float]:
    """Each process's CPU use over these phases, in cores (1.0 = one core busy)."""
    wall = sum(p.wall_s for p in phases)
    return {k: sum(p.cpu_s[k] for p in phases) / wall for k in phases[0].cpu_s}


def summarize(phases: list[Phase], attack_runs: dict[str, list]) -> tuple[dict, list[Target]]:
    alone = [p for p in phases if p.name == "alone"]
    alone_chat = [v for p in alone for v in p.chat]
    alone_health = [v for p in alone for v in p.health]
    cpu_alone = _cpu_share(alone)
    figures: dict = {"config": {"rounds": ROUNDS, "pairs_per_phase": PAIRS, "attackers": ATTACKERS,
                                "attack_rate_per_attacker": {mode: rate or "unpaced" for mode, rate in MODES},
                                "max_request_bytes": MAX_BODY, "max_header_bytes": MAX_HEAD,
                                "trickle": f"{CHUNK} B every {TRICKLE_PAUSE_S * 1000:.0f} ms", "cpus": os.cpu_count()},
                     "alone": {"chat": _ms(alone_chat), "health": _ms(alone_health), "cpu_cores": cpu_alone},
                     "attacks": {}}
    lat_rows = [["alone (all)", kind, len(v), *(1000 * pct(v, q) for q in (50, 90, 99)), 1.0, 1.0]
                for kind, v in (("chat", alone_chat), ("health", alone_health))]
    cpu_rows = [["alone (all)", *(cpu_alone[k] for k in cpu_alone)]]
    atk_rows = []
    targets: list[Target] = []
    for phase_name in attack_runs:
        name, mode = phase_name.split(" ")
        at = [i for i, p in enumerate(phases) if p.name == phase_name]
        entry = {}
        for kind in ("chat", "health"):
            under = [v for i in at for v in getattr(phases[i], kind)]
            brackets = [v for i in at for j in (i - 1, i + 1) for v in getattr(phases[j], kind)]
            r50 = pct(under, 50) / pct(brackets, 50)
            r99 = pct(under, 99) / pct(brackets, 99)
            entry[kind] = {**_ms(under), "bracket_p50_ms": 1000 * pct(brackets, 50),
                           "bracket_p99_ms": 1000 * pct(brackets, 99), "ratio_p50": r50, "ratio_p99": r99}
            lat_rows.append([phase_name, kind, len(under), *(1000 * pct(under, q) for q in (50, 90, 99)), r50, r99])
            if name != "control" and mode == "paced":
                targets.append(Target(f"{phase_name}: {kind} p50 / alone p50 (<= {RATIO_GOAL})", r50, RATIO_GOAL,
                                      higher_is_better=False))
        cpu = _cpu_share([phases[i] for i in at])
        entry["cpu_cores"] = cpu
        cpu_rows.append([phase_name, *(cpu[k] for k in cpu)])
        outcomes = [o for run, _ in attack_runs[phase_name] for o in run]
        seconds = sum(s for _, s in attack_runs[phase_name])
        answers = Counter(o.answer for o in outcomes)
        expected = answers[EXPECTED[name]] / len(outcomes) if outcomes else float("nan")
        decision = [o.decision_s for o in outcomes]
        total = [o.total_s for o in outcomes]
        per_s = len(outcomes) / seconds if seconds else float("nan")
        mb_s = sum(o.sent for o in outcomes) / seconds / 1e6 if seconds else float("nan")
        # The gateway's CPU per attack request: its CPU in these phases less what the small requests
        # served in them cost it when alone, over the attack requests answered meanwhile.
        walls = sum(phases[i].wall_s for i in at)
        small_cost = sum(p.cpu_s["gateway"] for p in alone) / len(alone)  # per phase of PAIRS small pairs
        gw_ms = 1000 * (sum(phases[i].cpu_s["gateway"] for i in at) - small_cost * len(at)) / (per_s * walls) \
            if per_s else float("nan")
        entry["attack"] = {"requests": len(outcomes), "per_s": per_s, "sent_mb_per_s": mb_s, "gateway_cpu_ms_per_request": gw_ms,
                           "answers": dict(answers), "expected": EXPECTED[name], "expected_fraction": expected,
                           "decision_ms": _ms(decision), "total_ms": _ms(total)}
        figures["attacks"][phase_name] = entry
        atk_rows.append([phase_name, len(outcomes), per_s, mb_s, gw_ms, ", ".join(f"{a} x{n}" for a, n in answers.most_common()),
                         1000 * pct(decision, 50), 1000 * pct(decision, 99), 1000 * pct(total, 50), 1000 * pct(total, 99)])
        if name != "control":
            targets.append(Target(f"{phase_name}: refusal decision p50 ms (< {DECISION_GOAL_MS:.0f})",
                                  1000 * pct(decision, 50), DECISION_GOAL_MS, higher_is_better=False))
            targets.append(Target(f"{phase_name}: answered {EXPECTED[name]} (fraction)", expected, EXPECTED_GOAL))
    print(table(f"small requests while {ATTACKERS} other clients attack (ms; ratio = attack / bracketing alone phases)",
                ["phase", "request", "n", "p50", "p90", "p99", "p50 ratio", "p99 ratio"], lat_rows))
    print(table("attack requests (ms; decision = from the byte that lets the server refuse to its first answer byte)",
                ["phase", "requests", "req/s", "MB/s sent", "gw cpu ms/req", "answers", "decision p50", "decision p99", "total p50", "total p99"],
                atk_rows))
    print(table(f"CPU use during the phases, in cores ({os.cpu_count()} on this machine; machine = every process on it)",
                ["phase", *cpu_alone], cpu_rows))
    return figures, targets


def main() -> None:
    from services.common.embedded import embedded_services
    from services.common.settings import Settings
    from services.modelkit import ensure_demo

    kit = ensure_demo()
    settings = Settings()
    logs = Path(tempfile.mkdtemp(prefix="isobench-"))
    with embedded_services(settings) as urls:
        procs, base, key = _start_stack(urls, settings, kit, logs)
        try:
            t0 = time.time()
            phases, attack_runs = run_phases(base, key, kit.model_name, {"gateway": procs[1].pid, "engine": procs[0].pid})
            print(f"  measured in {time.time() - t0:.0f}s (logs: {logs})", flush=True)
        finally:
            stop_procs(procs)
    figures, targets = summarize(phases, attack_runs)
    write_results("isolation", figures, targets)


if __name__ == "__main__":
    main()
