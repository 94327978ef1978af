"""The finisher thread: it builds the step spans the training thread deferred and hands
them to the batch processors, in a batch every few seconds, and runs the work listeners
hand off the training thread (`run_later`).

An ordinary step whose span goes to an asynchronous (batch) processor anyway costs the
training thread only the capture of its numbers (`Runtime.step_boundary`); the span
itself is built here, by `emit` (`Runtime._emit_deferred`: `step_spans.emit_deferred`).
The queue is bounded: were the finisher stuck (an export that never returns), the
oldest records go first, counted in `dropped`, as the batch processor's queue drops.
The finisher also makes the next steps' `StepTotals` ahead (about as many as it last
drained), so the training thread takes one instead of running a dataclass `__init__`
cold at every step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from flare.instrumentation.finished_span import FinishedSpans, PendingStepSpan
from flare.instrumentation.step_records import StepRecord, StepTotals

_log = logging.getLogger(__name__)

# How often the finisher thread builds deferred step spans and hands them to the batch
# processors, which it then flushes: the batch processor's own delay, and not less than
# this (each wake-up runs cold: ~250 µs in situ before the first span, ~45 µs for each
# next one, then the export request). Flushing right after, the step spans leave within
# one period: with `flare run`'s batch delay (the SDK's 5 s), within 5 s.
FINISH_MIN_PERIOD_S = 2.0
DEFERRED_MAX = 4096  # step records waiting for the finisher (~2 min of 30 ms steps)
DEFERRED_WAKE = 512  # that many wake it before its period is over (a batch processor's batch)
SPARE_TOTALS_MAX = 1024  # ready-made StepTotals kept for the next steps (~250 B each)

Emit = Callable[[StepRecord, "PendingStepSpan | None", list], None]


class StepFinisher:
    """The deferred step records, the work handed off the training thread, and the
    thread that drains both. `deferred` and `spare_totals` are read by the step
    boundary directly (its one straight pass); everything else goes through methods."""

    def __init__(self, finished: FinishedSpans | None, emit: Emit) -> None:
        self.finished = finished
        self.emit = emit  # builds and hands over one deferred step's span
        self.deferred: deque = deque(maxlen=DEFERRED_MAX)  # (record, stand-in, children)
        self.wake_at = DEFERRED_WAKE  # that many waiting wake the thread (full())
        self.spare_totals: list = []  # only ever popped and appended
        self.dropped = 0
        self._dropped_reported = False
        self.later: deque = deque()
        self._drain_lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()  # run_later() and stop() set it
        self._stopping = False
        self._failed = False

    # ------------------------------------------------------------ the training thread's
    def queue(self, record: StepRecord, pending: PendingStepSpan | None, children: list) -> None:
        if len(self.deferred) >= self.wake_at:
            self.full()
        self.deferred.append((record, pending, children))
        if self.thread is None:
            self.start()

    def full(self) -> None:
        """Many steps wait: wake the finisher now; if the queue is full (its export is
        stuck), the append that follows drops the oldest record."""
        if len(self.deferred) >= self.deferred.maxlen:
            self.dropped += 1
        self.wake.set()

    def run_later(self, work: Callable[[], object]) -> None:
        """Run `work()` off the training thread: on the finisher thread, woken for it
        now, or at the next flush, whichever comes first."""
        self.later.append(work)
        if self.thread is None:
            self.start()
        self.wake.set()

    # ------------------------------------------------------------ the thread
    def start(self) -> None:
        self._stopping = False
        self.wake.clear()
        self.thread = threading.Thread(target=self._loop, name="flare-step-finisher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Drain, then stop the finisher thread (uninstrument, exit)."""
        thread, self.thread = self.thread, None
        self._stopping = True
        self.wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        self.drain()

    def _loop(self) -> None:
        finished = self.finished
        delay = finished.batch_delay_s() if finished is not None else None
        period = max(FINISH_MIN_PERIOD_S, delay or 0.0)
        wake = self.wake
        try:
            while True:
                wake.wait(period)
                wake.clear()
                if self._stopping:
                    return
                if finished is None:
                    self.drain()
                elif not self.drain():
                    # No steps this period (a stall, a hang, the end): the processors'
                    # workers export on their own schedule again (heartbeats must leave).
                    finished.release_batch_schedules()
                else:
                    try:
                        finished.flush_batches(period)
                    except Exception as error:  # the batch processor's own worker exports them
                        self._warn_once("flare: flushing the step spans failed: %r", error)
                        finished.release_batch_schedules()
        finally:
            if finished is not None:  # the batch processors' workers export on their own again
                finished.release_batch_schedules()

    def drain(self, spans_only: bool = False) -> bool:
        """Build and hand over every deferred step span now (before any flush), then
        run the work handed to run_later unless `spans_only`; True if there was any."""
        if not self.deferred and (spans_only or not self.later):
            return False
        with self._drain_lock:
            if self.dropped and not self._dropped_reported:
                self._dropped_reported = True
                _log.warning("flare: %d step spans were dropped while the span export was "
                             "stuck (the oldest go first)", self.dropped)
            drained = 0
            deferred, emit = self.deferred, self.emit
            while deferred:
                record, pending, children = deferred.popleft()
                drained += 1
                try:
                    emit(record, pending, children)
                except Exception as error:  # never lose the others over one
                    self._warn_once("flare: a step span could not be built: %r", error)
            spare = self.spare_totals
            for _ in range(min(drained, SPARE_TOTALS_MAX) - len(spare)):
                spare.append(StepTotals())
            while self.later and not spans_only:
                work = self.later.popleft()
                try:
                    work()
                except Exception as error:
                    self._warn_once("flare: background work failed: %r", error)
        return True

    def _warn_once(self, message: str, error: BaseException) -> None:
        if not self._failed:
            self._failed = True
            _log.warning(message, error)
