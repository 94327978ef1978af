"""Per-item checks that turn a request into accepted items plus a partial-success note.

OTLP partial success: a receiver may accept a request while rejecting some of its
items, reporting how many and why. Here a span is rejected when its ids cannot
identify it (a trace id that is not 16 non-zero bytes, a span id that is not 8
non-zero bytes, a parent id of the wrong length); a metric when it has no name.
Rejected items are removed before the request is logged or processed, so nothing
unusable reaches the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

try:  # the same test on the wire bytes, in C (one pass, no protobuf objects)
    from flare.processors._otlp_read import check_span_ids as _check_span_ids
    from flare.processors._otlp_read import check_traces_strict as _check_traces_strict
except ImportError:  # no compiler where flare-processors was installed
    _check_span_ids = _check_traces_strict = None

_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)


@dataclass
class Checked:
    accepted: int  # spans or data points kept
    rejected: int
    message: str  # why items were rejected ('' when none were)


def _wire_schema(root, counted) -> tuple[tuple[bytes, ...], int] | None:
    """The message types under `root` as `check_traces_strict` reads them: per type, a
    code per field number (see csrc/otlp_read), and the index of type `counted`. None if
    a type does not fit the codes."""
    from google.protobuf.descriptor import FieldDescriptor as F

    scalar = {
        F.TYPE_INT32: 1, F.TYPE_INT64: 1, F.TYPE_UINT32: 1, F.TYPE_UINT64: 1, F.TYPE_SINT32: 1,
        F.TYPE_SINT64: 1, F.TYPE_BOOL: 1, F.TYPE_ENUM: 1,
        F.TYPE_FIXED64: 2, F.TYPE_SFIXED64: 2, F.TYPE_DOUBLE: 2,
        F.TYPE_FIXED32: 3, F.TYPE_SFIXED32: 3, F.TYPE_FLOAT: 3,
        F.TYPE_STRING: 4, F.TYPE_BYTES: 5,
    }
    order = [root]
    index = {root.full_name: 0}
    tables: list[bytes] = []
    for message in order:  # grows while it is walked: breadth first over nested types
        codes = bytearray(max((f.number for f in message.fields), default=0) + 1)
        for field in message.fields:
            if field.type == F.TYPE_MESSAGE:
                if field.message_type.GetOptions().map_entry:
                    return None
                name = field.message_type.full_name
                if name not in index:
                    index[name] = len(order)
                    order.append(field.message_type)
                code = 6 + index[name]
            else:
                # A group, or a repeated number (packed on the wire), is left to protobuf.
                repeated_number = _is_repeated(field) and scalar.get(field.type) in (1, 2, 3)
                code = 0 if repeated_number else scalar.get(field.type, 0)
            if code > 255:
                return None
            codes[field.number] = code
        tables.append(bytes(codes))
    if len(tables) > 256 or counted.full_name not in index:
        return None
    return tuple(tables), index[counted.full_name]


def _is_repeated(field) -> bool:
    """`FieldDescriptor.is_repeated` (protobuf >= 5.28, where `label` is deprecated), or
    the `label` of the protobuf 4 the declared floors bring."""
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return field.label == field.LABEL_REPEATED


_TRACES_SCHEMA = (
    _wire_schema(ExportTraceServiceRequest.DESCRIPTOR, Span.DESCRIPTOR) if _check_traces_strict else None
)


def check_traces_wire(payload: bytes) -> Checked | None:
    """`check_traces` without parsing, for the common case: a Checked when protobuf would
    certainly parse `payload` and every span has usable ids; None when not sure (the
    caller parses the request and runs `check_traces`, which decides as before)."""
    if _TRACES_SCHEMA is None:
        return None
    counts = _check_traces_strict(payload, *_TRACES_SCHEMA)
    if counts is None or counts[1]:
        return None
    return Checked(counts[0], 0, "")


def _span_problem(span) -> str | None:
    trace_id = span.trace_id
    if len(trace_id) != 16 or trace_id == _ZERO_TRACE:
        return "trace_id must be 16 bytes and not all zero"
    span_id = span.span_id
    if len(span_id) != 8 or span_id == _ZERO_SPAN:
        return "span_id must be 8 bytes and not all zero"
    if len(span.parent_span_id) not in (0, 8):
        return "parent_span_id must be empty or 8 bytes"
    return None


def check_traces(req: ExportTraceServiceRequest, payload: bytes | None = None) -> Checked:
    """Drop unusable spans from `req` in place and count what is left.

    `payload`, the bytes `req` was parsed from, lets the common case (every span
    usable) be told from the wire in C; a request with a bad span, or without its
    bytes, takes the loop below, which also removes the bad spans.
    """
    if payload is not None and _check_span_ids is not None:
        try:
            spans, bad = _check_span_ids(payload)
        except ValueError:
            pass  # the parse accepted it: let the loop below decide
        else:
            if not bad:
                return Checked(spans, 0, "")
    accepted = rejected = 0
    reason = ""
    zero_trace, zero_span = _ZERO_TRACE, _ZERO_SPAN
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            spans = ss.spans
            bad = []
            # Inlined fast path (this runs once per received span): only a span that
            # fails the cheap test is looked at again to name the problem.
            for index, span in enumerate(spans):
                trace_id = span.trace_id
                span_id = span.span_id
                if (
                    len(trace_id) != 16 or len(span_id) != 8 or trace_id == zero_trace
                    or span_id == zero_span or len(span.parent_span_id) not in (0, 8)
                ):
                    bad.append(index)
                    reason = reason or _span_problem(span) or ""
            for index in reversed(bad):
                del spans[index]
            accepted += len(spans)
            rejected += len(bad)
    message = f"{rejected} span(s) rejected: {reason}" if rejected else ""
    return Checked(accepted, rejected, message)


def _points(metric) -> int:
    kind = metric.WhichOneof("data")
    return len(getattr(metric, kind).data_points) if kind else 0


def point_count(req: ExportMetricsServiceRequest) -> int:
    """Data points in a request (a metric without data counts none)."""
    return sum(_points(metric) for rm in req.resource_metrics for sm in rm.scope_metrics
               for metric in sm.metrics)


def check_metrics(req: ExportMetricsServiceRequest) -> Checked:
    accepted = rejected = 0
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            metrics = sm.metrics
            bad = [i for i, metric in enumerate(metrics) if not metric.name]
            for index in bad:
                rejected += _points(metrics[index]) or 1
            for index in reversed(bad):
                del metrics[index]
            accepted += sum(_points(metric) for metric in metrics)
    message = f"{rejected} data point(s) rejected: metric name is empty" if rejected else ""
    return Checked(accepted, rejected, message)
