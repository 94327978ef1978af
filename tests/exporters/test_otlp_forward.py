"""The otlp forwarding exporter against real loopback OTLP servers (gRPC and HTTP)."""

from __future__ import annotations

import gzip
import http.server
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as msvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as mpb
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.exporters import REGISTRY
from flare.exporters.otlp import OtlpExporter


def traces(n: int, tag: str = "x") -> tsvc.ExportTraceServiceRequest:
    spans = [Span(trace_id=b"\x01" * 16, span_id=i.to_bytes(8, "big"), name=f"{tag}{i}")
             for i in range(1, n + 1)]
    return tsvc.ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": [KeyValue(key="service.name", value=AnyValue(string_value="svc"))]},
        scope_spans=[ScopeSpans(spans=spans)],
    )])


def names(req: tsvc.ExportTraceServiceRequest) -> list[str]:
    return [s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TraceService(tgrpc.TraceServiceServicer):
    """Accepts everything, except that the first `fail_first` calls get UNAVAILABLE
    with a RetryInfo of `retry_delay_s` (what a real collector under load sends)."""

    def __init__(self, fail_first: int = 0, retry_delay_s: float = 0.2, reject: int = 0) -> None:
        self.received: list[tsvc.ExportTraceServiceRequest] = []
        self.calls: list[float] = []
        self.fail_first = fail_first
        self.retry_delay_s = retry_delay_s
        self.reject = reject
        self.metadata: list[dict] = []

    def Export(self, request, context):
        self.calls.append(time.monotonic())
        self.metadata.append(dict(context.invocation_metadata()))
        if len(self.calls) <= self.fail_first:
            info = error_details_pb2.RetryInfo(
                retry_delay=duration_pb2.Duration(nanos=int(self.retry_delay_s * 1e9))
            )
            detail = any_pb2.Any()
            detail.Pack(info)
            status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message="busy", details=[detail])
            context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        self.received.append(request)
        response = tsvc.ExportTraceServiceResponse()
        if self.reject:
            response.partial_success.rejected_spans = self.reject
            response.partial_success.error_message = "some spans rejected"
        return response


@pytest.fixture
def grpc_server():
    servers = []

    def start(service: TraceService) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        tgrpc.add_TraceServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return port

    yield start
    for server in servers:
        server.stop(grace=None)


def test_grpc_forwarding_delivers_in_order_with_headers(grpc_server):
    service = TraceService(reject=1)
    port = grpc_server(service)
    exporter = REGISTRY["otlp"](endpoint=f"127.0.0.1:{port}", headers={"X-Tenant": "flare"})
    assert exporter.protocol == "grpc"
    for tag in ("a", "b", "c"):
        exporter.export_traces(traces(2, tag))
    assert exporter.wait_idle(10)
    assert [names(r) for r in service.received] == [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]
    assert service.metadata[0]["x-tenant"] == "flare"
    m = exporter.metrics()
    assert m["sent_requests"] == 3 and m["rejected_items"] == 3 and m["sent_items"] == 3
    exporter.shutdown()


def test_grpc_retry_honours_retry_info(grpc_server):
    service = TraceService(fail_first=2, retry_delay_s=0.3)
    port = grpc_server(service)
    # A 10 s backoff would blow the test's time: only honouring RetryInfo passes.
    exporter = OtlpExporter(endpoint=f"127.0.0.1:{port}",
                            retry_on_failure={"initial_interval": "10s"})
    t0 = time.monotonic()
    exporter.export_traces(traces(1))
    assert exporter.wait_idle(8)
    assert time.monotonic() - t0 < 5
    assert len(service.calls) == 3 and len(service.received) == 1
    gaps = [b - a for a, b in zip(service.calls, service.calls[1:], strict=False)]
    assert all(gap >= 0.25 for gap in gaps)
    assert exporter.metrics()["retries"] == 2
    exporter.shutdown()


def test_metrics_forwarded_too(grpc_server):
    port = grpc_server(TraceService())
    received = []

    class MetricsService:
        def Export(self, request, context):
            received.append(request)
            return msvc.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc

    mgrpc.add_MetricsServiceServicer_to_server(MetricsService(), server)
    mport = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        exporter = OtlpExporter(endpoint=f"127.0.0.1:{mport}")
        metric = mpb.Metric(name="m", gauge=mpb.Gauge(data_points=[mpb.NumberDataPoint(as_double=1.0)]))
        exporter.export_metrics(msvc.ExportMetricsServiceRequest(resource_metrics=[
            mpb.ResourceMetrics(scope_metrics=[mpb.ScopeMetrics(metrics=[metric])])]))
        assert exporter.wait_idle(10)
        assert received[0].resource_metrics[0].scope_metrics[0].metrics[0].name == "m"
        assert exporter.metrics()["sent_items"] == 1
        exporter.shutdown()
    finally:
        server.stop(grace=None)
    assert port  # the traces server was up too: services on different ports


