"""OTLP protobuf requests → columns of the store schema.

This is the hot path of ingest: every span the collector stores passes through
`SpanColumns.add_payload` once. With the C decoder (the collector's OTLP readers' `SpanBuilder`,
flare.processors._otlp_read, the normal case) a request's spans go from the wire
straight into Arrow buffers; the pure-Python
reference below (`add_request_python`, used where no compiler was available and as
the fallback) gives the same values and is written for CPython speed, which is why it
looks less tidy than the rest of the code:
- values that belong to a resource (job, service, rank, host, pid, resource JSON) are
  computed once per `ResourceSpans` and repeated with `list.extend([x] * n)`;
- per span, only the fields the schema keeps are touched, each exactly once (every
  protobuf field access through upb allocates), and attribute maps go straight to
  JSON text through the C JSON encoder;
- empty events/links (nearly every span) share one constant string.
`benchmarks/ingest.py` measures it against the protobuf parse-only ceiling.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pyarrow as pa

from flare.exporters import store
from flare.processors.otlp_values import as_int, plain
from flare.wire import semconv

try:  # the C decoder (flare.processors._otlp_read); the Python code below is its reference
    from flare.processors import _otlp_read
except ImportError:  # no compiler where it was installed: same output, ~10x slower
    _otlp_read = None

# Events or links kept per span (as the C decoder's MAX_ITEMS); what a span had beyond
# them, plus what its sender dropped (OTLP's dropped_*_count), is written into its
# attributes under these keys when not zero.
MAX_ITEMS = 4096
DROPPED_KEYS = ("flare.dropped_attributes", "flare.dropped_events", "flare.dropped_links")

_SCALAR_KINDS = frozenset(("string_value", "int_value", "double_value", "bool_value"))
_EMPTY_LIST_JSON = "[]"
_EMPTY_OBJECT_JSON = "{}"

# Compact separators keep the store small; allow_nan=False so a NaN/Inf double (not
# valid JSON, rejected by DuckDB's JSON functions) takes the slow sanitising path.
_encode_json = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False
).encode


def attributes_dict(attributes: Any) -> dict[str, Any]:
    """KeyValues as the plain values JSON will carry (otlp_values.plain, for_json)."""
    out = {}
    for kv in attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind in _SCALAR_KINDS else plain(value, True)
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def to_json(value: Any) -> str:
    """JSON text that DuckDB's JSON functions accept (non-finite doubles sanitised)."""
    try:
        return _encode_json(value)
    except ValueError:
        return _encode_json(_finite(value))


def _events_json(events: Any) -> str:
    return to_json(
        [
            {"name": e.name, "time_ns": e.time_unix_nano, "attributes": attributes_dict(e.attributes)}
            for e in events
        ]
    )


def _links_json(links: Any) -> str:
    return to_json(
        [
            {
                "trace_id": link.trace_id.hex(),
                "span_id": link.span_id.hex(),
                "attributes": attributes_dict(link.attributes),
            }
            for link in links
        ]
    )


def _parse_request(payload: bytes) -> Any:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    try:
        return ExportTraceServiceRequest.FromString(payload)
    except Exception as exc:
        raise ValueError(f"malformed OTLP ExportTraceServiceRequest: {exc}") from None


def _with_dropped(attrs: dict[str, Any], span: Any) -> dict[str, Any]:
    """`attrs` plus the counts of what the sender dropped and what MAX_ITEMS cuts."""
    counts = (
        span.dropped_attributes_count,
        span.dropped_events_count + max(0, len(span.events) - MAX_ITEMS),
        span.dropped_links_count + max(0, len(span.links) - MAX_ITEMS),
    )
    out = dict(attrs)
    for key, count in zip(DROPPED_KEYS, counts, strict=True):
        if count:
            out.pop(key, None)  # the count goes last, where the C decoder writes it
            out[key] = count
    return out


def resource_identity(resource_attrs: dict[str, Any]) -> tuple[str, str, int | None]:
    """(job, service, rank) of a resource: job is flare.job.id, else service.name."""
    service = resource_attrs.get(semconv.SERVICE_NAME)
    service = "" if service is None else str(service)
    job = resource_attrs.get(semconv.JOB_ID)
    job = service if job in (None, "") else str(job)
    return job, service, as_int(resource_attrs.get(semconv.RANK))


