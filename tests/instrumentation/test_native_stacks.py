"""Native frames through py-spy: a real dump of this process, read back per thread."""

from __future__ import annotations

import threading
import time

import pytest

from flare.instrumentation import native_stacks
from flare.wire import pyspy_dump


@pytest.mark.skipif(native_stacks.binary() is None, reason="py-spy is not installed (pip install py-spy)")
def test_a_blocked_threads_native_frames_reach_below_python():
    stop = threading.Event()
    blocked = threading.Thread(target=stop.wait, name="blocked-in-c", daemon=True)
    blocked.start()
    time.sleep(0.2)
    try:
        dump = native_stacks.dump_native()
    finally:
        stop.set()
    assert dump is not None, "py-spy is installed but could not dump this process"
    frames = pyspy_dump.thread_frames(dump, "blocked-in-c")
    # innermost first: the C wait under Python's Event.wait, then the Python frames
    assert any("threading.py" in f and "wait" in f for f in frames), frames
    assert any("libc" in f or ".c:" in f for f in frames[:6]), frames


def test_turned_off_or_missing_py_spy_is_not_tried(monkeypatch):
    monkeypatch.setenv(native_stacks.ENV_PY_SPY, "0")
    assert native_stacks.dump_native() is None
    monkeypatch.setenv(native_stacks.ENV_PY_SPY, "/nonexistent/py-spy")
    assert native_stacks.dump_native() is None


def test_frames_of_a_named_thread_from_a_dump():
    dump = ('Process 1: python train.py\nPython v3.11\n\nThread 10 (idle): "MainThread"\n'
            '    clock_nanosleep (libc.so.6)\n    wait (train.py:5)\n\n'
            'Thread 11 (active): "worker"\n    run (w.py:1)\n')
    assert pyspy_dump.thread_frames(dump, "MainThread") == ["clock_nanosleep (libc.so.6)", "wait (train.py:5)"]
    assert pyspy_dump.thread_frames(dump, "worker") == ["run (w.py:1)"]
    assert pyspy_dump.thread_frames(None, "x") == []
