"""OTLP/gRPC receiver: TraceService/Export and MetricsService/Export.

Handlers take the raw request bytes (no deserializer) so that an undecodable body is
our INVALID_ARGUMENT rather than a gRPC internal error, and so that the original bytes
can go to the write-ahead log unchanged. Backpressure follows the OTLP spec: a full
memory or queue budget is RESOURCE_EXHAUSTED *with* RetryInfo (which marks it
retryable), a collector that cannot persist is UNAVAILABLE with RetryInfo. The retry
delay is sent both in the standard `grpc-status-details-bin` trailer and in the
`google.rpc.retryinfo-bin` trailer that the OTel Python SDK reads.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from flare.collector.config import ProtocolConfig
from flare.collector.errors import MalformedPayload, Refused, StartError
from flare.collector.receiver import METRICS, TRACES, Acceptor, SignalKind
from flare.collector.security_hooks import grpc_credentials
from flare.collector.telemetry import Counters

log = logging.getLogger(__name__)

_SERVICES = {
    "opentelemetry.proto.collector.trace.v1.TraceService": TRACES,
    "opentelemetry.proto.collector.metrics.v1.MetricsService": METRICS,
}


def _retry_trailers(refused: Refused, grpc_code: int) -> tuple[tuple[str, bytes], ...]:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(refused.retry_after_s * 1e9))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=grpc_code, message=refused.reason, details=[detail])
    return (
        ("grpc-status-details-bin", status.SerializeToString()),
        ("google.rpc.retryinfo-bin", info.SerializeToString()),
    )


class GrpcReceiver:
    def __init__(
        self,
        receiver_id: str,
        options: ProtocolConfig,
        acceptor: Acceptor,
        counters: Counters,
        auth: Any | None = None,
        max_workers: int = 16,
    ) -> None:
        self.id = receiver_id
        self.options = options
        self.acceptor = acceptor
        self.counters = counters
        self.auth = auth  # security.BearerAuth or None
        self.max_workers = max_workers
        self.server: grpc.Server | None = None
        self.endpoint: str | None = None

    def _handler(self, kind: SignalKind):
        def export(raw: bytes, context: grpc.ServicerContext) -> bytes:
            if self.auth is not None and not self.auth.check_metadata(context.invocation_metadata()):
                self.counters.add("unauthenticated_requests", transport="grpc")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            try:
                response = self.acceptor.accept(kind, raw, "grpc")
            except MalformedPayload as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Refused as refused:
                if refused.overloaded:
                    code, number = grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED
                else:
                    code, number = grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE
                context.set_trailing_metadata(_retry_trailers(refused, number))
                context.abort(code, refused.reason)
            except Exception as exc:  # a bug: one log line and INTERNAL, not a traceback
                self.counters.add("internal_errors", transport="grpc")
                log.error("OTLP/gRPC export failed: %s", exc)
                context.abort(grpc.StatusCode.INTERNAL, "internal error in the collector")
            return response.SerializeToString()

        return grpc.unary_unary_rpc_method_handler(export)

    def start(self) -> str:
        handlers = [
            grpc.method_handlers_generic_handler(service, {"Export": self._handler(kind)})
            for service, kind in _SERVICES.items()
        ]
        max_bytes = self.options.max_body_bytes
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=f"flare-grpc-{self.id}"),
            handlers=handlers,
            options=[
                ("grpc.max_receive_message_length", max_bytes),
                ("grpc.max_send_message_length", 4 << 20),
                ("grpc.so_reuseport", 0),
            ],
        )
        address = str(self.options.endpoint)
        try:
            if self.options.tls:
                credentials = grpc_credentials(self.options.tls)
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartError(f"cannot listen for OTLP/gRPC on {address}: {exc}") from None
        if not port:
            raise StartError(f"cannot listen for OTLP/gRPC on {address}: address in use or not available")
        server.start()
        self.server = server
        host = self.options.endpoint.host
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.endpoint

    def stop(self, grace_s: float) -> None:
        if self.server is not None:
            self.server.stop(grace_s).wait(grace_s + 1.0)
            self.server = None