# The span columns that vary per span (the rest are per resource, see SpanColumns).
_SPAN_VALUE_COLUMNS = (
    "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns",
    "duration_ns", "status_code", "status_message", "step", "rank", "attributes", "events",
    "links",
)
_TYPES = {column: typ for column, _, typ in store.SPAN_COLUMNS}
# A C builder is sealed into its own chunk before its largest text column passes this
# (Arrow's string offsets are int32).
_SEAL_BYTES = 1 << 30
_INT_RANGES = {pa.int8(): 1 << 7, pa.int32(): 1 << 31, pa.int64(): 1 << 63}


def _int_column(values: list[Any], typ: pa.DataType) -> pa.Array:
    """Integers into a column of `typ` as the C builder stores them: a value out of
    range is NULL for the nullable kinds (TINYINT, INTEGER) and wraps for BIGINT
    (nanoseconds past 2**63), so one broken span cannot make a flush fail forever."""
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, OverflowError):
        half = _INT_RANGES[typ]
        if typ == pa.int64():
            values = [v if v is None or -half <= v < half else (v + half) % (2 * half) - half for v in values]
        else:
            values = [v if v is None or -half <= v < half else None for v in values]
        return pa.array(values, type=typ)


class _ListColumns:
    """The Python reference's output: one list per span column."""

    __slots__ = _SPAN_VALUE_COLUMNS

    def __init__(self) -> None:
        for column in self.__slots__:
            setattr(self, column, [])

    def __len__(self) -> int:
        return len(self.span_id)

    def arrays(self) -> dict[str, pa.Array]:
        out = {}
        for column in self.__slots__:
            typ = _TYPES[column]
            values = getattr(self, column)
            out[column] = _int_column(values, typ) if pa.types.is_integer(typ) else pa.array(values, type=typ)
        return out


def _builder_arrays(buffers: dict[str, tuple[Any, Any, Any]], rows: int) -> dict[str, pa.Array]:
    """Arrow arrays over the C builder's buffers (no copy: the arrays keep them alive)."""
    out = {}
    for column, (valid, offsets, values) in buffers.items():
        bufs = [None if valid is None else pa.py_buffer(valid)]
        if offsets is not None:
            bufs.append(pa.py_buffer(offsets))
        bufs.append(pa.py_buffer(values))
        out[column] = pa.Array.from_buffers(_TYPES[column], rows, bufs)
    return out


