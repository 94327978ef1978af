"""What the rank correlator emits when a window closes: one `train.step.ranks` span
per (job, step), in the step's trace and linked to every rank's `train.step`, with a
`collective.ranks` child per process group whose members did not all reach the step's
last collective; one `collective.ranks` span per (job, pg, seq) window. Ids are derived
from (job, step) and (job, pg, seq), so a replay re-emits identical spans.
Attributes and per-rank links are written as wire bytes by the C module where it is
built (protobuf otherwise: the same message)."""

from __future__ import annotations

import operator
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span

from flare.processors.correlation_windows import (
    CollectiveWindow,
    PgSummary,
    StepWindow,
    collective_attributes,
    pg_summaries,
    step_attributes,
    summary_collective_attributes,
)
from flare.processors.otlp_values import derived_span_id, key_values
from flare.processors.span_select import _otlp_read
from flare.wire import semconv as sc
from flare.wire.otlp_values import Unsupported, write_attributes

SCOPE_NAME = "flare.processors.rank_correlation"

_START_NS, _END_NS, _TRACE_ID = (
    operator.attrgetter("start_ns"), operator.attrgetter("end_ns"), operator.attrgetter("trace_id")
)


def _step_root(job: str, step: int) -> bytes:
    return sc.step_root_span_id(job, step).to_bytes(8, "big")


_SPAN_ATTRIBUTES = 0x4A  # the tag of Span.attributes (field 9, length-delimited)


def _add_span(into, fields: dict, attrs: dict, ranks) -> Span:
    """Add one emitted span to `into`: its attributes and per-rank links written as wire
    bytes when possible, else through protobuf."""
    wire = _wire(attrs, ranks)
    if wire is not None:
        span: Span = into.add(**fields)
        span.MergeFromString(wire)
    else:
        span = into.add(**fields, attributes=key_values(attrs))
        _add_rank_links(span, ranks)
    return span


def _wire(attrs: dict[str, Any], ranks: dict[int, Any] | None = None) -> bytes | None:
    """A span's attributes (and, given `ranks`, its per-rank links) as wire bytes to
    merge into it: Flare's OTLP attribute writer and the links in C, instead of a
    KeyValue and an AnyValue object per attribute. None where the C module is missing
    or a value is one the writer leaves to protobuf (a kind it does not write, an int
    beyond int64, text that is not UTF-8): the caller builds them with protobuf then,
    which gives the same message or the same error. None values are left out, as
    `key_values` leaves them out."""
    if _otlp_read is None:
        return None
    try:
        wire = write_attributes({k: v for k, v in attrs.items() if v is not None}, _SPAN_ATTRIBUTES)
        if ranks is not None:
            wire += _otlp_read.rank_links(ranks, sc.RANK)
    except (Unsupported, TypeError, ValueError, OverflowError):
        return None
    return wire


def _add_rank_links(span: Span, ranks: dict[int, Any]) -> None:
    """One link per rank of a window, in rank order, to the rank's span, carrying
    `flare.rank`. The C picker writes them as wire bytes merged in one call (three
    protobuf calls per link were the emission's largest cost at many ranks)."""
    if _otlp_read is not None:
        try:
            span.MergeFromString(_otlp_read.rank_links(ranks, sc.RANK))
            return
        except (TypeError, ValueError, OverflowError):
            pass  # not the ints and bytes the picker gives: the reference below
    links = span.links
    for rank in sorted(ranks):
        entry = ranks[rank]
        link = links.add(trace_id=entry.trace_id, span_id=entry.span_id)
        kv = link.attributes.add(key=sc.RANK)
        kv.value.int_value = rank


def job_scope_spans(job, into: Any) -> Any:
    """A `ResourceSpans` for `job` added to `into` (a request's `resource_spans`); its
    scope's span container."""
    resource_spans: ResourceSpans = into.add()
    resource_spans.resource.attributes.extend(key_values({
        sc.SERVICE_NAME: job.service or job.job,
        sc.JOB_ID: job.job,
        sc.WORLD_SIZE: job.world_size,
    }))
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = SCOPE_NAME
    return scope_spans.spans


