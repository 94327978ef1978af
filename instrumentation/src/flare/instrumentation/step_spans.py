"""A step's span, built from its StepRecord: the always-on summary attributes, and the
finisher thread's emission of a deferred step span with its children (`Runtime` hands
these the state they read)."""

from __future__ import annotations

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.trace import SpanContext, TraceFlags

from flare.instrumentation.finished_span import FinishedSpans, PendingStepSpan
from flare.instrumentation.step_records import StepRecord
from flare.wire import semconv

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def build_summary(record: StepRecord, adders: tuple) -> dict:
    """The step's summary attributes: the hooks' pending totals first, then the runtime's
    own figures, then each summary adder's (summary, totals)."""
    totals = record.totals
    for function, args in totals.pending:
        function(totals, *args)
    totals.pending = []
    summary = summary_attributes(record)
    for add in adders:
        add(summary, totals)
    return summary


def summary_attributes(record: StepRecord) -> dict:
    """The always-on attributes of a step span, from what its StepRecord holds."""
    _, start_ns, end_ns, totals, cpu_start, cpu_end, detail = record
    wall_ms = (end_ns - start_ns) / 1e6
    dataloader_ms = totals.dataloader_ns / 1e6
    gc_ms = totals.gc_ns / 1e6
    phases_ms = (totals.checkpoint_ns + totals.evaluation_ns) / 1e6
    wait_ns = 0
    for pg in totals.pg.values():  # (a loop: a generator is one more frame, cold)
        wait_ns += pg.wait_ns
    process_cpu_ns = cpu_end[0] - cpu_start[0]
    step_thread_cpu_ns = cpu_end[1] - cpu_start[1]
    run_delay_start, run_delay_end = cpu_start[2], cpu_end[2]
    attributes = {
        semconv.STEP_DATALOADER_MS: round(dataloader_ms, 3),
        semconv.STEP_DATALOADER_COUNT: totals.dataloader_count,
        semconv.STEP_GC_MS: round(gc_ms, 3),
        semconv.STEP_GC_COUNT: totals.gc_count,
        semconv.STEP_PYCALL_MS: round(totals.pycall_ns / 1e6, 3),
        semconv.STEP_PYCALL_COUNT: totals.pycall_count,
        semconv.STEP_BACKWARD_MS: round(totals.backward_ns / 1e6, 3),
        semconv.STEP_COLLECTIVE_WAIT_MS: round(wait_ns / 1e6, 3),
        semconv.STEP_COMPUTE_MS: round(max(0.0, wall_ms - dataloader_ms - gc_ms - wait_ns / 1e6
                                           - phases_ms), 3),
        semconv.STEP_CHECKPOINT_MS: round(totals.checkpoint_ns / 1e6, 3),
        semconv.STEP_EVALUATION_MS: round(totals.evaluation_ns / 1e6, 3),
        semconv.STEP_OTHER_THREADS_CPU_MS: round(
            max(0, process_cpu_ns - step_thread_cpu_ns) / 1e6, 3),
        semconv.STEP_DETAIL: detail,
    }
    attributes[semconv.STEP_THREAD_CPU_MS] = round(max(0, step_thread_cpu_ns) / 1e6, 3)
    if run_delay_start is not None and run_delay_end is not None:
        attributes[semconv.STEP_RUNQUEUE_MS] = round(
            max(0, run_delay_end - run_delay_start) / 1e6, 3)
    return attributes


def emit_deferred(finished: FinishedSpans, job: str, span_attributes: dict, adders: tuple,
                  record: StepRecord, pending: PendingStepSpan | None, children: list) -> None:
    """Build and emit one deferred step span (and a detail step's children), on the
    finisher thread: `pending` is the stand-in the step-end listeners saw, if any."""
    step, start_ns, end_ns = record.step, record.start_ns, record.end_ns
    summary = build_summary(record, adders)
    summary[semconv.STEP] = step
    summary.update(span_attributes)
    if pending is None:  # no listener saw a stand-in: nothing fixed the span id
        trace_id, span_id = semconv.step_trace_id(job, step), finished.new_span_id()
    else:
        summary.update(pending.pending_attributes)
        context = pending.get_span_context()  # the step's trace id: not hashed twice
        trace_id, span_id = context.trace_id, context.span_id
    if children:  # a detail step's: ended before their parent, as with the SDK
        context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)
        for name, start, end, attributes in children:
            # a collection can also run inside the step-end bookkeeping, after end_ns
            # was taken; dict(): one atomic copy, as the CUDA event poller may still
            # add keys; cleaned as the SDK cleans a span's attributes
            attributes = dict(BoundedAttributes(attributes=dict(attributes),
                                                immutable=False))
            attributes[semconv.STEP] = step  # queries filter children by step
            finished.emit(name, context, finished.new_span_id(), attributes,
                          min(start, end_ns), min(end, end_ns))
    parent = SpanContext(trace_id=trace_id, span_id=semconv.step_root_span_id(job, step),
                         is_remote=True, trace_flags=_SAMPLED)
    finished.emit(semconv.SPAN_STEP, parent, span_id, summary, start_ns, end_ns)
