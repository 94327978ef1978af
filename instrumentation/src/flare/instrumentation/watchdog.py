"""The watchdog thread of a rank: hang reports, heartbeats and the detail flag file.

It only reads the runtime's state and emits spans, so it keeps working while the main
thread is blocked inside C++ (a gloo/NCCL wait releases the GIL).

Hang: when the step in progress, or an operation a thread is blocked in (collective,
batch fetch, backward, hot call), has run longer than the limit, emit one `flare.hang`
span per stuck operation, with every thread's Python stack, and force-flush the provider
so the report leaves the process even if it never recovers. The limit is
FLARE_HANG_TIMEOUT_S, else max(60 s, 10 x the median recent step).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from opentelemetry.trace import Status, StatusCode

from flare.instrumentation import identity, launcher, loader_workers, native_stacks
from flare.instrumentation.callsite import all_thread_stacks, format_site, frame_site
from flare.instrumentation.config import HANG_STEP_MULTIPLE, HANG_TIMEOUT_FLOOR_S
from flare.instrumentation.operations import Operation
from flare.instrumentation.runtime import Runtime
from flare.instrumentation.step_hooks import OP_BACKWARD
from flare.wire import semconv

_log = logging.getLogger(__name__)
# Hang checks, heartbeats and the flag-file poll: each tick runs cold (the watchdog
# thread took 16-25 µs of CPU per rank-step on the 80 ms benchmark job ticking every
# 2 s), and hang limits are a minute or more by default (a shorter configured limit is
# checked twice per limit).
TICK_S = 5.0
FLAG_POLL_S = 5.0
FLUSH_TIMEOUT_MS = 5000
# A job of one process looks among its children for ranks this long (`_started_ranks`).
LAUNCHER_SCAN_S = 120.0


class Watchdog:
    def __init__(self, runtime: Runtime, flush, collectives=None):
        self.runtime = runtime
        self.flush = flush  # callable(timeout_millis) -> None
        self.collectives = collectives
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported_steps: set[int] = set()
        self._last_heartbeat = 0.0
        self._last_flag_poll = 0.0
        self.hang_reports = 0
        # Before any step has ended: what the open step has done so far (batches,
        # backward time, collections) and when that last moved (`_first_step_progress`)
        self._progress: tuple | None = None
        self._progress_ns = 0
        self._no_steps_said = False
        # A job of one process (no RANK, started by `flare run`) may be a launcher Flare
        # does not know: until when its children are looked at for ranks.
        self._launcher_until = (time.monotonic() + LAUNCHER_SCAN_S
                                if identity.single_process_job() else None)
        self.on_launcher = None  # called once it has found itself a launcher (its agent stops)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flare-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._thread = None

    def hang_timeout_s(self) -> float:
        configured = self.runtime.config.hang_timeout_s
        if configured is not None:
            return configured
        median = self.runtime.median_step_s() or 0.0
        return max(HANG_TIMEOUT_FLOOR_S, HANG_STEP_MULTIPLE * median)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        # A short configured hang timeout is checked at least twice per timeout, and a
        # heartbeat shorter than the tick sets the pace.
        config = self.runtime.config
        tick_s = TICK_S
        if config.hang_timeout_s is not None:
            tick_s = min(tick_s, max(0.1, config.hang_timeout_s / 2))
        if config.heartbeat_s:
            tick_s = min(tick_s, max(0.1, config.heartbeat_s))
        while not self._stop.wait(tick_s):
            if not self.runtime.enabled:
                continue
            try:
                self.tick(time.monotonic(), time.time_ns())
            except Exception as error:  # the watchdog must outlive its own bugs
                _log.warning("flare: watchdog tick failed: %r", error)

    def tick(self, monotonic_s: float, now_ns: int) -> None:
        if self._launcher_until is not None and self._started_ranks(monotonic_s):
            return
        config = self.runtime.config
        if config.detail_flag_file and monotonic_s - self._last_flag_poll >= FLAG_POLL_S:
            self._last_flag_poll = monotonic_s
            self.runtime.detail_flag_present = os.path.exists(config.detail_flag_file)
        if config.heartbeat_s and monotonic_s - self._last_heartbeat >= config.heartbeat_s:
            self._last_heartbeat = monotonic_s
            self.emit_heartbeat(now_ns)
        self.check_hangs(now_ns)

    def _started_ranks(self, monotonic_s: float) -> bool:
        """A job of one process whose children are ranks (RANK in their environment) is
        a launcher Flare does not know, not rank 0 of a world of 1: said once, and from
        then on it sends nothing (its ranks are instrumented). Looked at until its first
        step ends or LAUNCHER_SCAN_S have passed."""
        if monotonic_s > self._launcher_until or self.runtime.recent_step_s:
            self._launcher_until = None
            return False
        found = launcher.rank_child()
        if found is None:
            return False
        self._launcher_until = None
        self.runtime.enabled = False
        if self.on_launcher is not None:
            self.on_launcher()
        _log.warning("flare: this process (pid %d, %s) started rank %s (pid %d): it is a launcher "
                     "Flare does not know, not a job of one process; it sends nothing more, its "
                     "ranks are instrumented", os.getpid(), " ".join(sys.argv[:2]) or "python",
                     found[1], found[0])
        return True

    # ------------------------------------------------------------------ heartbeat
    def emit_heartbeat(self, now_ns: int) -> None:
        runtime = self.runtime
        attributes = {
            semconv.HEARTBEAT_LAST_STEP: runtime.step_number - 1,
            semconv.HEARTBEAT_INTERVAL_S: float(runtime.config.heartbeat_s),
            semconv.STEP: runtime.step_number,
        }
        if runtime.step_open:
            attributes[semconv.HEARTBEAT_STEP_OPEN_S] = round(
                (now_ns - runtime.step_start_ns) / 1e9, 3)
            if self._no_steps_said and not runtime.recent_step_s:
                # said once in the rank's log; every heartbeat tells the diagnosis
                attributes[semconv.HEARTBEAT_NO_STEP_S] = attributes[semconv.HEARTBEAT_STEP_OPEN_S]
                attributes[semconv.HEARTBEAT_NO_STEP_BATCHES] = runtime.totals.dataloader_count
        attributes.update(runtime.span_attributes)
        span = runtime.tracer.start_span(semconv.SPAN_HEARTBEAT, start_time=now_ns,
                                         attributes=attributes)
        span.end(end_time=now_ns)

    # ------------------------------------------------------------------ hangs
    def check_hangs(self, now_ns: int) -> None:
        runtime = self.runtime
        if not runtime.recent_step_s:
            self._first_step_progress(now_ns)
        in_flight = runtime.operations.in_flight()
        # Nearly every tick nothing is anywhere near the limit, which is at least the
        # configured timeout or the floor: return before the median of recent steps
        # (a sort, every second, on a cold thread) is taken.
        configured = runtime.config.hang_timeout_s
        lower_ns = int((configured if configured is not None else HANG_TIMEOUT_FLOOR_S) * 1e9)
        oldest = runtime.step_start_ns if runtime.step_open else now_ns
        for _, op in in_flight:
            oldest = min(oldest, op.start_ns)
        if now_ns - oldest <= lower_ns:
            return
        limit_ns = int(self.hang_timeout_s() * 1e9)
        stuck = [(ident, op) for ident, op in in_flight
                 if not op.reported and now_ns - op.start_ns > limit_ns]
        step_stuck = (runtime.step_open and runtime.step_number not in self._reported_steps
                      and now_ns - runtime.step_start_ns > limit_ns)
        if not stuck and not step_stuck:
            return
        if not stuck and self._training_without_steps(now_ns, limit_ns):
            return
        if not stuck and in_flight:
            # The step is past the limit and an operation it is blocked in started a
            # little later (a backward after its forward), so it is not yet past the
            # limit itself: report the operation, which says where the rank waits
            # (inside the backward: a DDP collective from the flight recorder). The step
            # itself would read as stuck in the rank's own code.
            # Only the training (main) thread's: another thread's operation is not
            # where the step waits.
            main = threading.main_thread().ident
            stuck = [(ident, op) for ident, op in in_flight
                     if ident == main and not op.reported][:1]
        stacks = all_thread_stacks(skip_ident=threading.get_ident())
        native = native_stacks.dump_native()  # C/C++ frames too, where py-spy may run
        if stuck:
            for ident, op in stuck:
                op.reported = True
                self._emit_hang(now_ns, limit_ns, op, ident, stacks, native)
        else:
            self._emit_hang(now_ns, limit_ns, None, threading.main_thread().ident, stacks, native)
        if runtime.step_open:
            self._reported_steps.add(runtime.step_number)
        runtime.request_detail()
        self.flush(FLUSH_TIMEOUT_MS)

    def _first_step_progress(self, now_ns: int) -> None:
        runtime = self.runtime
        if not runtime.step_open:
            self._progress = None
            return
        totals = runtime.totals
        progress = (runtime.step_number, totals.dataloader_count, totals.backward_ns, totals.gc_count,
                    totals.pycall_count)
        if self._progress is None or progress[0] != self._progress[0]:
            # first seen: still since the step began, until it is seen to move
            self._progress, self._progress_ns = progress, runtime.step_start_ns
        elif progress != self._progress:
            self._progress, self._progress_ns = progress, now_ns

    def _training_without_steps(self, now_ns: int, limit_ns: int) -> bool:
        """A first step past the hang limit that is still loading batches and running
        backward passes is a loop whose steps Flare cannot see (its optimizer is not a
        `torch.optim` one: a framework Flare does not know), not a hang: said once, and
        no hang is reported while it moves."""
        if self._progress is None or now_ns - self._progress_ns > limit_ns / 2:
            return False
        if not self._no_steps_said:
            self._no_steps_said = True
            runtime = self.runtime
            _log.warning("flare: rank %s has trained for %.0f s (batches, backward passes) and no "
                         "step has ended: steps end at a torch.optim optimizer's step() or a "
                         "flare.instrumentation.step() block, and this loop's optimizer is "
                         "neither; its time is not split into steps, and no hang is reported "
                         "while it trains", runtime.rank, (now_ns - runtime.step_start_ns) / 1e9)
        return True

    def _emit_hang(self, now_ns: int, limit_ns: int, op: Operation | None, ident: int,
                   stacks: str, native: str | None = None) -> None:
        runtime = self.runtime
        start_ns = op.start_ns if op is not None else runtime.step_start_ns
        attributes = {
            semconv.HANG_OPERATION: op.name if op is not None else semconv.SPAN_STEP,
            semconv.HANG_ELAPSED_S: round((now_ns - start_ns) / 1e9, 3),
            semconv.HANG_TIMEOUT_S: round(limit_ns / 1e9, 3),
            semconv.HANG_STACKS: stacks,
            semconv.HANG_THREAD: _thread_name(ident),
            semconv.STEP: runtime.step_number,
        }
        if native:
            attributes[semconv.HANG_NATIVE_STACKS] = native
        if op is not None:
            for key, value in op.attributes.items():
                hang_key = {semconv.COLL_OP: semconv.HANG_COLL_OP, semconv.COLL_PG:
                            semconv.HANG_PG, semconv.COLL_SEQ: semconv.HANG_SEQ}.get(key, key)
                attributes[hang_key] = value
            if op.name == OP_BACKWARD and self.collectives is not None:
                attributes.update(self.collectives.collective_in_flight(op.start_ns) or {})
        if op is None or op.name in (semconv.SPAN_STEP, semconv.SPAN_DATALOADER):
            # the training thread waiting on its DataLoader's worker processes: where
            # they are is where the time goes
            workers = loader_workers.waited_workers(ident)
            if workers:
                attributes[semconv.HANG_LOADER_WORKERS] = workers
                worker_stacks = loader_workers.worker_stacks(workers)
                if worker_stacks:
                    attributes[semconv.HANG_LOADER_STACKS] = worker_stacks
        site = _blocked_site(ident) or (format_site(op.frame) if op is not None
                                        and isinstance(op.frame, tuple) else None)
        if site:
            attributes[semconv.CODE_CALLSITE] = site
        attributes.update(runtime.span_attributes)
        span = runtime.tracer.start_span(semconv.SPAN_HANG, context=runtime.step_context,
                                         start_time=now_ns, attributes=attributes)
        span.set_status(Status(StatusCode.ERROR, "operation exceeded the hang timeout"))
        span.end(end_time=now_ns)
        self.hang_reports += 1
        _log.warning("flare: rank %d looks hung in %s for %.0f s at %s", runtime.rank,
                     attributes[semconv.HANG_OPERATION], attributes[semconv.HANG_ELAPSED_S],
                     site or "?")


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return str(ident)


def _blocked_site(ident: int) -> str | None:
    """The innermost user frame of the blocked thread: where it is stuck right now."""
    import sys

    frame = sys._current_frames().get(ident)
    return frame_site(frame) if frame is not None else None
