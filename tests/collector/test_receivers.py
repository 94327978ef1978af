"""OTLP over gRPC and HTTP into a real collector process, by real clients."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
import zlib

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from flare.collector import otlp_json
from flare.exporters import store

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _query(proc, sql, params=()):
    con = store.open_reader(proc.store_path, timeout_s=30)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def _wait_committed(proc):
    """Until everything acknowledged so far is committed to the store."""
    last = proc.scrape()["flare_collector_wal_last_lsn"]
    proc.wait_for("flare_collector_wal_committed_lsn", lambda v: v >= last)


def test_sdk_exporters_over_grpc_and_http_land_in_the_store(shared_collector):
    proc = shared_collector
    resource = Resource.create({"service.name": "sdk-test", "flare.job.id": "sdk-job", "flare.rank": 3})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(GrpcSpanExporter(endpoint=proc.grpc, insecure=True)))
    provider.add_span_processor(SimpleSpanProcessor(HttpSpanExporter(endpoint=f"http://{proc.http}/v1/traces")))
    provider.add_span_processor(SimpleSpanProcessor(
        GrpcSpanExporter(endpoint=proc.grpc, insecure=True, compression=grpc.Compression.Gzip)))
    provider.add_span_processor(SimpleSpanProcessor(
        HttpSpanExporter(endpoint=f"http://{proc.http}/v1/traces", compression=HttpCompression.Gzip)))
    tracer = provider.get_tracer("test")
    for step in range(4):
        with tracer.start_as_current_span("train.step", attributes={"flare.step": step}):
            pass
    provider.shutdown()

    readers = [
        PeriodicExportingMetricReader(GrpcMetricExporter(endpoint=proc.grpc, insecure=True), export_interval_millis=60_000),
        PeriodicExportingMetricReader(HttpMetricExporter(endpoint=f"http://{proc.http}/v1/metrics"), export_interval_millis=60_000),
    ]
    meters = MeterProvider(resource=resource, metric_readers=readers)
    meters.get_meter("test").create_counter("sdk.test.counter").add(5)
    meters.shutdown()  # exports once through each reader

    _wait_committed(proc)
    rows = _query(proc, "SELECT step, count(*) FROM spans WHERE job = 'sdk-job' AND name = 'train.step' "
                        "AND rank = 3 GROUP BY step ORDER BY step")
    assert rows == [(step, 4) for step in range(4)]  # once per transport and compression
    points = _query(proc, "SELECT count(*), max(value) FROM metrics WHERE name = 'sdk.test.counter'")
    assert points == [(2, 5.0)]


def test_http_json_with_hex_ids_keeps_the_ids(shared_collector, helpers):
    proc = shared_collector
    request = helpers.make_request(3, job="json-job", rank=1)
    body = otlp_json.dumps(request)
    doc = json.loads(body)
    hex_id = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    assert len(hex_id) == 32 and int(hex_id, 16) == 1  # hex on the wire, as the spec says
    status, headers, reply = helpers.post(f"http://{proc.http}/v1/traces", body, "application/json")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(reply) == {}  # a full success has no partialSuccess
    _wait_committed(proc)
    rows = _query(proc, "SELECT DISTINCT trace_id FROM spans WHERE job = 'json-job'")
    assert rows == [(hex_id,)]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_http_compressed_protobuf(shared_collector, helpers, encoding):
    proc = shared_collector
    job = f"{encoding}-job"
    raw = helpers.make_request(50, job=job).SerializeToString()
    body = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    status, _, reply = helpers.post(f"http://{proc.http}/v1/traces", body, headers={"Content-Encoding": encoding})
    assert status == 200, reply
    assert not ExportTraceServiceResponse.FromString(reply).HasField("partial_success")
    _wait_committed(proc)
    assert _query(proc, "SELECT count(*) FROM spans WHERE job = ?", [job]) == [(50,)]


def test_partial_success_rejects_only_unusable_spans(shared_collector, helpers):
    proc = shared_collector
    request = helpers.make_request(4, job="partial-http")
    spans = request.resource_spans[0].scope_spans[0].spans
    spans[1].trace_id = bytes(16)  # all-zero trace id: invalid
    spans[2].span_id = b"\x01\x02"  # wrong length
    status, _, reply = helpers.post(f"http://{proc.http}/v1/traces", request.SerializeToString())
    assert status == 200
    partial = ExportTraceServiceResponse.FromString(reply).partial_success
    assert partial.rejected_spans == 2 and "trace_id" in partial.error_message

    request = helpers.make_request(3, job="partial-grpc")
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = b""
    with grpc.insecure_channel(proc.grpc) as channel:
        reply = channel.unary_unary(TRACE_METHOD)(request.SerializeToString(), timeout=30)
    assert ExportTraceServiceResponse.FromString(reply).partial_success.rejected_spans == 1

    _wait_committed(proc)
    counts = dict(_query(proc, "SELECT job, count(*) FROM spans WHERE job LIKE 'partial-%' GROUP BY job"))
    assert counts == {"partial-http": 2, "partial-grpc": 2}


def test_malformed_and_garbage_payloads_are_400_and_store_nothing(shared_collector, helpers):
    proc = shared_collector
    url = f"http://{proc.http}/v1/traces"
    scraped = proc.scrape()
    before = scraped["flare_collector_wal_last_lsn"]
    malformed = scraped.get("flare_collector_malformed_requests_total", 0)
    unsupported = scraped.get("flare_collector_unsupported_requests_total", 0)
    status, headers, reply = helpers.post(url, b"\xff\xff\xff garbage")
    assert status == 400 and headers["Content-Type"] == "application/x-protobuf"
    assert status_pb2.Status.FromString(reply).message  # a google.rpc.Status saying why
    for bad_json in (b"{not json", b"[1, 2]", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
                     b'{"resourceSpans": "nope"}'):
        status, _, reply = helpers.post(url, bad_json, "application/json")
        assert status == 400, bad_json
        assert json.loads(reply)["message"]
    status, _, _ = helpers.post(url, gzip.compress(b"x")[:-4], headers={"Content-Encoding": "gzip"})
    assert status == 400  # truncated gzip
    status, _, _ = helpers.post(url, b"plain", headers={"Content-Encoding": "gzip"})
    assert status == 400  # not gzip at all
    status, _, _ = helpers.post(url, b"x", headers={"Content-Encoding": "br"})
    assert status == 400  # an encoding the collector does not take
    status, _, _ = helpers.post(url, b"{}", "text/plain")
    assert status == 415
    status, _, _ = helpers.post(f"http://{proc.http}/v1/logs", b"")
    assert status == 404
    with pytest.raises(urllib.error.HTTPError) as not_post:
        urllib.request.urlopen(url, timeout=10)
    assert not_post.value.code == 405
    # every refusal is counted, so an operator sees a misconfigured sender on /metrics
    scraped = proc.scrape()
    assert scraped["flare_collector_malformed_requests_total"] - malformed == 1 + 4 + 3
    assert scraped["flare_collector_unsupported_requests_total"] - unsupported == 3
    with grpc.insecure_channel(proc.grpc) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(TRACE_METHOD)(b"\xff\xff\xff garbage", timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert proc.scrape()["flare_collector_wal_last_lsn"] == before  # nothing logged
    assert proc.proc.poll() is None  # and the collector is still up


def test_oversized_bodies_are_refused(shared_collector, helpers):
    proc = shared_collector
    url = f"http://{proc.http}/v1/traces"
    big = helpers.make_request(15_000, job="too-big").SerializeToString()
    assert len(big) > 1 << 20
    status, _, _ = helpers.post(url, big)
    assert status == 413
    bomb = gzip.compress(b"\x00" * (8 << 20))  # 8 MiB of zeros in a few KiB
    status, _, _ = helpers.post(url, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413
    with grpc.insecure_channel(proc.grpc) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(TRACE_METHOD)(big, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Still serving afterwards.
    status, _, _ = helpers.post(url, helpers.make_request(1, job="after-big").SerializeToString())
    assert status == 200


def test_empty_request_is_ok_without_logging(shared_collector, helpers):
    proc = shared_collector
    before = proc.scrape()["flare_collector_wal_last_lsn"]
    status, _, reply = helpers.post(f"http://{proc.http}/v1/traces", ExportTraceServiceRequest().SerializeToString())
    assert status == 200 and reply == b""
    status, _, reply = helpers.post(f"http://{proc.http}/v1/metrics", b"{}", "application/json")
    assert status == 200 and json.loads(reply) == {}
    assert proc.scrape()["flare_collector_wal_last_lsn"] == before


def test_id_check_on_the_wire_agrees_with_the_check_on_the_parsed_request():
    """The C pass over the bytes and the Python loop count the same spans as unusable."""
    import random

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    from flare.collector import validate

    if validate._check_span_ids is None:
        pytest.skip("flare.exporters built without its C decoder")
    rng = random.Random(5)
    ids = [b"", bytes(8), bytes(16), b"\x01" * 7, b"\x01" * 8, b"\x01" * 9, b"\x01" * 16,
           b"\x00" * 15 + b"\x01", b"\x01" * 17]
    for _ in range(400):
        request = ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(scope_spans=[
                ScopeSpans(spans=[
                    Span(trace_id=rng.choice(ids[5:] if rng.random() < 0.8 else ids),
                         span_id=rng.choice(ids[3:6] if rng.random() < 0.8 else ids),
                         parent_span_id=rng.choice([b"", b"\x02" * 8] if rng.random() < 0.9 else ids),
                         name="s")
                    for _ in range(rng.randrange(0, 4))
                ])
                for _ in range(rng.randrange(0, 3))
            ])
            for _ in range(rng.randrange(1, 3))
        ])
        payload = request.SerializeToString()
        if rng.random() < 0.2:  # a field repeated on the wire: the last one counts
            payload += ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[
                ScopeSpans(spans=[Span(trace_id=b"\x03" * 16, span_id=b"\x04" * 8)])])]).SerializeToString()
        on_wire = ExportTraceServiceRequest.FromString(payload)
        in_python = ExportTraceServiceRequest.FromString(payload)
        assert validate.check_traces(on_wire, payload) == validate.check_traces(in_python)
        assert on_wire == in_python
    spans, bad = validate._check_span_ids(
        ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
            spans=[Span(trace_id=b"\x01" * 16, span_id=b"\x01" * 8), Span(span_id=b"\x01" * 8)])])])
        .SerializeToString())
    assert (spans, bad) == (2, 1)


def test_wire_check_is_sure_only_of_what_protobuf_parses():
    """The receivers skip parsing a trace request when `check_traces_wire` is sure of it:
    on valid and damaged requests (bytes changed, cut, inserted; invalid UTF-8; unknown
    fields) it must never be sure of bytes protobuf refuses, and must count the spans
    protobuf finds; it must be sure of the plain requests Flare's SDK sends."""
    import random

    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import (
        AnyValue,
        ArrayValue,
        KeyValue,
        KeyValueList,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

    from flare.collector import validate

    if validate._TRACES_SCHEMA is None:
        pytest.skip("flare.exporters built without its C decoder")
    rng = random.Random(11)

    def any_value(depth: int = 0) -> AnyValue:
        kind = rng.randrange(7 if depth < 3 else 5)
        if kind == 0:
            return AnyValue(string_value=rng.choice(["x", "é", "€ok", "\U0001f600", ""]))
        if kind == 1:
            return AnyValue(int_value=rng.choice([0, 1, -1, 2**63 - 1, -(2**63)]))
        if kind == 2:
            return AnyValue(double_value=rng.random())
        if kind == 3:
            return AnyValue(bool_value=True)
        if kind == 4:
            return AnyValue(bytes_value=bytes(rng.randrange(256) for _ in range(3)))
        if kind == 5:
            return AnyValue(array_value=ArrayValue(values=[any_value(depth + 1) for _ in range(2)]))
        return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="k", value=any_value(depth + 1))]))

    def span() -> Span:
        out = Span(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), name="s",
                   parent_span_id=rng.choice([b"", rng.randbytes(8)]), kind=rng.randrange(6),
                   start_time_unix_nano=rng.randrange(1 << 64), end_time_unix_nano=rng.randrange(1 << 64),
                   attributes=[KeyValue(key=f"a{i}", value=any_value()) for i in range(rng.randrange(4))],
                   status=Status(code=rng.randrange(3), message="m"), flags=rng.randrange(1 << 32))
        out.events.add(name="e", time_unix_nano=5).attributes.add(key="k").value.int_value = 3
        out.links.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8))
        return out

    plain = []
    for _ in range(60):
        request = ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(scope_spans=[ScopeSpans(spans=[span() for _ in range(rng.randrange(4))])])
            for _ in range(rng.randrange(1, 3))
        ])
        request.resource_spans[0].resource.attributes.add(key="service.name").value.string_value = "svc"
        payload = request.SerializeToString()
        checked = validate.check_traces_wire(payload)
        assert checked == validate.check_traces(ExportTraceServiceRequest.FromString(payload))
        plain.append(payload)
    sure = 0
    for _ in range(6000):
        payload = bytearray(rng.choice(plain))
        for _ in range(rng.choice([1, 1, 2, 4])):
            i = rng.randrange(len(payload) + 1)
            roll = rng.random()
            if roll < 0.4 and i < len(payload):
                payload[i] = rng.randrange(256)
            elif roll < 0.6:
                del payload[i:i + rng.randrange(1, 4)]
            else:
                payload[i:i] = rng.choice([b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                                           b"\xe2\x82\xac", b"\x80", b"\x08\x96\x01", b"\xf8\x07\x01"])
        payload = bytes(payload)
        checked = validate.check_traces_wire(payload)
        if checked is None:
            continue
        sure += 1
        try:
            request = ExportTraceServiceRequest.FromString(payload)
        except DecodeError:
            pytest.fail(f"sure of bytes protobuf refuses: {payload!r}")
        assert checked == validate.check_traces(request), payload
    assert sure > 100  # the damage left many requests valid, and the check saw that
    # Invalid UTF-8 in a string and an unknown field: parsed by protobuf, as before.
    bad_text = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
        spans=[Span(trace_id=b"\x01" * 16, span_id=b"\x01" * 8, name="\u00e9")])])]).SerializeToString()
    assert validate.check_traces_wire(bad_text.replace("\u00e9".encode(), b"\xc3\x28")) is None
    assert validate.check_traces_wire(bad_text + b"\xf8\x07\x01") is None
    assert validate.check_traces_wire(bad_text) == validate.Checked(1, 0, "")


def test_unparsed_and_parsed_requests_are_answered_alike(collector_process, helpers):
    """A request the wire check is sure of (not parsed), one with an unknown field (parsed)
    and one with an unusable span id (parsed, partial success) are stored alike."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    collector = collector_process().start()
    good = helpers.make_request(3, first_index=0)
    unknown_field = helpers.make_request(3, first_index=10).SerializeToString() + b"\xf8\x07\x01"
    one_bad = helpers.make_request(3, first_index=20)
    one_bad.resource_spans[0].scope_spans[0].spans[1].span_id = bytes(8)
    replies = []
    for body in (good.SerializeToString(), unknown_field, one_bad.SerializeToString()):
        status, _, reply = helpers.post(f"http://{collector.http}/v1/traces", body)
        assert status == 200
        replies.append(ExportTraceServiceResponse.FromString(reply))
    assert [r.partial_success.rejected_spans for r in replies] == [0, 0, 1]
    collector.terminate()
    assert len(helpers.stored_span_ids(collector.store_path)) == 8
