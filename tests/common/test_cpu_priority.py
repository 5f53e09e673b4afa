"""Background work is background for the OS: a batch run's thread and the threads it starts run at
`batch_cpu_nice` (the worker thread that started the run keeps its priority), and the engine core runs
niced at SCHED_BATCH in a niced session group of its own (services/common/cpu_priority.py; the core's own process:
tests/engine/test_split.py)."""
from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.common import cpu_priority
from services.common.cpu_priority import autogroup_enabled, lower_cpu_priority, lower_group_priority


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _policy() -> int:
    return os.sched_getscheduler(0)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is a Linux feature")
def test_the_run_and_its_threads_are_niced_and_the_worker_thread_is_not():
    before = _nice()

    def run() -> tuple[int, int]:
        lower_cpu_priority(before + 7)
        with ThreadPoolExecutor(1) as inner:  # as asyncio.to_thread's workers, started by the run's thread
            return _nice(), inner.submit(_nice).result()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(run).result() == (before + 7, before + 7)
    assert _nice() == before


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is a Linux feature")
def test_the_batch_policy_is_per_thread_and_inherited_and_niceness_never_drops():
    before, policy = _nice(), _policy()

    def run() -> tuple:
        lower_cpu_priority(before + 3, batch_policy=True)
        lower_cpu_priority(before + 1)  # a lower niceness asked later does not raise the priority back
        with ThreadPoolExecutor(1) as inner:
            return (_nice(), _policy()), inner.submit(lambda: (_nice(), _policy())).result()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(run).result() == ((before + 3, os.SCHED_BATCH),) * 2
    assert (_nice(), _policy()) == (before, policy)


def autogroup_nice(pid: int) -> int:
    """The niceness of the process's session group ("/autogroup-42 nice 5")."""
    with open(f"/proc/{pid}/autogroup") as f:
        return int(f.read().split()[-1])


def _leave_session(queue) -> None:
    done = lower_group_priority(6, who="test")
    queue.put((done, os.getsid(0) == os.getpid(), autogroup_nice(os.getpid())))


@pytest.mark.skipif(not autogroup_enabled(), reason="the kernel does not group the CPU by session here")
def test_a_process_gets_a_niced_session_group_of_its_own_and_its_parent_keeps_its_own():
    """With autogroup the CPU is shared between sessions before threads, so a niced process in the gateway's or
    launcher's session would still weigh a whole session against Redis's: it takes a session of its own and nices
    that (the engine core: tests/engine/test_split.py)."""
    ours = autogroup_nice(os.getpid())
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_leave_session, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == (True, True, 6)
    finally:
        child.join(30)
    assert autogroup_nice(os.getpid()) == ours and os.getsid(0) != child.pid
    assert lower_group_priority(0) is False  # nothing asked, nothing done


@pytest.mark.parametrize("sysctl, own_group, grouped", [
    ("1\n", "/autogroup-85 nice 0\n", True),
    ("1\n", "", False),  # CI's container: every process in the kernel's default group, the file empty
    ("0\n", "/autogroup-85 nice 0\n", False),
    (None, "/autogroup-85 nice 0\n", False),  # a kernel without CONFIG_SCHED_AUTOGROUP
])
def test_a_session_group_is_niced_only_where_the_process_has_one(tmp_path, monkeypatch, sysctl, own_group, grouped):
    """Where the sysctl is on but this process sits in the kernel's default group (its autogroup file reads empty),
    there is no group of its own to weigh against others: nothing is done (before, the core left its session and
    the tests failed reading the empty file)."""
    if sysctl is not None:
        (tmp_path / "sysctl").write_text(sysctl)
    (tmp_path / "autogroup").write_text(own_group)
    monkeypatch.setattr(cpu_priority, "AUTOGROUP", str(tmp_path / "sysctl"))
    monkeypatch.setattr(cpu_priority, "SELF_AUTOGROUP", str(tmp_path / "autogroup"))
    assert autogroup_enabled() is grouped
    if not grouped:
        sid = os.getsid(0)
        assert lower_group_priority(5) is False and os.getsid(0) == sid  # nothing touched
