"""A tiny OTLP receiver on loopback that keeps what it receives (test helper).

Over gRPC it implements the OTLP TraceService and MetricsService; with
`protocol="http"` it serves OTLP/HTTP protobuf (`/v1/traces`, `/v1/metrics`, gzip
bodies). It stores every request with its size on the wire, and flattens spans into
dicts for assertions. Also runnable as a process: `python otlp_sink.py PORT_FILE
[grpc|http]` writes its port and serves until SIGTERM, printing a JSON summary of bytes
per request to stdout at exit.
"""

from __future__ import annotations

import gzip
import http.server
import socket
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind is None:
        return None
    return getattr(any_value, kind)


def attributes_dict(attributes) -> dict:
    return {kv.key: _value(kv.value) for kv in attributes}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink):
        self.sink = sink

    def Export(self, request, context):
        self.sink._keep_traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpSink):
        self.sink = sink

    def Export(self, request, context):
        with self.sink._lock:
            self.sink.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _HttpHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as OTLP/HTTP clients expect
    sink: OtlpSink

    def setup(self):
        super().setup()
        with self.sink._lock:
            self.sink._connections.add(self.connection)

    def finish(self):
        with self.sink._lock:
            self.sink._connections.discard(self.connection)
        super().finish()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        wire = len(body)
        if self.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        if self.path.rstrip("/").endswith("/v1/traces"):
            with self.sink._lock:
                self.sink.trace_requests.append((time.time_ns(), body, wire))
        elif self.path.rstrip("/").endswith("/v1/metrics"):
            request = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
            with self.sink._lock:
                self.sink.metric_requests.append(request)
        elif self.path.rstrip("/").endswith("/v1/opamp"):  # the collector's own OpAMP server
            status, answer = self.sink.opamp.handle(body, self.headers)
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")  # an empty Export*ServiceResponse
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class OtlpSink:
    def __init__(self, port: int = 0, raw: bool = False, protocol: str = "grpc"):
        """`raw`: keep trace requests as the bytes received and parse them only when
        asked (spans(), bytes_by_rank()): a benchmark's sink then costs the machine it
        shares with the job little more than gRPC's own receive. Over HTTP requests
        are always kept raw."""
        self._lock = threading.Lock()
        self.protocol = protocol
        self.raw = raw or protocol == "http"
        self.trace_requests: list = []  # (arrival time_ns, request or bytes, wire bytes)
        self.metric_requests: list = []
        self._connections: set = set()  # HTTP: open client connections, closed at stop
        if protocol == "http":
            from flare.collector.opamp import OpampServer
            from flare.collector.telemetry import Counters

            self.opamp = OpampServer(Counters())  # ranks with FLARE_OPAMP_ENDPOINT poll it
            handler = type("Handler", (_HttpHandler,), {"sink": self})
            self._http = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
            self._http.daemon_threads = True
            self.port = self._http.server_address[1]
            return
        if protocol != "grpc":
            raise ValueError(f"protocol must be grpc or http, not {protocol!r}")
        self._http = None
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                   options=[("grpc.max_receive_message_length", 64 << 20)])
        if raw:
            def export(request: bytes, context) -> bytes:
                with self._lock:
                    self.trace_requests.append((time.time_ns(), request, len(request)))
                return b""  # an empty ExportTraceServiceResponse

            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.trace.v1.TraceService",
                {"Export": grpc.unary_unary_rpc_method_handler(export)}),))
        else:
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self),
                                                                      self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self),
                                                                      self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpSink:
        if self._http is not None:
            threading.Thread(target=self._http.serve_forever, daemon=True).start()
            return self
        self._server.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            with self._lock:  # kept-alive connections too: the server is gone
                connections, self._connections = list(self._connections), set()
            for connection in connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return
        self._server.stop(grace=1).wait()

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _keep_traces(self, request) -> None:
        with self._lock:
            self.trace_requests.append((time.time_ns(), request, request.ByteSize()))

    def _requests(self) -> list:
        with self._lock:
            requests = list(self.trace_requests)
        if self.raw:
            parse = trace_service_pb2.ExportTraceServiceRequest.FromString
            requests = [(arrived, parse(body), size) for arrived, body, size in requests]
        return requests

    def spans(self) -> list[dict]:
        """Every received span, flattened, with its resource attributes and arrival time
        (`arrived`, wall-clock ns)."""
        requests = self._requests()
        flat = []
        for arrived, request, _ in requests:
            for resource_spans in request.resource_spans:
                resource = attributes_dict(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        flat.append({
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "start_ns": span.start_time_unix_nano,
                            "end_ns": span.end_time_unix_nano,
                            "attributes": attributes_dict(span.attributes),
                            "resource": resource,
                            "status_code": span.status.code,
                            "status_message": span.status.message,
                            "events": [(e.name, attributes_dict(e.attributes))
                                       for e in span.events],
                            "arrived": arrived,
                        })
        return flat

    def bytes_by_rank(self) -> dict[int, int]:
        """Wire bytes attributed to ranks (a request's bytes split by its spans' ranks)."""
        requests = self._requests()
        totals: dict[int, int] = {}
        for _, request, size in requests:
            counts: dict[int, int] = {}
            for resource_spans in request.resource_spans:
                resource = attributes_dict(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        rank = resource.get("flare.rank")
                        if rank is None:
                            rank = attributes_dict(span.attributes).get("flare.rank", -1)
                        counts[rank] = counts.get(rank, 0) + 1
            spans = sum(counts.values()) or 1
            for rank, count in counts.items():
                totals[rank] = totals.get(rank, 0) + size * count // spans
        return totals


def rank_of(span: dict) -> int | None:
    rank = span["resource"].get("flare.rank")
    return rank if rank is not None else span["attributes"].get("flare.rank")


if __name__ == "__main__":
    import json
    import signal
    import sys

    sink = OtlpSink(protocol=sys.argv[2] if len(sys.argv) > 2 else "grpc").start()
    with open(sys.argv[1], "w") as handle:
        handle.write(str(sink.port))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    sink.stop()
    print(json.dumps({"bytes_by_rank": sink.bytes_by_rank(), "spans": len(sink.spans())}))
