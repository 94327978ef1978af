"""The per-process state of Flare's instrumentation: the step in progress, its
always-on totals and the listeners; the operations in flight (for the hang watchdog)
are `operations.Operations`.

One `Runtime` exists per instrumented rank. Every hook (optimizer, dataloader, gc,
collectives, hot functions) reports into it; it alone creates `train.step` spans.
Engineer-facing API (used by the GPU layer, documented in docs/instrumentation.md):
`tracer`, `rank`, `local_rank`, `job_id`, `add_step_listener`, `remove_step_listener`,
`request_detail`, `step_context`, `span_attributes`.

Here: the step boundaries (`begin_step`, `end_step`, `step_boundary`: the per-step path)
and the decision which steps are detail steps. The runtime's other parts are base
classes of it, each in a module of its own, so that none costs the hooks a call more:
the step span made on the training thread (`step_span`, `step_context`;
live_step_span.py), the spans left to the finisher thread (`drain`, `run_later`;
deferred_steps.py), the children of a step (`wants_child`, `emit_child`;
step_children.py) and a failed or abandoned step (`fail_step`, `abandon_step`;
step_failure.py).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

from opentelemetry import trace

from flare.instrumentation.config import FlareConfig
from flare.instrumentation.deferred_steps import DeferredSteps
from flare.instrumentation.finished_span import FinishedSpans
from flare.instrumentation.identity import ProcessIdentity
from flare.instrumentation.live_step_span import LiveStepSpan
from flare.instrumentation.operations import Operations
from flare.instrumentation.step_children import SLOW_CHILD_NS as SLOW_CHILD_NS
from flare.instrumentation.step_children import StepChildren
from flare.instrumentation.step_failure import StepFailure
from flare.instrumentation.step_finisher import StepFinisher
from flare.instrumentation.step_listeners import StepListeners
from flare.instrumentation.step_records import StepRecord, StepTotals
from flare.instrumentation.thread_clock import ProcessClock, ThreadClock

_log = logging.getLogger(__name__)


class Runtime(LiveStepSpan, DeferredSteps, StepChildren, StepFailure):
    """One rank's step in progress and its boundaries (the base classes: the step span,
    its deferral, its children and its failure; their state is set here)."""

    def __init__(self, tracer: trace.Tracer, identity: ProcessIdentity, config: FlareConfig,
                 span_attributes: dict):
        self.tracer = tracer
        self.identity = identity
        self.config = config
        # Rank attributes added to every Flare span when the provider's resource lacks them.
        self.span_attributes = dict(span_attributes)
        self.enabled = True
        self.explicit_steps = False  # flare.instrumentation.step() took over the boundaries
        self.phase: str | None = None  # the framework phase running now (python_calls.PHASES)
        self.listeners = StepListeners()

        self.step_number = 0  # the step in progress, or the next one to begin
        self.step_open = False
        self._step_span = None
        self._step_context = None
        self.step_detail = False
        # Always-on attributes of the step summary beyond the runtime's own: functions
        # (summary, totals) that add theirs when the span is built (possibly on the
        # finisher thread), from what the hooks left in the step's StepTotals.
        self.summary_adders: tuple = ()
        # () -> {process group name: sequence number}, read at every step boundary (one
        # native call per group); None without torch.distributed.
        self.sequence_reader = None
        self.step_start_ns = 0
        self.step_start_cpu_ns = (0, 0, None)
        # the training thread's CPU clock and its wait for a CPU (thread_clock.py)
        self.thread_clock = ThreadClock()
        # the process's CPU less the collective library's threads' (thread_clock.py)
        self.process_clock = ProcessClock()
        self.totals = StepTotals()
        self.last_step_end_ns = 0
        self.recent_step_s: deque[float] = deque(maxlen=101)

        self._detail_once = False  # request_detail(): the next step only
        self._detail_every = config.detail_every
        self.detail_toggled = False  # SIGUSR2
        self.detail_flag_present = False  # FLARE_DETAIL_FLAG_FILE exists (polled)

        # Children wait here until their step ends, so a step that never completes (the
        # one open when the process exits) leaves no orphans behind.
        self._children: list[tuple[str, int, int, dict]] = []
        self.operations = Operations()  # what each thread is blocked in (the watchdog reads it)
        self._lock = threading.Lock()
        # Step spans created when the step is over skip the SDK's span machinery
        # (finished_span.py); None when the tracer is not one this is safe for.
        self._finished = FinishedSpans.for_tracer(tracer)
        # Ordinary steps whose span goes to an asynchronous (batch) processor anyway are
        # built and emitted by the finisher thread every few seconds, in a batch: the
        # training thread only captures the step's numbers (see end_step).
        self.finisher = StepFinisher(self._finished, self._emit_deferred)

    # ------------------------------------------------------------ identity (public API)
    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def local_rank(self) -> int:
        return self.identity.local_rank

    @property
    def job_id(self) -> str:
        return self.identity.job_id

    # ------------------------------------------------------------ listeners (public API)
    def add_step_listener(self, listener) -> None:
        self.listeners.add(listener)

    def remove_step_listener(self, listener) -> None:
        self.listeners.remove(listener)

    def request_detail(self) -> None:
        """Make the next step a detail step (children, flight recorder, kernel window)."""
        self._detail_once = True

    # ------------------------------------------------------------ steps
    def _decide_detail(self, step: int) -> bool:
        every = self._detail_every
        periodic = every > 0 and step % every == 0
        detail = periodic or self._detail_once or self.detail_toggled or self.detail_flag_present
        self._detail_once = False
        return detail

    def begin_step(self, start_ns: int | None = None) -> None:
        """Open the next step. Its span is created lazily -- at the step's end with all
        its attributes in one pass, or earlier if something needs its context (a hang
        report, an error) -- because span creation is most of the per-step cost."""
        if self.step_open or not self.enabled:
            return
        self.step_detail = self._decide_detail(self.step_number)
        self.step_start_ns = start_ns or time.time_ns()
        self.step_start_cpu_ns = (self.process_clock.read(), *self.thread_clock.read())
        previous, reader = self.totals, self.sequence_reader
        if (start_ns is not None and start_ns == self.last_step_end_ns
                and previous.seq_end is not None):
            seq_start = previous.seq_end  # it begins where the last one ended
        else:
            seq_start = reader() if reader is not None else None
        self.totals = StepTotals(seq_start=seq_start)
        self._children = []
        self._step_span = None
        self._step_context = None
        self.step_open = True
        self._notify_start()

    def end_step(self, end_ns: int | None = None, record: StepRecord | None = None) -> None:
        if not self.step_open:
            return
        end_ns = end_ns or time.time_ns()
        if record is None:
            record = self._capture(end_ns)
        deferred = self._defer_span()
        if deferred is not None:
            self.finisher.queue(record, deferred, self._notify_end(deferred))
        else:
            # earlier steps' spans first: the processors see steps in order (work
            # handed to run_later stays with the finisher)
            self.finisher.drain(spans_only=True)
            self._finish_now(record, end_ns)
        self.recent_step_s.append((end_ns - self.step_start_ns) / 1e9)
        self.last_step_end_ns = end_ns
        self.step_number += 1
        self.step_open = False
        self._step_span = None
        self._step_context = None

    def step_boundary(self, now_ns: int) -> None:
        """End the step in progress at `now_ns` and begin the next one there: what the
        optimizer hook does after every step. The usual case (an ordinary step whose
        span nothing asked for, batch processors only) queues the step for the
        finisher and advances to the next one without any listener call (`_capture`,
        `_advance`: written out inline here they saved no measurable time in situ,
        hook_cost_in_situ.py, 2026-12-05); anything else takes `_boundary_general`."""
        if not self.step_open:
            self.begin_step(now_ns)
            return
        finished, listeners = self._finished, self.listeners
        if (listeners.on_end_ordinary or finished is None or self.step_detail or self._children
                or not finished._asynchronous or not finished.unchanged()):
            self._boundary_general(now_ns)
            return
        # The usual case: no listener wants the ending step (so no stand-in span), its
        # span is deferred to the finisher. The switch to the next step happens under
        # the lock: a thread asking for the step span (a hang report, an error) gets
        # either this step's, made by the SDK (and the step is then finished now), or
        # the next one's.
        cpu = (self.process_clock.read(), *self.thread_clock.read())
        record = self._capture(now_ns, cpu)
        finisher = self.finisher
        queue = finisher.deferred
        with self._lock:
            deferred = self._step_span is None
            if deferred:
                if len(queue) >= finisher.wake_at:
                    finisher.full()
                queue.append((record, None, ()))
                # the next step's totals come ready-made from the finisher when it can
                spare = finisher.spare_totals
                self._advance(now_ns, cpu, spare.pop() if spare else None)
        if not deferred:
            self.end_step(now_ns, record)
            self.begin_step(now_ns)
            return
        if finisher.thread is None:
            finisher.start()
        detail = self.step_detail
        methods = listeners.on_start if detail else listeners.on_start_ordinary
        if methods:
            listeners.notify(methods, self.step_number, detail)

    def _boundary_general(self, now_ns: int) -> None:
        """Every boundary but step_boundary's usual case: a deferred step with a
        stand-in for its listeners, or a step finished now."""
        deferred = self._defer_span()
        if deferred is None:
            self.end_step(now_ns)
            self.begin_step(now_ns)
            return
        cpu = (self.process_clock.read(), *self.thread_clock.read())
        record = self._capture(now_ns, cpu)
        self.finisher.queue(record, deferred, self._notify_end(deferred))
        self._advance(now_ns, cpu)
        self._children = []
        self._step_span = None
        self._notify_start()

    def _advance(self, now_ns: int, cpu: tuple, following: StepTotals | None = None) -> None:
        """Close the step in progress at `now_ns` and open the next one there, with the
        same clocks (no listener calls); `following`: the next step's totals, reused
        (new ones when None). The step's span and children are the caller's: the usual
        boundary has neither, and a child emitted meanwhile (a long collection inside
        this bookkeeping) goes with the next step."""
        self.recent_step_s.append((now_ns - self.step_start_ns) / 1e9)
        self.last_step_end_ns = now_ns
        step = self.step_number + 1
        self.step_number = step
        self.step_detail = self._decide_detail(step)
        self.step_start_ns = now_ns
        self.step_start_cpu_ns = cpu
        # the sequence numbers read at this end are the next step's start
        if following is None:
            following = StepTotals()
        following.seq_start = self.totals.seq_end
        self.totals = following
        self._step_context = None

    def _capture(self, end_ns: int, cpu: tuple | None = None) -> StepRecord:
        """What the step span needs from the training thread at the step's end (`cpu`:
        the process and thread CPU clocks read at `end_ns`, when already read)."""
        if cpu is None:
            cpu = (self.process_clock.read(), *self.thread_clock.read())
        totals = self.totals
        reader = self.sequence_reader
        if reader is not None:
            totals.seq_end = reader()
        return StepRecord(self.step_number, self.step_start_ns, end_ns, totals,
                          self.step_start_cpu_ns, cpu, self.step_detail)

    def _notify_start(self) -> None:
        listeners = self.listeners
        listeners.notify(listeners.on_start if self.step_detail else listeners.on_start_ordinary,
                         self.step_number, self.step_detail)

    def median_step_s(self) -> float | None:
        recent = list(self.recent_step_s)
        return statistics.median(recent) if recent else None
