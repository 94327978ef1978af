"""A step's child spans (a collective, a batch fetch, a garbage collection, a slow Python
call, a stack capture): kept on every detail step, and on an ordinary step only when
slow (`SLOW_CHILD_MS`), so that ordinary steps stay one span each.

The runtime holds them until their step ends, so a step that never completes (the one
open when the process exits) leaves no orphans behind; they are then emitted under the
step's span, by the finisher with a deferred span (`step_spans.emit_deferred`) or by
`emit_children` here, through the SDK, when the span is finished on the training thread.

`StepChildren` is a base class of `Runtime`, not an object of its own: the hooks call
`wants_child` (and `emit_child`) on the runtime for every collective, batch fetch and
collection, and a method of the runtime's own class costs them no extra call.
"""

from __future__ import annotations

from opentelemetry import trace

from flare.instrumentation.config import SLOW_CHILD_MS
from flare.wire import semconv

SLOW_CHILD_NS = int(SLOW_CHILD_MS * 1e6)


class StepChildren:
    """`Runtime`'s children: read and filled here, held in its `_children` (name,
    start_ns, end_ns, attributes), emptied at every step's start and end."""

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


def emit_children(tracer: trace.Tracer, span, children: list, step: int, end_ns: int) -> None:
    """The step's buffered `children`, through the SDK, under its `span` (still open:
    they end before it, as the finisher's do)."""
    context = trace.set_span_in_context(span)
    for name, start, end, attributes in children:
        # a collection can also run inside this bookkeeping, after end_ns was taken
        start, end = min(start, end_ns), min(end, end_ns)
        # dict(): one atomic copy, as the CUDA event poller may still add keys
        attributes = dict(attributes)
        attributes[semconv.STEP] = step  # queries filter children by step
        child = tracer.start_span(name, context=context, start_time=start,
                                  attributes=attributes)
        child.end(end_time=end)
