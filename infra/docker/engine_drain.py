"""preStop hook of an engine pod: stop taking new work, then wait until in-flight sequences finish.

Kubernetes runs this before it sends SIGTERM, and the pod's terminationGracePeriodSeconds bounds both.
1. POST /drain asks the engine to stop admitting requests (it deregisters from the router and reports
   not-ready; the gateway retries a refused request on another engine). An engine without that endpoint
   answers 404/405, and draining then relies on the registry entry expiring.
2. Poll /metrics until mplex_engine_requests_running + mplex_engine_requests_waiting has read 0 on two
   consecutive polls (a request may be between the router's pick and its arrival), or until the deadline.
Both endpoints require the engine credential (services.common.internal_auth); the hook loads it with the
engine's own settings code, which the engine image has installed. Everything else is standard library.
"""
from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

IN_FLIGHT_METRICS = ("mplex_engine_requests_running", "mplex_engine_requests_waiting")


@dataclass(frozen=True)
class DrainResult:
    drain_acknowledged: bool  # the engine accepted POST /drain
    idle: bool  # in-flight reached 0 (stably) before the deadline
    last_in_flight: int | None  # last value read; None if /metrics never answered
    polls: int


def in_flight(metrics_text: str) -> int | None:
    """Sum of the running and waiting gauges over all label sets; None if neither series is exposed."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0 or line[:name_end] not in IN_FLIGHT_METRICS:
            continue
        value = line[line.rindex("}") + 1 :] if "{" in line[: name_end + 1] else line[name_end:]
        total += float(value.split()[0])
        seen = True
    return int(total) if seen else None


def engine_headers() -> dict[str, str]:
    """The engine credential, loaded as the engine loads it (same image, same environment)."""
    try:
        from services.common.internal_auth import client_headers
        from services.common.settings import get_settings

        return client_headers(get_settings())
    except Exception as exc:  # never fail the hook: without it /drain and /metrics answer 401, and SIGTERM follows
        print(f"engine drain: no engine credential ({exc!r})", file=sys.stderr)
        return {}


def request_drain(base_url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> bool:
    request = urllib.request.Request(f"{base_url}/drain", data=b"", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - local engine
            return 200 <= response.status < 300
    except urllib.error.HTTPError:
        return False  # 404/405: no drain endpoint; still wait for in-flight work below
    except (urllib.error.URLError, OSError):
        return False


def read_in_flight(base_url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> int | None:
    request = urllib.request.Request(f"{base_url}/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return in_flight(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def drain(
    base_url: str,
    timeout_s: float,
    poll_interval_s: float = 1.0,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    headers: dict[str, str] | None = None,
) -> DrainResult:
    deadline = clock() + timeout_s
    acknowledged = request_drain(base_url, headers=headers)
    zero_reads, polls, last = 0, 0, None
    while True:
        last = read_in_flight(base_url, headers=headers)
        polls += 1
        zero_reads = zero_reads + 1 if last == 0 else 0
        if zero_reads >= 2:
            return DrainResult(acknowledged, True, last, polls)
        if clock() >= deadline:
            return DrainResult(acknowledged, False, last, polls)
        sleep(poll_interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--timeout", type=float, default=570.0, help="seconds to wait for in-flight work")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    result = drain(f"http://127.0.0.1:{args.port}", args.timeout, args.poll_interval, headers=engine_headers())
    print(
        f"engine drain: acknowledged={result.drain_acknowledged} idle={result.idle} "
        f"in_flight={result.last_in_flight} polls={result.polls}",
        file=sys.stderr,
    )
    return 0  # never fail the hook: SIGTERM follows either way, and a failed hook only adds an event


if __name__ == "__main__":
    sys.exit(main())
