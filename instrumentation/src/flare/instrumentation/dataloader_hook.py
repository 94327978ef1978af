"""`dataloader.next`: time every batch fetch of any torch DataLoader (the base iterator's
`__next__`, shared by the single-process and multi-worker iterators)."""

from __future__ import annotations

import time

from flare.instrumentation import semconv
from flare.instrumentation.patching import Patches
from flare.instrumentation.runtime import Runtime


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
        runtime = self.runtime

        def __next__(iterator):
            if not runtime.enabled:
                return original(iterator)
            if not runtime.step_open and not runtime.explicit_steps:
                runtime.begin_step()
            start = time.time_ns()
            op = runtime.push_op(semconv.SPAN_DATALOADER, start, {})
            try:
                return original(iterator)
            finally:
                end = time.time_ns()
                runtime.pop_op(op)
                totals = runtime.totals
                totals.dataloader_ns += end - start
                totals.dataloader_count += 1
                if runtime.wants_child(start, end):
                    runtime.emit_child(semconv.SPAN_DATALOADER, start, end, {
                        semconv.DATALOADER_WAIT_MS: round((end - start) / 1e6, 3),
                        semconv.DATALOADER_WORKERS: getattr(iterator, "_num_workers", 0),
                        semconv.DATALOADER_INDEX: totals.dataloader_count - 1,
                    })

        __next__.__wrapped__ = original
        return __next__
