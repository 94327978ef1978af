"""`gc.collect`: every garbage collection, through `gc.callbacks`."""

from __future__ import annotations

import gc
import time

from flare.instrumentation import semconv
from flare.instrumentation.runtime import Runtime


class GcHook:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._start_ns = 0

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

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
