"""The step spans the training thread leaves to the finisher thread (step_finisher.py):
whether a step's span can be deferred, the stand-in its step-end listeners see when they
want one, and the finisher's callback that builds the span (`step_spans.emit_deferred`);
with the runtime's handles on the finisher (`drain`, `run_later`, `stop_finisher`).

`step_boundary` queues the usual step itself, without any of this; what is here
runs on the other boundaries (a listener wants the step's end, a detail step) and in
`end_step`. `DeferredSteps` is a base class of `Runtime`: the state is the runtime's,
and the finisher holds the bound `_emit_deferred`.
"""

from __future__ import annotations

from opentelemetry.trace import SpanContext, TraceFlags

from flare.instrumentation.finished_span import PendingStepSpan
from flare.instrumentation.step_records import StepRecord
from flare.instrumentation.step_spans import emit_deferred
from flare.wire import semconv

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class DeferredSteps:
    """`Runtime`'s deferred step spans (its `_finished`, `finisher` and span slot)."""

    def _deferrable(self) -> bool:
        """Whether the step in progress can have its span (and a detail step's
        children) built later by the finisher: processors that export in batches
        anyway (handing a span over a second later changes nothing they see)."""
        finished = self._finished
        return finished is not None and finished.asynchronous()

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

    def _notify_end(self, deferred: PendingStepSpan) -> list:
        """The step-end listeners, given the stand-in of the deferred span; returns the
        step's children (those listeners may add some), for the finisher to emit."""
        detail, listeners = self.step_detail, self.listeners
        listeners.notify(listeners.on_end if detail else listeners.on_end_ordinary,
                         self.step_number, detail, deferred)
        children, self._children = self._children, []
        return children

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