def step_spans(job, win: StepWindow, closed_by: str, expected: int | None, max_pg_detail: int,
               into: Any) -> int:
    """The step's `train.step.ranks` span, and a `collective.ranks` summary for each
    process group some of whose members are missing; returns how many of those."""
    step = win.key
    assert isinstance(step, int)
    pgs = pg_summaries(win.ranks, job.pg_members)
    hanging = {rank: h.hang for rank, h in job.ranks.items() if h.hang}
    attrs = step_attributes(win, step, expected, closed_by, pgs, max_pg_detail, hanging)
    trace_id = _step_trace_id(job, win)
    # The id every rank's train.step names as its parent: this span becomes the
    # root of the step's trace in Jaeger/Tempo.
    step_span_id = _step_root(job.job, step)
    fields = {
        "trace_id": trace_id, "span_id": step_span_id, "name": sc.SPAN_STEP_RANKS,
        "kind": Span.SPAN_KIND_INTERNAL,
        "start_time_unix_nano": min(map(_START_NS, win.ranks.values())),
        "end_time_unix_nano": max(map(_END_NS, win.ranks.values())),
    }
    span = _add_span(into, fields, attrs, win.ranks)
    summaries = 0
    for pg in pgs:
        if pg.missing:
            _summary_collective_span(job, step, trace_id, step_span_id, pg, closed_by, span, into)
            summaries += 1
    return summaries


def _step_trace_id(job, win: StepWindow) -> bytes:
    # The ranks' own trace id when they agree (it is derived from job and step);
    # otherwise the derivation, so the span still lands in the step's trace.
    trace_ids = set(map(_TRACE_ID, win.ranks.values()))
    if len(trace_ids) == 1:
        return next(iter(trace_ids))
    return sc.step_trace_id(job.job, int(win.key)).to_bytes(16, "big")  # type: ignore[arg-type]


def _summary_collective_span(job, step: int, trace_id: bytes, parent: bytes, pg: PgSummary,
                             closed_by: str, step_span: Span, into: Any) -> None:
    fields = {
        "trace_id": trace_id, "parent_span_id": parent,
        "span_id": derived_span_id(
            job.job, pg.name, pg.last_seq, sc.SPAN_COLLECTIVE_RANKS, "step_summary"
        ),
        "name": sc.SPAN_COLLECTIVE_RANKS, "kind": Span.SPAN_KIND_INTERNAL,
        "start_time_unix_nano": step_span.start_time_unix_nano,
        "end_time_unix_nano": step_span.end_time_unix_nano,
    }
    attrs = summary_collective_attributes(pg, step, closed_by)
    wire = _wire(attrs)
    if wire is not None:
        into.add(**fields).MergeFromString(wire)
    else:
        into.add(**fields, attributes=key_values(attrs))


def collective_span(job, win: CollectiveWindow, closed_by: str, into: Any) -> None:
    """The (pg, seq) window's `collective.ranks` span."""
    pg, seq = win.key  # type: ignore[misc]
    arrivals = win.ranks.values()
    trace_ids = {a.trace_id for a in arrivals}
    if win.step is not None:
        trace_id = sc.step_trace_id(job.job, win.step).to_bytes(16, "big")
        parent = _step_root(job.job, win.step)
    else:
        trace_id = next(iter(trace_ids))
        parent = b""
    fields = {
        "trace_id": trace_id, "parent_span_id": parent,
        "span_id": derived_span_id(job.job, pg, seq, sc.SPAN_COLLECTIVE_RANKS),
        "name": sc.SPAN_COLLECTIVE_RANKS, "kind": Span.SPAN_KIND_INTERNAL,
        "start_time_unix_nano": min(a.start_ns for a in arrivals),
        "end_time_unix_nano": max(a.end_ns for a in arrivals),
    }
    attrs = collective_attributes(win, pg, seq, closed_by, job.pg_members.get(pg, set()))
    _add_span(into, fields, attrs, win.ranks)