class SpanColumns:
    """Accumulates spans of many requests; `table()` makes the store's Arrow table.

    The C decoder writes the span columns straight into Arrow buffers (a
    `_otlp_read.SpanBuilder`); the Python reference appends to lists. Each run of
    requests decoded one way is a chunk of the table, in arrival order.
    """

    __slots__ = (
        "_builder", "_chunks", "_lists", "_resource_index", "_resource_of_span", "_rows", "pid",
    )
    # Columns that hold one value per resource (process): kept as dictionary indices,
    # which makes both the Arrow build and DuckDB's insert cheaper than repeating a
    # ~400-byte resource JSON string on every span.
    RESOURCE_COLUMNS = ("job", "service", "host", "resource")
    decoder_fallbacks = 0  # process-wide: requests the C decoder refused, the reference took

    def __init__(self) -> None:
        self._builder: Any = None  # _otlp_read.SpanBuilder while C-decoded spans come in
        self._lists: _ListColumns | None = None  # while reference-decoded spans come in
        self._chunks: list[dict[str, pa.Array]] = []  # earlier runs, in order
        self._rows = 0
        self._resource_of_span: list[int] = []
        self.pid: list[int | None] = []
        self._resource_index: dict[tuple[str, str, str | None, str], int] = {}

    def __len__(self) -> int:
        return self._rows

    def _seal(self) -> None:
        """Close the current run of spans into a chunk."""
        if self._builder is not None and len(self._builder):
            rows = len(self._builder)
            self._chunks.append(_builder_arrays(self._builder.take(), rows))
        if self._lists is not None:
            if len(self._lists):
                self._chunks.append(self._lists.arrays())
            self._lists = None

    def add_request(self, request: Any) -> int:
        """Append every span of an `ExportTraceServiceRequest`; returns the count."""
        if _otlp_read is not None:
            try:
                return self.add_payload(request.SerializeToString())
            except ValueError:
                # A parsed request always re-serialises to valid bytes, so this is the
                # C decoder disagreeing with protobuf (it appended nothing): never lose
                # the request over it.
                SpanColumns.decoder_fallbacks += 1
        return self.add_request_python(request)

    def add_payload(self, payload: bytes) -> int:
        """Append every span of a serialized `ExportTraceServiceRequest`.

        Raises ValueError for bytes that are not one; nothing is appended then.
        """
        if _otlp_read is None:
            return self.add_request_python(_parse_request(payload))
        builder = self._builder
        if builder is None or self._lists is not None or builder.nbytes() > _SEAL_BYTES:
            self._seal()
            if builder is None:
                builder = self._builder = _otlp_read.SpanBuilder()
        try:
            resources = builder.decode(payload)
        except ValueError:
            # Protobuf's verdict decides what is a request (the receivers acknowledged
            # these bytes on it): where the C reader disagrees, the reference stores it.
            request = _parse_request(payload)
            SpanColumns.decoder_fallbacks += 1
            return self.add_request_python(request)
        added = 0
        for resource_attrs, count in resources:
            job, service, _ = resource_identity(resource_attrs)
            self._extend_resource(resource_attrs, job, service, count)
            added += count
        self._rows += added
        return added

    def _extend_resource(
        self, resource_attrs: dict[str, Any], job: str, service: str, count: int
    ) -> None:
        host = resource_attrs.get(semconv.HOST_NAME)
        key = (job, service, None if host is None else str(host), to_json(resource_attrs))
        index = self._resource_index.setdefault(key, len(self._resource_index))
        self._resource_of_span.extend([index] * count)
        pid = as_int(resource_attrs.get(semconv.PROCESS_PID))
        if pid is not None and not -(1 << 31) <= pid < 1 << 31:
            pid = None  # not a process id; an INTEGER column cannot hold it
        self.pid.extend([pid] * count)

    def add_request_python(self, request: Any) -> int:
        """The reference implementation of `add_payload`, on a parsed request."""
        if self._lists is None:
            self._seal()
            self._lists = _ListColumns()
        lists = self._lists
        added = 0
        step_key = semconv.STEP
        rank_key = semconv.RANK
        trace_id, span_id, parent_id = lists.trace_id, lists.span_id, lists.parent_span_id
        name, kind, start, end, duration = (
            lists.name, lists.kind, lists.start_ns, lists.end_ns, lists.duration_ns,
        )
        status_code, status_message = lists.status_code, lists.status_message
        rank_col, step_col, attrs_col = lists.rank, lists.step, lists.attributes
        events_col, links_col = lists.events, lists.links
        scalar_kinds = _SCALAR_KINDS
        for resource_spans in request.resource_spans:
            resource_attrs = attributes_dict(resource_spans.resource.attributes)
            job, service, resource_rank = resource_identity(resource_attrs)
            count = 0
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attrs = {}
                    for kv in span.attributes:
                        value = kv.value
                        which = value.WhichOneof("value")
                        attrs[kv.key] = (
                            getattr(value, which) if which in scalar_kinds else plain(value, True)
                        )
                    trace_id.append(span.trace_id.hex())
                    span_id.append(span.span_id.hex())
                    parent_id.append(span.parent_span_id.hex())
                    name.append(span.name)
                    kind.append(span.kind)
                    t0 = span.start_time_unix_nano
                    t1 = span.end_time_unix_nano
                    start.append(t0)
                    end.append(t1)
                    duration.append(t1 - t0)
                    status = span.status
                    status_code.append(status.code)
                    status_message.append(status.message)
                    step = attrs.get(step_key)
                    step_col.append(step if step is None or type(step) is int else as_int(step))
                    rank = attrs.get(rank_key)
                    rank_col.append(resource_rank if rank is None else as_int(rank))
                    try:
                        attrs_col.append(_encode_json(attrs) if attrs else _EMPTY_OBJECT_JSON)
                    except ValueError:
                        attrs_col.append(to_json(attrs))
                    events, links = span.events, span.links
                    if (
                        span.dropped_attributes_count or span.dropped_events_count
                        or span.dropped_links_count or len(events) > MAX_ITEMS
                        or len(links) > MAX_ITEMS
                    ):
                        attrs_col[-1] = to_json(_with_dropped(attrs, span))
                        events, links = events[:MAX_ITEMS], links[:MAX_ITEMS]
                    events_col.append(_events_json(events) if events else _EMPTY_LIST_JSON)
                    links_col.append(_links_json(links) if links else _EMPTY_LIST_JSON)
                    count += 1
            self._extend_resource(resource_attrs, job, service, count)
            added += count
        self._rows += added
        return added

    def table(self) -> pa.Table:
        """An Arrow table with the store's span columns (resource columns dictionary-encoded)."""
        self._seal()
        indices = pa.array(self._resource_of_span, type=pa.int32())
        resources = list(self._resource_index)  # insertion order is index order
        arrays: list[Any] = []
        for column, _, typ in store.SPAN_COLUMNS:
            if column in self.RESOURCE_COLUMNS:
                position = self.RESOURCE_COLUMNS.index(column)
                dictionary = pa.array([r[position] for r in resources], type=pa.string())
                arrays.append(pa.DictionaryArray.from_arrays(indices, dictionary))
            elif column == "pid":
                arrays.append(pa.array(self.pid, type=typ))
            elif len(self._chunks) == 1:
                arrays.append(self._chunks[0][column])
            else:
                arrays.append(pa.chunked_array([c[column] for c in self._chunks], type=typ))
        return pa.Table.from_arrays(arrays, names=[c for c, _, _ in store.SPAN_COLUMNS])


