"""Background work yields the CPU to latency-critical work on the same machine.

Linux niceness (and the scheduling policy) is per thread and inherited by the threads that thread starts
afterwards, so a process or run lowers its priority on the thread that will start its workers (torch's
OpenMP team, an event loop's executor), before they exist. Used by the engine core (the step loop is
throughput work: the gateway, the engine's front-ends and Redis answer requests within milliseconds and must
not queue behind a forward for the CPU) and by the batch runner (a batch yields to interactive serving).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def lower_cpu_priority(nice: int, *, batch_policy: bool = False, who: str = "this thread") -> None:
    """Raise this thread's niceness to at least `nice` (0: leave it) and, with `batch_policy`, move it to
    SCHED_BATCH (CPU-bound: it never preempts another thread when it wakes). Threads started afterwards
    inherit both. Where the OS refuses, the thread keeps its priority (logged)."""
    if not nice and not batch_policy:
        return
    tid = threading.get_native_id()
    try:
        if nice and hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
        if batch_policy and hasattr(os, "SCHED_BATCH"):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0 = the calling thread
    except OSError as exc:
        log.warning("%s: could not lower its CPU priority (%s)", who, exc)


AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"
SELF_AUTOGROUP = "/proc/self/autogroup"  # "/autogroup-<id> nice <n>", or empty: no session group of its own


def lower_group_priority(nice: int, *, who: str = "this process") -> bool:
    """Where the kernel shares the CPU between sessions before threads (autogroup, on by default in most
    distributions' kernels), a thread's niceness orders it only against its own session: a nice engine core
    started beside the gateway still got a whole session's share against the gateway's, Redis's and
    Postgres's sessions, and the embedded Redis waited 0.1-0.45 s on the run queue for 1-3 ms of work during
    an overload ramp (stop 41, /proc/<pid>/schedstat). This process leaves its session for one of its own and
    gives that session's group niceness `nice` (raising it needs no privilege). Call it before the process
    starts threads or children; its terminal signals stop reaching it (the engine core ignores SIGINT and dies
    with its parent). Returns whether it did; False where there is no autogroup, or the OS refuses (logged)."""
    if nice <= 0 or not hasattr(os, "setsid") or not autogroup_enabled():
        return False
    try:
        if os.getsid(0) != os.getpid():
            os.setsid()
        with open(SELF_AUTOGROUP, "w") as f:
            f.write(str(nice))
    except OSError as exc:
        log.warning("%s: could not lower its session's CPU priority (%s)", who, exc)
        return False
    return True


def autogroup_enabled() -> bool:
    """Whether the kernel shares the CPU between sessions first for this process: CONFIG_SCHED_AUTOGROUP,
    switched on, and this process in a session group of its own. Where it still sits in the kernel's default
    group (CI's container: its processes never left the boot session), the sysctl reads 1 but
    /proc/self/autogroup is empty: its threads' niceness already orders it against the others, and there is no
    group to nice."""
    try:
        with open(AUTOGROUP) as f:
            if f.read().strip() != "1":
                return False
        with open(SELF_AUTOGROUP) as f:
            return f.read().startswith("/autogroup-")
    except OSError:
        return False
