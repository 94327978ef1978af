"""The spans and attributes the rank correlator reads, picked out of a trace request.

The correlator sees every span the collector receives but reads only a few span
names and a few attribute keys. Through the protobuf Python API every attribute
access allocates, so the C readers' `select_spans` (flare.processors._otlp_read,
csrc/otlp_read/picker.c) scans the serialized request instead and materialises only what is
wanted; `select_python` below is the reference it must match (tests/processors/
test_span_select.py) and what runs where the extension was not built.

A record is `(name, trace_id, span_id, start_ns, end_ns, attributes)`, ids as bytes,
attributes as `{key: value}` of the wanted keys (arrays as tuples, maps as dicts).

With `compact=True` (and a `step` spec), the C picker returns a qualifying step span
as `(name, trace_id, span_id, start_ns, end_ns, rank, step, wait, names, waits,
seqs)` instead: the values the correlator derives from its attributes, without the
dict in between. `compact_step` is the reference for which spans qualify and what
they become; the Python path never compacts (the correlator reads both forms).
"""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.processors.otlp_values import pick

try:
    from flare.processors import _otlp_read
except ImportError:  # built without a C compiler: same records, slower
    _otlp_read = None

SpanRecord = tuple[str, bytes, bytes, int, int, dict[str, Any]]

# The C picker's compact step record, told from a dict-form record (6 fields) by its
# length: (name, trace_id, span_id, start_ns, end_ns, rank, step, wait, names, waits, seqs).
COMPACT_STEP_FIELDS = 11

# A step span reads: (span name, rank, step, wait, PG names, PG waits, PG sequence keys).
StepKeys = tuple[str, str, str, str, str, str, str]


def compact_step(record: SpanRecord, step: StepKeys, span_keys: frozenset[str]) -> tuple:
    """What the C picker returns for `record` (a dict-form record of a step span): the
    compact tuple when every step key is absent or of its expected type (rank and step
    int, wait float, the PG arrays as tuples of str, float and int, the latter two as
    long as the names) and the span carries no other wanted key; else `record` itself.
    Without PG names the three arrays are empty whatever the other two hold."""
    name, trace_id, span_id, start_ns, end_ns, attrs = record
    if name != step[0] or any(key not in step[1:] for key in attrs):
        return record
    _, rank_key, step_key, wait_key, names_key, waits_key, seqs_key = step
    rank, step_no, wait = attrs.get(rank_key), attrs.get(step_key), attrs.get(wait_key)
    if (rank_key in attrs and type(rank) is not int) or (step_key in attrs and type(step_no) is not int) \
            or (wait_key in attrs and type(wait) is not float):
        return record
    arrays = []
    for key, kind in ((names_key, str), (waits_key, float), (seqs_key, int)):
        value = attrs.get(key, ())
        if type(value) is not tuple or len(value) > 64 or any(type(v) is not kind for v in value):
            return record
        arrays.append(value)
    names, waits, seqs = arrays
    if names and (len(waits) != len(names) or len(seqs) != len(names)):
        return record
    if not names:
        waits = seqs = ()
    return (name, trace_id, span_id, start_ns, end_ns, rank, step_no, wait, names, waits, seqs)


class Selection:
    """Which spans (exact names, or a name prefix minus exclusions) and keys to keep."""

    def __init__(
        self, names: tuple[str, ...], prefix: str, excluded: tuple[str, ...], skip_scope: str,
        span_keys: tuple[str, ...], resource_keys: tuple[str, ...], step: StepKeys | None = None,
    ) -> None:
        if step is not None and (len(step) != 7 or not set(step[1:]) <= set(span_keys)):
            raise ValueError("step: a span name and six keys, all among span_keys")
        self.step = step
        self.names, self.prefix, self.excluded = names, prefix, excluded
        self.skip_scope = skip_scope
        self.span_keys, self.resource_keys = span_keys, resource_keys
        self._names = frozenset(names)
        self._excluded = frozenset(excluded)
        self._span_keys = frozenset(span_keys)
        self._resource_keys = frozenset(resource_keys)
        self.fallbacks = 0  # requests the C scanner refused and the reference handled

    def wanted(self, name: str) -> bool:
        return name in self._names or (name.startswith(self.prefix) and name not in self._excluded)

    def select(
        self, request: ExportTraceServiceRequest, compact: bool = False
    ) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        if _otlp_read is None:
            return self.select_python(request)
        try:
            return self.select_payload(request.SerializeToString(), compact)
        except ValueError:
            # A parsed request always re-serialises to valid bytes, so this is the C
            # scanner disagreeing with protobuf: never lose the request over it.
            self.fallbacks += 1
            return self.select_python(request)

    def select_encoded(
        self, request: ExportTraceServiceRequest, payload: bytes, compact: bool = False
    ) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        """`select` from the bytes `request` arrived as (no re-serialising)."""
        if _otlp_read is None:
            return self.select_python(request)
        try:
            return self.select_payload(payload, compact)
        except ValueError:
            # The sender's encoding parsed with protobuf but not with the C scanner
            # (e.g. a field layout it does not expect): the reference reads it.
            self.fallbacks += 1
            return self.select_python(request)

    def select_payload(
        self, payload: bytes, compact: bool = False
    ) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        """Records from the bytes; with `compact` (and a `step` spec), qualifying step
        spans in the compact form (module docstring)."""
        if _otlp_read is None:
            return self.select_python(ExportTraceServiceRequest.FromString(payload))
        if compact and self.step is not None:
            return _otlp_read.select_spans(
                payload, self.names, self.prefix, self.excluded, self.skip_scope,
                self.span_keys, self.resource_keys, self.step,
            )
        return _otlp_read.select_spans(
            payload, self.names, self.prefix, self.excluded, self.skip_scope,
            self.span_keys, self.resource_keys,
        )

    def select_python(
        self, request: ExportTraceServiceRequest
    ) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        out = []
        for resource_spans in request.resource_spans:
            records: list[SpanRecord] = []
            for scope_spans in resource_spans.scope_spans:
                if scope_spans.scope.name == self.skip_scope:
                    continue
                for span in scope_spans.spans:
                    name = span.name
                    if self.wanted(name):
                        records.append((
                            name, bytes(span.trace_id), bytes(span.span_id),
                            span.start_time_unix_nano, span.end_time_unix_nano,
                            pick(span.attributes, self._span_keys),
                        ))
            out.append((pick(resource_spans.resource.attributes, self._resource_keys), records))
        return out
