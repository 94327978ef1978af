"""The per-process state of Flare's instrumentation: the step in progress, its
always-on totals and the listeners; the operations in flight (for the hang watchdog)
are `operations.Operations`.

One `Runtime` exists per instrumented rank. Every hook (optimizer, dataloader, gc,
collectives, hot functions) reports into it; it alone creates `train.step` spans.
Engineer-facing API (used by the GPU layer, documented in docs/instrumentation.md):
`tracer`, `rank`, `local_rank`, `job_id`, `add_step_listener`, `remove_step_listener`,
`request_detail`, `step_context`, `span_attributes`.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from flare.wire import semconv
from flare.instrumentation.config import SLOW_CHILD_MS, FlareConfig
from flare.instrumentation.finished_span import FinishedSpans, PendingStepSpan
from flare.instrumentation.identity import ProcessIdentity
from flare.instrumentation.operations import Operations
from flare.instrumentation.step_finisher import StepFinisher
from flare.instrumentation.step_listeners import StepListeners
from flare.instrumentation.step_records import StepRecord, StepTotals
from flare.instrumentation.step_spans import build_summary, emit_deferred
from flare.instrumentation.thread_clock import ProcessClock, ThreadClock

_log = logging.getLogger(__name__)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
SLOW_CHILD_NS = int(SLOW_CHILD_MS * 1e6)


class Runtime:
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

    def _step_parent(self, step: int | None = None) -> SpanContext:
        job = self.identity.job_id
        step = self.step_number if step is None else step
        return SpanContext(trace_id=semconv.step_trace_id(job, step),
                           span_id=semconv.step_root_span_id(job, step),
                           is_remote=True, trace_flags=_SAMPLED)

    def _label_step(self, attributes: dict, step: int) -> None:
        """The step number and the rank attributes every step span carries."""
        attributes[semconv.STEP] = step
        attributes.update(self.span_attributes)

    def _start_step_span(self, attributes: dict):
        self._label_step(attributes, self.step_number)
        root = NonRecordingSpan(self._step_parent())
        return self.tracer.start_span(semconv.SPAN_STEP, context=trace.set_span_in_context(root),
                                      start_time=self.step_start_ns, attributes=attributes)

    @property
    def step_span(self):
        """The span of the step in progress (created now if it does not exist yet)."""
        if not self.step_open:
            return None
        with self._lock:
            if self._step_span is None:
                self._step_span = self._start_step_span({})
            return self._step_span

    @property
    def step_context(self):
        """OTel Context holding the step span, for children (None between steps)."""
        span = self.step_span
        if span is None:
            return None
        if self._step_context is None:
            self._step_context = trace.set_span_in_context(span)
        return self._step_context

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

    def _deferrable(self) -> bool:
        """Whether the step in progress can have its span (and a detail step's
        children) built later by the finisher: processors that export in batches
        anyway (handing a span over a second later changes nothing they see)."""
        finished = self._finished
        if finished is None:
            return False
        # finished.asynchronous(), with its usual answer read inline (this runs cold)
        return (finished._asynchronous and finished.unchanged()) or finished.asynchronous()

    def _defer_span(self) -> PendingStepSpan | None:
        """The stand-in the step-end listeners see for a deferred step span (its
        context is computed only if something asks for it); the finisher thread builds
        the attributes and hands the span over (drain() on every flush). None when the
        span must be finished now."""
        if not self._deferrable():
            return None
        step, finished = self.step_number, self._finished
        with self._lock:
            if self._step_span is not None:  # a hang report or an error made it
                return None
            self._step_span = PendingStepSpan(
                lambda: SpanContext(semconv.step_trace_id(self.identity.job_id, step),
                                    finished.new_span_id(),
                                    is_remote=False, trace_flags=_SAMPLED), {})
            return self._step_span

    def step_boundary(self, now_ns: int) -> None:
        """End the step in progress at `now_ns` and begin the next one there: what the
        optimizer hook does after every step. The usual case (an ordinary step whose
        span nothing asked for, batch processors only) runs as one straight pass over
        the training thread's bookkeeping, since this code runs right after the
        optimizer step, with cold caches, where every call and lookup is paid several
        times over; anything else takes `end_step` then `begin_step`."""
        if not self.step_open:
            self.begin_step(now_ns)
            return
        finished, listeners = self._finished, self.listeners
        if (listeners.on_end_ordinary or finished is None or self.step_detail or self._children
                or not finished._asynchronous or not finished.unchanged()):
            self._boundary_general(now_ns)
            return
        # The usual case: no listener wants the ending step (so no stand-in span), its
        # span is deferred to the finisher. Written out in one frame (_capture and
        # _advance inline). The switch to the next step happens under the lock: a
        # thread asking for the step span (a hang report, an error) gets either this
        # step's, made by the SDK (and the step is then finished now), or the next one's.
        cpu = (self.process_clock.read(), *self.thread_clock.read())
        totals = self.totals
        reader = self.sequence_reader
        if reader is not None:
            totals.seq_end = reader()
        start_ns = self.step_start_ns
        step = self.step_number
        record = StepRecord(step, start_ns, now_ns, totals, self.step_start_cpu_ns, cpu, False)
        finisher = self.finisher
        queue = finisher.deferred
        with self._lock:
            deferred = self._step_span is None
            if deferred:
                if len(queue) >= finisher.wake_at:
                    finisher.full()
                queue.append((record, None, ()))
                self.recent_step_s.append((now_ns - start_ns) / 1e9)
                self.last_step_end_ns = now_ns
                step += 1
                self.step_number = step
                # _decide_detail, inline (the usual answer: no)
                every = self._detail_every
                detail = ((every > 0 and step % every == 0) or self._detail_once
                          or self.detail_toggled or self.detail_flag_present)
                self.step_detail = detail
                self._detail_once = False
                self.step_start_ns = now_ns
                self.step_start_cpu_ns = cpu
                # the sequence numbers read at this end are the next step's start; the
                # next step's totals come ready-made from the finisher when it can
                spare = finisher.spare_totals
                following = spare.pop() if spare else StepTotals()
                following.seq_start = totals.seq_end
                self.totals = following
                self._step_context = None
        if not deferred:
            self.end_step(now_ns, record)
            self.begin_step(now_ns)
            return
        if finisher.thread is None:
            finisher.start()
        methods = listeners.on_start if detail else listeners.on_start_ordinary
        if methods:
            listeners.notify(methods, step, detail)

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
        self._notify_start()

    def _notify_end(self, deferred: PendingStepSpan) -> list:
        """The step-end listeners, given the stand-in of the deferred span; returns the
        step's children (those listeners may add some), for the finisher to emit."""
        detail, listeners = self.step_detail, self.listeners
        listeners.notify(listeners.on_end if detail else listeners.on_end_ordinary,
                         self.step_number, detail, deferred)
        children, self._children = self._children, []
        return children

    def _advance(self, now_ns: int, cpu: tuple) -> None:
        """Close the step in progress at `now_ns` and open the next one there, with the
        same clocks (no listener calls)."""
        self.recent_step_s.append((now_ns - self.step_start_ns) / 1e9)
        self.last_step_end_ns = now_ns
        step = self.step_number + 1
        self.step_number = step
        self.step_detail = self._decide_detail(step)
        self.step_start_ns = now_ns
        self.step_start_cpu_ns = cpu
        # the sequence numbers read at this end are the next step's start
        self.totals = StepTotals(seq_start=self.totals.seq_end)
        self._children = []
        self._step_span = None
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

    def _finish_now(self, record: StepRecord, end_ns: int) -> None:
        summary = build_summary(record, self.summary_adders)
        finished = self._finished
        with self._lock:
            span = self._step_span
            if span is not None:
                span.set_attributes(summary)
            elif finished is not None and finished.usable():
                # Nothing needed the span during the step: it is emitted finished, with
                # a pending stand-in (same context) for the listeners and children.
                self._label_step(summary, self.step_number)
                parent = self._step_parent()
                context = SpanContext(parent.trace_id, finished.new_span_id(),
                                      is_remote=False, trace_flags=_SAMPLED)
                span = self._step_span = PendingStepSpan(lambda: context, summary)
            else:
                span = self._step_span = self._start_step_span(summary)
        self._emit_step_end(span, end_ns)
        if isinstance(span, PendingStepSpan):
            finished.emit(semconv.SPAN_STEP, parent, span.get_span_context().span_id,
                          summary, self.step_start_ns, end_ns)
        else:
            span.end(end_time=end_ns)

    # ------------------------------------------------------------ deferred step spans
    def drain(self, spans_only: bool = False) -> bool:
        """Hand every deferred step span over now (Flare's flushes: before the SDK's);
        `StepFinisher.drain`."""
        return self.finisher.drain(spans_only)

    def run_later(self, work) -> None:
        """Run `work()` off the training thread (`StepFinisher.run_later`)."""
        self.finisher.run_later(work)

    def stop_finisher(self) -> None:
        """Drain, then stop the finisher thread (uninstrument, exit)."""
        self.finisher.stop()

    def _emit_deferred(self, record: StepRecord, pending: PendingStepSpan | None,
                       children: list) -> None:
        """The finisher thread's work for one step (step_spans.emit_deferred)."""
        emit_deferred(self._finished, self.identity.job_id, self.span_attributes,
                      self.summary_adders, record, pending, children)

    def _emit_step_end(self, span, end_ns: int) -> None:
        """Listeners, then the step's buffered children, while `span` is still open."""
        listeners = self.listeners
        listeners.notify(listeners.on_end if self.step_detail else listeners.on_end_ordinary,
                         self.step_number, self.step_detail, span)
        children, self._children = self._children, []
        if children:
            context = trace.set_span_in_context(span)
            for name, start, end, attributes in children:
                # a collection can also run inside this bookkeeping, after end_ns was taken
                start, end = min(start, end_ns), min(end, end_ns)
                # dict(): one atomic copy, as the CUDA event poller may still add keys
                attributes = dict(attributes)
                attributes[semconv.STEP] = self.step_number  # queries filter children by step
                child = self.tracer.start_span(name, context=context, start_time=start,
                                               attributes=attributes)
                child.end(end_time=end)

    def abandon_step(self) -> None:
        """Forget an open step that will never complete (never exported: not ended)."""
        self._children = []
        self.step_open = False
        self._step_span = None
        self._step_context = None

    def fail_step(self, exception: BaseException | None, description: str,
                  callsite: str | None, extra: dict | None = None) -> None:
        """Mark the step in progress ERROR (or emit flare.error outside a step) and end it."""
        if self.step_open:
            span = self.step_span
        else:
            attributes = dict(self.span_attributes)
            attributes[semconv.STEP] = self.step_number
            span = self.tracer.start_span(semconv.SPAN_ERROR, attributes=attributes)
        span.set_status(Status(StatusCode.ERROR, description))
        if exception is not None:
            span.record_exception(exception, escaped=True)
        if callsite:
            span.set_attribute(semconv.CODE_CALLSITE, callsite)
        for key, value in (extra or {}).items():
            span.set_attribute(key, value)
        if self.step_open:
            self.end_step()
        else:
            span.end()

    def median_step_s(self) -> float | None:
        recent = list(self.recent_step_s)
        return statistics.median(recent) if recent else None

    # ------------------------------------------------------------ children
    def wants_child(self, start_ns: int, end_ns: int) -> bool:
        """Whether `emit_child` would keep a child spanning these times (hooks ask
        first, so that ordinary steps do not build attributes only to drop them)."""
        return self.step_open and (self.step_detail or end_ns - start_ns >= SLOW_CHILD_NS)

    def emit_child(self, name: str, start_ns: int, end_ns: int, attributes: dict,
                   keep_start: bool = False) -> None:
        """A child of the current step: always on detail steps, otherwise only when slow.
        Emitted when the step ends (children of a step that never ends are dropped).
        `keep_start`: a call that began in an earlier step (it ran the optimizer step
        itself) keeps its real start instead of being cut to this step's; whether it is
        slow is still judged by its part in this step (a function that is the whole
        step is not a slow call of every step)."""
        inside = max(start_ns, self.step_start_ns)
        if not self.wants_child(inside, end_ns):
            return
        if self.span_attributes:
            attributes.update(self.span_attributes)
        # A collection can start while begin_step itself allocates: keep children inside.
        if not keep_start:
            start_ns = inside
        self._children.append((name, start_ns, max(start_ns, end_ns), attributes))