class OtlpHttpHandler(http.server.BaseHTTPRequestHandler):
    server_version = "test-otlp/1"
    protocol_version = "HTTP/1.1"  # keep-alive, as real OTLP/HTTP servers do
    plan: list[tuple[int, dict[str, str]]] = []
    seen: list[tuple[str, dict[str, str], bytes, float]] = []
    peers: list[tuple[str, int]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        type(self).seen.append((self.path, dict(self.headers), body, time.monotonic()))
        type(self).peers.append(self.client_address)
        status, headers = type(self).plan.pop(0) if type(self).plan else (200, {})
        payload = tsvc.ExportTraceServiceResponse().SerializeToString() if status == 200 else b"no"
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    OtlpHttpHandler.plan = []
    OtlpHttpHandler.seen = []
    OtlpHttpHandler.peers = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtlpHttpHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_http_forwarding_gzip_and_retry_after(http_server):
    OtlpHttpHandler.plan = [(503, {"Retry-After": "1"}), (200, {})]
    exporter = REGISTRY["otlp"](endpoint=f"http://127.0.0.1:{http_server}", compression="gzip",
                                protocol="http/protobuf",
                                retry_on_failure={"initial_interval": "20s"})
    exporter.export_traces(traces(3))
    assert exporter.wait_idle(10)
    (first, second) = OtlpHttpHandler.seen
    assert first[0] == "/v1/traces" and first[1]["Content-Type"] == "application/x-protobuf"
    assert names(tsvc.ExportTraceServiceRequest.FromString(second[2])) == ["x1", "x2", "x3"]
    assert 0.9 <= second[3] - first[3] < 5  # Retry-After: 1, not the 20 s backoff
    assert exporter.metrics()["sent_items"] == 3
    exporter.shutdown()


def test_http_reuses_one_connection(http_server):
    exporter = REGISTRY["otlp"](endpoint=f"http://127.0.0.1:{http_server}/v1/traces")
    for i in range(5):
        exporter.export_traces(traces(1, f"k{i}-"))
    assert exporter.wait_idle(10)
    assert len(OtlpHttpHandler.seen) == 5 and len(set(OtlpHttpHandler.peers)) == 1
    exporter.shutdown()


def test_http_client_error_is_not_retried(http_server):
    OtlpHttpHandler.plan = [(400, {})]
    exporter = REGISTRY["otlphttp"](endpoint=f"http://127.0.0.1:{http_server}")
    exporter.export_traces(traces(2))
    assert exporter.wait_idle(10)
    m = exporter.metrics()
    assert m["failed_requests"] == 1 and m["dropped_items"] == 2 and m["retries"] == 0
    assert "HTTP 400" in exporter.last_error
    exporter.shutdown()


def test_dead_target_never_blocks_and_queue_drops_oldest():
    port = free_port()
    exporter = OtlpExporter(
        endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout="1s",
        sending_queue={"queue_size": 5}, retry_on_failure={"initial_interval": "50ms"},
        shutdown_timeout="200ms",
    )
    assert exporter.protocol == "http/protobuf"
    t0 = time.monotonic()
    for i in range(200):
        exporter.export_traces(traces(1, f"r{i}-"))
        exporter.flush()
    assert time.monotonic() - t0 < 1.0  # 200 exports + flushes never waited on the target
    m = exporter.metrics()
    assert m["queue_requests"] <= 5
    assert m["dropped_requests"] >= 194
    t1 = time.monotonic()
    exporter.shutdown()
    assert time.monotonic() - t1 < 3
    assert exporter.metrics()["queue_requests"] == 0
    assert "cannot reach" in exporter.last_error


def test_dead_grpc_target_gives_up_after_max_elapsed_time():
    exporter = OtlpExporter(
        endpoint=f"127.0.0.1:{free_port()}", timeout="500ms",
        retry_on_failure={"initial_interval": "50ms", "max_elapsed_time": "300ms"},
    )
    exporter.export_traces(traces(4))
    assert exporter.wait_idle(10)
    m = exporter.metrics()
    assert m["failed_requests"] == 1 and m["dropped_items"] == 4
    assert "UNAVAILABLE" in exporter.last_error
    exporter.shutdown()


def test_options_are_checked():
    with pytest.raises(ValueError, match="endpoint"):
        OtlpExporter(endpoint="")
    with pytest.raises(ValueError, match="protocol"):
        OtlpExporter(endpoint="localhost:4317", protocol="carrier-pigeon")
    with pytest.raises(ValueError, match="sending_queue"):
        OtlpExporter(endpoint="localhost:4317", sending_queue={"queue_sise": 3})
    with pytest.raises(ValueError, match="timeout"):
        OtlpExporter(endpoint="localhost:4317", timeout="forever")
    with pytest.raises(ValueError, match="multiplier"):
        OtlpExporter(endpoint="localhost:4317", retry_on_failure={"multiplier": 0.5})
    with pytest.raises(ValueError, match="http"):
        OtlpExporter(endpoint="ftp://host:21/x", protocol="http/protobuf")
