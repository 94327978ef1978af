"""OTLP/JSON: hex ids (where plain proto3 JSON would read base64), unknown fields ignored."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.collector import otlp_json
from flare.collector.errors import MalformedPayload

TRACE_ID = "5b8efff798038103d269b633813fc60c"
SPAN_ID = "eee19b7ec3c1b174"
PARENT_ID = "eee19b7ec3c1b173"

# The example shape from the OTLP specification's JSON encoding section.
SPEC_EXAMPLE = {
    "resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "my.service"}}]},
        "scopeSpans": [{
            "scope": {"name": "my.library", "version": "1.0.0"},
            "spans": [{
                "traceId": TRACE_ID, "spanId": SPAN_ID, "parentSpanId": PARENT_ID,
                "name": "I'm a server span", "startTimeUnixNano": "1544712660000000000",
                "endTimeUnixNano": "1544712661000000000", "kind": 2,
                "attributes": [{"key": "my.span.attr", "value": {"intValue": "42"}}],
                "links": [{"traceId": TRACE_ID, "spanId": PARENT_ID}],
                "someFutureField": {"ignored": True},
            }],
        }],
    }]
}


def test_hex_ids_decode_to_the_right_bytes():
    request = otlp_json.parse(json.dumps(SPEC_EXAMPLE).encode(), ExportTraceServiceRequest)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id.hex() == TRACE_ID and span.span_id.hex() == SPAN_ID
    assert span.parent_span_id.hex() == PARENT_ID and span.links[0].span_id.hex() == PARENT_ID
    assert span.kind == 2 and span.attributes[0].value.int_value == 42


def test_plain_json_format_gets_the_ids_wrong():
    # Why the receiver re-encodes: proto3 JSON reads `bytes` as base64.
    message = ExportTraceServiceRequest()
    json_format.ParseDict(SPEC_EXAMPLE, message, ignore_unknown_fields=True)
    assert message.resource_spans[0].scope_spans[0].spans[0].trace_id.hex() != TRACE_ID


def test_round_trip_writes_hex():
    request = otlp_json.parse(json.dumps(SPEC_EXAMPLE).encode(), ExportTraceServiceRequest)
    doc = json.loads(otlp_json.dumps(request))
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == TRACE_ID and span["links"][0]["spanId"] == PARENT_ID


def test_metric_exemplar_ids():
    doc = {"resourceMetrics": [{"scopeMetrics": [{"metrics": [{
        "name": "m", "sum": {"dataPoints": [{"asInt": "1", "exemplars": [
            {"traceId": TRACE_ID, "spanId": SPAN_ID, "asDouble": 1.5}]}]}}]}]}]}
    request = otlp_json.parse(json.dumps(doc).encode(), ExportMetricsServiceRequest)
    exemplar = request.resource_metrics[0].scope_metrics[0].metrics[0].sum.data_points[0].exemplars[0]
    assert exemplar.trace_id.hex() == TRACE_ID and exemplar.span_id.hex() == SPAN_ID


@pytest.mark.parametrize("body", [
    b"", b"null", b"[]", b'{"resourceSpans": {}}', b'{"resourceSpans": [{"scopeSpans": [{"spans": [1]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "xyz"}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 12}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "soon"}]}]}]}',
])
def test_malformed_json_is_a_clear_error(body):
    with pytest.raises(MalformedPayload):
        otlp_json.parse(body, ExportTraceServiceRequest)
