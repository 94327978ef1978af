"""OTLP/gRPC receiver: TraceService/Export and MetricsService/Export.

Served by gRPC's asyncio server on a thread of its own, so that a call waiting for a
slow client holds no thread at all: each Export is a stream-request handler that runs as
soon as the call's headers arrive, before any byte of its body. It checks, in this order
and without reading the body:

1. the bearer token (every `authorization` entry; more than one is refused):
   UNAUTHENTICATED at once;
2. the cap on calls in flight (`max_concurrent_calls`): RESOURCE_EXHAUSTED with a
   retry delay;
3. then it waits for the one request message, at most `read_timeout`
   (DEADLINE_EXCEEDED after that), and decodes and logs it on the loop's thread. (A hop
   to a worker pool cost 27 % of the small-call rate, 1,130 against 1,420 calls/s in
   `benchmarks/collector_e2e_ingest.py`, and bought nothing: the GIL serializes decoding,
   and the write-ahead log's appends, fsync included, hold its lock.)

Connections are capped (`max_connections`), a TLS or HTTP/2 handshake that does not
finish within `handshake_timeout` is dropped, and an idle connection closes after
`idle_timeout` (gRPC core's channel arguments). Refusals and timeouts are counted.

Handlers take the raw request bytes (no deserializer) so that an undecodable body is
our INVALID_ARGUMENT rather than a gRPC internal error, and so that the original bytes
can go to the write-ahead log unchanged. Backpressure follows the OTLP spec: a full
memory or queue budget is RESOURCE_EXHAUSTED *with* RetryInfo (which marks it
retryable), a collector that cannot persist is UNAVAILABLE with RetryInfo. The retry
delay is sent both in the standard `grpc-status-details-bin` trailer and in the
`google.rpc.retryinfo-bin` trailer that the OTel Python SDK reads.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from flare.collector.config import ProtocolConfig
from flare.collector.errors import MalformedPayload, Refused, StartError
from flare.collector.receiver import METRICS, TRACES, Acceptor, SignalKind
from flare.collector.security_hooks import grpc_credentials
from flare.collector.telemetry import Counters, Refusals

log = logging.getLogger(__name__)

_SERVICES = {
    "opentelemetry.proto.collector.trace.v1.TraceService": TRACES,
    "opentelemetry.proto.collector.metrics.v1.MetricsService": METRICS,
}
_BUSY_RETRY_S = 1.0


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


def check_port_free(host: str, port: int, label: str) -> None:
    """A StartError for a port that is taken, before gRPC core tries it (and prints its
    own `add_port` error line on stderr ahead of Flare's one line)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StartError(f"cannot listen for {label} on {host}:{port}: {exc.strerror or exc}") from None
    family, _, _, _, address = infos[0]
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
    except OSError as exc:
        raise StartError(f"cannot listen for {label} on {host}:{port}: {exc.strerror or exc}") from None
    finally:
        probe.close()


class GrpcReceiver:
    def __init__(
        self,
        receiver_id: str,
        options: ProtocolConfig,
        acceptor: Acceptor,
        counters: Counters,
        auth: Any | None = None,
    ) -> None:
        self.id = receiver_id
        self.options = options
        self.limits = options.limits
        self.acceptor = acceptor
        self.counters = counters
        self.refusals = Refusals(counters)
        self.auth = auth  # security.BearerAuth or None
        self.in_flight = 0  # calls admitted and not answered (touched on the loop only)
        self.endpoint: str | None = None
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        counters.add("refused_connections", 0.0, cause="in_flight_cap", transport="grpc")
        counters.add("timed_out_requests", 0.0, cause="body", transport="grpc")

    # ------------------------------------------------------------------ a call
    def _handler(self, kind: SignalKind) -> grpc.RpcMethodHandler:
        async def export(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
            if self.auth is not None and not self.auth.check_metadata(context.invocation_metadata()):
                self.counters.add("unauthenticated_requests", transport="grpc")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            if self.in_flight >= self.limits.max_concurrent_calls:
                self.refusals.add("refused_connections", "in_flight_cap",
                                  "OTLP/gRPC: %d calls in flight, the cap; new calls are refused "
                                  "(RESOURCE_EXHAUSTED, retry in 1 s)", self.in_flight, transport="grpc")
                busy = Refused(f"{self.in_flight} calls in flight, the collector's cap", _BUSY_RETRY_S,
                               overloaded=True, code="in_flight_cap")
                context.set_trailing_metadata(_retry_trailers(busy, code_pb2.RESOURCE_EXHAUSTED))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, busy.reason)
            self.in_flight += 1
            try:
                return await self._export(kind, context)
            finally:
                self.in_flight -= 1

        return grpc.stream_unary_rpc_method_handler(export)

    async def _export(self, kind: SignalKind, context: grpc.aio.ServicerContext) -> bytes:
        timeout = self.limits.read_timeout_s
        try:
            raw = await asyncio.wait_for(context.read(), timeout)
        except asyncio.TimeoutError:
            self.refusals.add("timed_out_requests", "body",
                              "OTLP/gRPC: a call sent no request within %g s (read_timeout); ended",
                              timeout, transport="grpc")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {timeout:g} s")
        if raw is grpc.aio.EOF:
            self.counters.add("malformed_requests", transport="grpc")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
        try:
            response = self.acceptor.accept(kind, raw, "grpc")
        except MalformedPayload as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as refused:
            if refused.overloaded:
                code, number = grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED
            else:
                code, number = grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE
            context.set_trailing_metadata(_retry_trailers(refused, number))
            await context.abort(code, refused.reason)
        except Exception as exc:  # a bug: one log line and INTERNAL, not a traceback
            self.counters.add("internal_errors", transport="grpc")
            log.error("OTLP/gRPC export failed: %s", exc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the collector")
        return response.SerializeToString()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        host, port = self.options.endpoint.host, self.options.endpoint.port
        address = str(self.options.endpoint)
        check_port_free(host, port, "OTLP/gRPC")
        credentials = grpc_credentials(self.options.tls) if self.options.tls else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"flare-grpc-{self.id}-loop",
                                        daemon=True)
        self._thread.start()
        try:
            bound = asyncio.run_coroutine_threadsafe(self._serve(address, credentials), self._loop).result()
        except BaseException:
            self._close_loop()
            raise
        self.endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self.endpoint

    async def _serve(self, address: str, credentials: Any) -> int:
        limits = self.limits
        server = grpc.aio.server(
            handlers=[
                grpc.method_handlers_generic_handler(service, {"Export": self._handler(kind)})
                for service, kind in _SERVICES.items()
            ],
            options=[
                ("grpc.max_receive_message_length", self.options.max_body_bytes),
                ("grpc.max_send_message_length", 4 << 20),
                ("grpc.so_reuseport", 0),
                ("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(limits.idle_timeout_s * 1000)),
                ("grpc.max_allowed_incoming_connections", limits.max_connections),
            ],
        )
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartError(f"cannot listen for OTLP/gRPC on {address}: {exc}") from None
        if not port:
            raise StartError(f"cannot listen for OTLP/gRPC on {address}: address in use or not available")
        await server.start()
        self._server = server
        return port

    def stop(self, grace_s: float) -> None:
        if self._server is not None and self._loop is not None:
            future = asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop)
            try:
                future.result(grace_s + 1.0)
            except Exception as exc:  # (a stop that overran its grace: the loop ends anyway)
                log.debug("OTLP/gRPC stop: %s", exc)
            self._server = None
        self._close_loop()

    def _close_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(5.0)
            if not self._loop.is_running():
                self._loop.close()
            self._loop = self._thread = None