class MetricColumns:
    """One row per metric data point.

    Gauges and sums give `value` (the point's double or int); histograms and
    exponential histograms give one row per point with `value` = sum and the count,
    min, max, bucket bounds and counts in `attributes` under `flare.histogram.*`;
    summaries give value = sum plus count and quantiles the same way.
    """

    __slots__ = ("attributes", "job", "name", "rank", "time_ns", "unit", "value")

    def __init__(self) -> None:
        for column in self.__slots__:
            setattr(self, column, [])

    def __len__(self) -> int:
        return len(self.name)

    def _row(
        self, job: str, rank: int | None, name: str, unit: str, point: Any,
        value: float | None, extra: dict[str, Any], resource_attrs: dict[str, Any],
    ) -> None:
        attrs = dict(resource_attrs)
        attrs.update(attributes_dict(point.attributes))
        attrs.update(extra)
        point_rank = as_int(attrs.get(semconv.RANK))
        self.job.append(job)
        self.rank.append(rank if point_rank is None else point_rank)
        self.name.append(name)
        self.time_ns.append(point.time_unix_nano)
        self.value.append(value)
        self.unit.append(unit)
        self.attributes.append(to_json(attrs))

    def add_request(self, request: Any) -> int:
        before = len(self)
        for resource_metrics in request.resource_metrics:
            resource_attrs = attributes_dict(resource_metrics.resource.attributes)
            job, _, rank = resource_identity(resource_attrs)
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    self._add_metric(job, rank, metric, resource_attrs)
        return len(self) - before

    def _add_metric(
        self, job: str, rank: int | None, metric: Any, resource_attrs: dict[str, Any]
    ) -> None:
        data = metric.WhichOneof("data")
        name, unit = metric.name, metric.unit
        if data in ("gauge", "sum"):
            for point in getattr(metric, data).data_points:
                which = point.WhichOneof("value")
                value = float(getattr(point, which)) if which else None
                self._row(job, rank, name, unit, point, value, {}, resource_attrs)
        elif data == "histogram":
            for point in metric.histogram.data_points:
                extra = {
                    "flare.histogram.count": point.count,
                    "flare.histogram.bounds": list(point.explicit_bounds),
                    "flare.histogram.bucket_counts": list(point.bucket_counts),
                }
                if point.HasField("min"):
                    extra["flare.histogram.min"] = point.min
                if point.HasField("max"):
                    extra["flare.histogram.max"] = point.max
                value = point.sum if point.HasField("sum") else None
                self._row(job, rank, name, unit, point, value, extra, resource_attrs)
        elif data == "exponential_histogram":
            for point in metric.exponential_histogram.data_points:
                extra = {
                    "flare.histogram.count": point.count,
                    "flare.histogram.scale": point.scale,
                    "flare.histogram.zero_count": point.zero_count,
                    "flare.histogram.positive_offset": point.positive.offset,
                    "flare.histogram.positive_counts": list(point.positive.bucket_counts),
                    "flare.histogram.negative_offset": point.negative.offset,
                    "flare.histogram.negative_counts": list(point.negative.bucket_counts),
                }
                value = point.sum if point.HasField("sum") else None
                self._row(job, rank, name, unit, point, value, extra, resource_attrs)
        elif data == "summary":
            for point in metric.summary.data_points:
                extra = {
                    "flare.histogram.count": point.count,
                    "flare.summary.quantiles": [
                        [q.quantile, q.value] for q in point.quantile_values
                    ],
                }
                self._row(job, rank, name, unit, point, point.sum, extra, resource_attrs)

    def table(self) -> pa.Table:
        arrays = [
            pa.array(getattr(self, column), type=typ) for column, _, typ in store.METRIC_COLUMNS
        ]
        return pa.Table.from_arrays(arrays, schema=store.METRIC_SCHEMA)
