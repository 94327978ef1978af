"""The `train.step` span made on the training thread: on demand, through the SDK, when
something needs the open step's context before the step ends (a hang report, an error,
`step_context`), and at the step's end when the span cannot be left to the finisher
(a synchronous span processor, a tracer Flare cannot hand finished spans to, or a span
already made on demand), with the step-end listeners and the step's children while it
is still open.

An ordinary step's span is made neither way: the finisher thread builds it later
(deferred_steps.py). `LiveStepSpan` is a base class of `Runtime`, as its span slot
(`_step_span`, `_step_context`) is the runtime's state, switched by the step boundary
under the runtime's lock.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from flare.instrumentation.finished_span import PendingStepSpan
from flare.instrumentation.step_children import emit_children
from flare.instrumentation.step_records import StepRecord
from flare.instrumentation.step_spans import build_summary
from flare.wire import semconv

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class LiveStepSpan:
    """`Runtime`'s step span on the training thread (`step_span`, `step_context`, and
    finishing a step now: `_finish_now`)."""

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

    def _emit_step_end(self, span, end_ns: int) -> None:
        """Listeners, then the step's buffered children, while `span` is still open."""
        listeners = self.listeners
        listeners.notify(listeners.on_end if self.step_detail else listeners.on_end_ordinary,
                         self.step_number, self.step_detail, span)
        children, self._children = self._children, []
        if children:
            emit_children(self.tracer, span, children, self.step_number, end_ns)
