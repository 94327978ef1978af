"""OTLP requests built from synthetic span rows, as a training job would send them."""

from __future__ import annotations

import json

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from flare.wire import semconv as sc


def _any(value):
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, list):
        return common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[_any(v) for v in value]))
    return common_pb2.AnyValue(string_value=str(value))


def _otlp_request(rows: list[dict], job: str = "jobE", world: int = 4) -> trace_service_pb2.ExportTraceServiceRequest:
    by_rank: dict[int, list] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(trace_pb2.Span(
            trace_id=bytes.fromhex(row["trace_id"]), span_id=bytes.fromhex(row["span_id"]),
            name=row["name"], kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=row["start_ns"], end_time_unix_nano=row["end_ns"],
            attributes=[common_pb2.KeyValue(key=k, value=_any(v))
                        for k, v in json.loads(row["attributes"]).items()],
        ))
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[
        trace_pb2.ResourceSpans(
            resource=resource_pb2.Resource(attributes=[
                common_pb2.KeyValue(key=k, value=_any(v)) for k, v in {
                    sc.SERVICE_NAME: job, sc.JOB_ID: job, sc.RANK: rank,
                    sc.WORLD_SIZE: world}.items()]),
            scope_spans=[trace_pb2.ScopeSpans(spans=spans)])
        for rank, spans in by_rank.items()])



@pytest.fixture
def otlp_request():
    """rows (dicts in the store's span schema) → one ExportTraceServiceRequest."""
    return _otlp_request
