"""`gc.collect`: every garbage collection, through `gc.callbacks`.

A collection runs inside whatever allocated: often C code (torch's, pickle's) that the
main thread entered before a Ctrl-C came. The callback is then the first Python code
to run, so the interpreter raises the KeyboardInterrupt in it — and a gc callback's
exception is reported as "unraisable" and dropped: the job goes on as if no Ctrl-C
had come (seen: 35 of 40 Ctrl-Cs lost by a loop of `pickle.loads` with a callback,
none without). So the hook also watches `sys.unraisablehook`: a KeyboardInterrupt
that escaped the callback has a short-lived thread interrupt the main thread again once
the main thread has left the hook (raised from the main thread itself, or while it is
still in the hook, the interrupt would land in the hook and be dropped again), to land
in the job's own code; anything else goes to the previous hook.
"""

from __future__ import annotations

import _thread
import gc
import sys
import time

from flare.instrumentation.runtime import Runtime
from flare.wire import semconv

# How long the main thread may stay in the hook before the Ctrl-C is raised anyway.
_LEAVE_HOOK_S = 1.0


class GcHook:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._start_ns = 0
        self._previous_unraisablehook = None

    def install(self) -> None:
        gc.callbacks.append(self._callback)
        self._previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_unraisablehook or sys.__unraisablehook__
        self._previous_unraisablehook = None

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and unraisable.object == self._callback:
            try:
                # a bare thread: threading's start() waits for the thread to run, a wait the
                # interrupt could land in
                _thread.start_new_thread(_interrupt_main_outside, (_thread.get_ident(),))
                return
            except RuntimeError:  # no new threads (the interpreter is exiting)
                pass
        (self._previous_unraisablehook or sys.__unraisablehook__)(unraisable)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start_ns = time.time_ns()
            return
        runtime = self.runtime
        if not runtime.enabled or not self._start_ns:
            return
        end = time.time_ns()
        start, self._start_ns = self._start_ns, 0
        totals = runtime.totals
        totals.gc_ns += end - start
        totals.gc_count += 1
        if runtime.wants_child(start, end):
            runtime.emit_child(semconv.SPAN_GC, start, end, {
                semconv.GC_GENERATION: info.get("generation", -1),
                semconv.GC_COLLECTED: info.get("collected", 0),
                semconv.GC_UNCOLLECTABLE: info.get("uncollectable", 0),
            })


def _interrupt_main_outside(main_ident: int, hook=GcHook._unraisable.__code__) -> None:
    """Raise the Ctrl-C again once the main thread has left the hook: raised in the hook
    it would be dropped too. On a loaded host the main thread can stay there for
    milliseconds (seen in CI: a fixed 1-ms wait lost 1 Ctrl-C of 10)."""
    deadline = time.monotonic() + _LEAVE_HOOK_S
    while time.monotonic() < deadline and _runs(main_ident, hook):
        time.sleep(0.0005)
    _thread.interrupt_main()


def _runs(ident: int, code) -> bool:
    frame = sys._current_frames().get(ident)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
