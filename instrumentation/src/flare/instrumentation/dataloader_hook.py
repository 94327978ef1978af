"""`dataloader.next`: time every batch fetch of any torch DataLoader (the base iterator's
`__next__`, shared by the single-process and multi-worker iterators)."""

from __future__ import annotations

import threading
import time
from types import MappingProxyType

from flare.instrumentation.operations import Operation
from flare.instrumentation.patching import Patches
from flare.instrumentation.runtime import SLOW_CHILD_NS, Runtime
from flare.wire import semconv

_NO_ATTRIBUTES = MappingProxyType({})  # a fetch in flight has none


class DataLoaderHook:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._patches = Patches()

    def install(self) -> None:
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        original = _BaseDataLoaderIter.__next__
        self._patches.replace(_BaseDataLoaderIter, "__next__", self._wrap(original))

    def uninstall(self) -> None:
        self._patches.restore_all()

    def _wrap(self, original):
        """The wrapper runs once per batch, with caches cold from the step before: the
        usual case (one iterator at a time, on one thread, a fetch that is not a
        child) reuses one Operation for the watchdog, holds the thread's operation
        stack, and touches little else."""
        runtime = self.runtime
        time_ns = time.time_ns
        get_ident = threading.get_ident
        # [the Operation reused while free (start_ns 0), the thread's stack, its ident]
        state = [Operation(semconv.SPAN_DATALOADER, 0, _NO_ATTRIBUTES), None, None]

        def __next__(iterator):
            if not runtime.enabled:
                return original(iterator)
            if not runtime.step_open and not runtime.explicit_steps:
                runtime.begin_step()
            op, stack, owner = state
            if op.start_ns:  # in use: an iterator fetching inside another's fetch
                op = Operation(semconv.SPAN_DATALOADER, 0, _NO_ATTRIBUTES)
            if owner != get_ident():
                stack = state[1] = runtime.operations.thread_stack()
                state[2] = get_ident()
            # Operations.push, inline (the watchdog reads the thread's stack): folded into
            # Operations.push()/pop() costs +8.9 µs per step in situ (hook_cost_in_situ.py,
            # 2026-12-05)
            start = op.start_ns = time_ns()
            op.reported = False
            stack.append(op)
            try:
                return original(iterator)
            finally:
                end = time_ns()
                if stack and stack[-1] is op:
                    stack.pop()
                else:
                    runtime.operations.pop(op)
                op.start_ns = 0
                totals = runtime.totals
                totals.dataloader_ns += end - start
                totals.dataloader_count += 1
                if runtime.step_detail or end - start >= SLOW_CHILD_NS:  # wants_child
                    runtime.emit_child(semconv.SPAN_DATALOADER, start, end, {
                        semconv.DATALOADER_WAIT_MS: round((end - start) / 1e6, 3),
                        semconv.DATALOADER_WORKERS: getattr(iterator, "_num_workers", 0),
                        semconv.DATALOADER_INDEX: totals.dataloader_count - 1,
                    })

        __next__.__wrapped__ = original
        return __next__
