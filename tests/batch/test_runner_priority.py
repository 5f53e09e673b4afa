"""A batch run is background work for the OS: its thread, and the threads it starts (the event loop's
workers), run at `batch_cpu_nice`; the worker thread that started the run keeps its priority."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.batch.runner import _lower_cpu_priority


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is a Linux feature")
def test_the_run_and_its_threads_are_niced_and_the_worker_thread_is_not():
    before = _nice()

    def run() -> tuple[int, int]:
        _lower_cpu_priority(before + 7)
        with ThreadPoolExecutor(1) as inner:  # as asyncio.to_thread's workers, started by the run's thread
            return _nice(), inner.submit(_nice).result()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(run).result() == (before + 7, before + 7)
    assert _nice() == before
