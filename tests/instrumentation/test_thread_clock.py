"""The training thread's clock: CPU and run-queue wait from schedstat, or CPU alone."""

from __future__ import annotations

import os
import threading
import time

import pytest

from flare.instrumentation import thread_clock


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat here")
def test_the_clock_reads_cpu_and_run_queue_wait_of_the_calling_thread():
    clock = thread_clock.ThreadClock()
    cpu0, wait0 = clock.read()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:
        pass
    cpu1, wait1 = clock.read()
    assert wait0 is not None and wait1 is not None and wait1 >= wait0
    assert 40e6 <= cpu1 - cpu0 <= 1e9
    seen = []
    worker = threading.Thread(target=lambda: seen.append(clock.read()))
    worker.start()
    worker.join()
    assert seen[0][0] < cpu1  # another thread reads its own clock, not this one's
    clock.close()


def test_a_host_that_hides_schedstat_gives_cpu_and_no_wait(monkeypatch):
    monkeypatch.setattr(thread_clock, "_PATH", "/proc/thread-self/no-such-schedstat")
    clock = thread_clock.ThreadClock()
    first = clock.read()
    second = clock.read()
    assert first[1] is None and second[1] is None
    assert second[0] >= first[0] > 0
