"""The training thread's clock: CPU and run-queue wait from schedstat, or CPU alone."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import pytest

from flare.instrumentation import thread_clock
from flare.instrumentation.thread_clock import ProcessClock


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


def _burn(name: str, seconds: float, started: threading.Event | None = None,
          go: threading.Event | None = None, hold: threading.Event | None = None) -> None:
    """Spin for `seconds` of CPU in a thread the OS knows as `name` (prctl PR_SET_NAME,
    as gloo names its I/O loop)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode(), 0, 0, 0)
    if started is not None:
        started.set()
    if go is not None:
        go.wait(10)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    if hold is not None:
        hold.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread clocks of other threads are Linux's")
def test_the_process_clock_leaves_out_the_collective_librarys_threads():
    clock = ProcessClock()
    started, go, hold = threading.Event(), threading.Event(), threading.Event()
    comm = threading.Thread(target=_burn, args=("gloo_tcp_loop", 0.2, started, go, hold))
    comm.start()
    started.wait(10)
    clock._next_scan_ns = 0  # found at the next read, as at a step after a group's start
    before = clock.read()
    go.set()
    while time.clock_gettime_ns(thread_clock._thread_cpu_clock(comm.native_id)) < 200e6:
        time.sleep(0.01)
    after_comm = clock.read()
    hold.set()
    comm.join()
    assert after_comm - before < 50e6, (after_comm - before) / 1e6  # its 200 ms left out
    user = threading.Thread(target=_burn, args=("data-prep", 0.2))
    user.start()
    user.join()
    after_user = clock.read()
    assert after_user - after_comm >= 180e6, (after_user - after_comm) / 1e6  # the rank's own
    # the ended comm thread's time stays left out: no step jumps when it is gone
    assert clock.read() - after_user < 20e6


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread clocks of other threads are Linux's")
def test_a_comm_thread_found_late_counts_from_when_it_is_found():
    """What it burnt before it was found stays the rank's: finding it moves no step."""
    clock = ProcessClock()
    before = clock.read()
    hold = threading.Event()
    comm = threading.Thread(target=_burn, args=("gloo_tcp_loop", 0.1), kwargs={"hold": hold})
    comm.start()
    while time.clock_gettime_ns(thread_clock._thread_cpu_clock(comm.native_id)) < 100e6:
        time.sleep(0.01)
    clock._next_scan_ns = 0
    found = clock.read()
    assert found - before >= 90e6, (found - before) / 1e6
    hold.set()
    comm.join()
