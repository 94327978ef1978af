"""The processor interface: OTLP requests in, OTLP requests out (like otelcol pdata).

A processor maps one request to one request (or None when it keeps the data, as
`batch` does), may emit requests of its own on `tick` (windows that closed) and on
`shutdown`, and reports its own counters through `metrics()`, which the collector
exports as its self-telemetry.
"""

from __future__ import annotations

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Processor:
    def process_traces(self, request: ExportTraceServiceRequest) -> ExportTraceServiceRequest | None:
        return request

    def process_traces_encoded(
        self, request: ExportTraceServiceRequest, payload: bytes
    ) -> ExportTraceServiceRequest | None:
        """`process_traces` for a caller that also holds the request's serialized bytes
        (`payload` encodes exactly `request`): a processor that reads the wire format
        overrides this to skip re-serialising."""
        return self.process_traces(request)

    def process_metrics(
        self, request: ExportMetricsServiceRequest
    ) -> ExportMetricsServiceRequest | None:
        return request

    def tick(self, now_ns: int) -> list[ExportTraceServiceRequest]:
        return []

    def metrics(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> list[ExportTraceServiceRequest]:
        return []


def span_count(request: ExportTraceServiceRequest) -> int:
    return sum(
        len(scope_spans.spans)
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
    )
