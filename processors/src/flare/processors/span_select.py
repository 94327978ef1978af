"""The spans and attributes the rank correlator reads, picked out of a trace request.

The correlator sees every span the collector receives but reads only a few span
names and a few attribute keys. Through the protobuf Python API every attribute
access allocates, so `_span_select.c` scans the serialized request instead and
materialises only what is wanted; `select_python` below is the reference it must
match (tests/processors/test_span_select.py) and what runs where the extension was
not built.

A record is `(name, trace_id, span_id, start_ns, end_ns, attributes)`, ids as bytes,
attributes as `{key: value}` of the wanted keys (arrays as tuples, maps as dicts).
"""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.processors.otlp_values import pick

try:
    from flare.processors import _span_select
except ImportError:  # built without a C compiler: same records, slower
    _span_select = None

SpanRecord = tuple[str, bytes, bytes, int, int, dict[str, Any]]


class Selection:
    """Which spans (exact names, or a name prefix minus exclusions) and keys to keep."""

    def __init__(
        self, names: tuple[str, ...], prefix: str, excluded: tuple[str, ...], skip_scope: str,
        span_keys: tuple[str, ...], resource_keys: tuple[str, ...],
    ) -> None:
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

    def select(self, request: ExportTraceServiceRequest) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        if _span_select is None:
            return self.select_python(request)
        try:
            return self.select_payload(request.SerializeToString())
        except ValueError:
            # A parsed request always re-serialises to valid bytes, so this is the C
            # scanner disagreeing with protobuf: never lose the request over it.
            self.fallbacks += 1
            return self.select_python(request)

    def select_encoded(
        self, request: ExportTraceServiceRequest, payload: bytes
    ) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        """`select` from the bytes `request` arrived as (no re-serialising)."""
        if _span_select is None:
            return self.select_python(request)
        try:
            return self.select_payload(payload)
        except ValueError:
            # The sender's encoding parsed with protobuf but not with the C scanner
            # (e.g. a field layout it does not expect): the reference reads it.
            self.fallbacks += 1
            return self.select_python(request)

    def select_payload(self, payload: bytes) -> list[tuple[dict[str, Any], list[SpanRecord]]]:
        if _span_select is None:
            return self.select_python(ExportTraceServiceRequest.FromString(payload))
        return _span_select.select_spans(
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
