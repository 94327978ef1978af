"""A step that ends badly: one that raised (or whose process was killed by a signal) is
marked ERROR and ended, its span made now, through the SDK, with the exception and where
it was raised; outside a step a `flare.error` span says so. A step that will never
complete (the one the optimizer hook opened before `flare.instrumentation.step()` took
over the boundaries) is forgotten, never exported.

Cold code, on the error paths only. `StepFailure` is a base class of `Runtime`, whose
step it ends (`end_step`) or drops.
"""

from __future__ import annotations

from opentelemetry.trace import Status, StatusCode

from flare.wire import semconv


class StepFailure:
    """`Runtime`'s `fail_step` and `abandon_step`."""

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
