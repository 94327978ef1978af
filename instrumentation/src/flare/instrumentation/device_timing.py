"""Device-side timing of collectives on CUDA: a pair of pooled CUDA events recorded on
the caller's current stream around the call, and a background thread that polls them
(`Event.query()`, never a synchronise) and reports the elapsed device time.

For a blocking NCCL call the end event follows the caller stream's wait on the NCCL
stream, so start→end is the time the stream spent in the collective, waiting for peers
included. Results arrive asynchronously: the record's attributes dict (a detail-step
child not yet emitted) and the per-group totals of the step in progress are updated.
On CPU tensors none of this runs: the wall clock of the call is the measure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

_log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.0005
POOL_LIMIT = 1024  # events kept for reuse; beyond it, new pairs are simply not timed


class CudaEventTimer:
    def __init__(self, event_factory=None):
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True)

        self._new_event = event_factory
        self._free: list = []
        self._created = 0
        self._pending: deque = deque()
        self._wakeup = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def _take(self):
        if self._free:
            return self._free.pop()
        if self._created >= POOL_LIMIT:
            return None
        self._created += 1
        return self._new_event()

    def begin(self):
        """Record a start event on the current stream; returns a token (or None)."""
        event = self._take()
        if event is not None:
            event.record()
        return event

    def end(self, start_event, on_done) -> None:
        """Record the end event; `on_done(device_ms)` runs on the poller thread."""
        if start_event is None:
            return
        end_event = self._take()
        if end_event is None:
            self._free.append(start_event)
            return
        end_event.record()
        self._pending.append((start_event, end_event, on_done))
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="flare-cuda-events",
                                            daemon=True)
            self._thread.start()
        self._wakeup.set()

    def _poll(self) -> None:
        while not self._stop:
            if not self._pending:
                self._wakeup.wait(0.1)
                self._wakeup.clear()
                continue
            start_event, end_event, on_done = self._pending[0]
            try:
                ready = end_event.query()
            except Exception as error:  # a dead context: stop timing, never raise
                _log.warning("flare: CUDA event query failed (%r); device timing off", error)
                self._pending.clear()
                self._stop = True
                return
            if not ready:
                time.sleep(POLL_INTERVAL_S)
                continue
            self._pending.popleft()
            try:
                on_done(float(start_event.elapsed_time(end_event)))
            except Exception as error:
                _log.debug("flare: device timing callback failed: %r", error)
            self._free.extend((start_event, end_event))

    def stop(self) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
            self._thread = None
