"""`flare_otlp` over OTLP/HTTP (protobuf): the SDK's HTTP span exporter with Flare's
writer, sending with Flare's one HTTP client (`http_client`, urllib3).

Selected by `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` =
`http/protobuf` (see `otlp_exporter.FlareOTLPSpanExporter`); `flare run` uses it.

Why a rank would rather speak HTTP than gRPC to its collector: a gRPC channel keeps an
event engine, a timer thread and a lifeguard thread alive that cost the process ~1-2 ms
of CPU every second even when nothing is sent (measured here with grpcio 1.85, idle
channel), on top of ~1.3 ms per request: with four ranks on two cores that CPU comes
straight out of the training steps. Over HTTP nothing runs between exports, and one
export is a POST on a kept-alive connection from the batch processor's thread.

Everything but the encoding and the transport is the SDK's `OTLPSpanExporter` (endpoint,
headers, compression, timeout, retries with backoff and Retry-After, the size limit,
the environment variables it reads). The transport is `http_client` behind the SDK's
transport interface, with the same TLS settings (`certificate_file`, client certificate
and key): where the SDK takes a transport (a private argument: `sdk_adapter.
offer_transport`) and is a version `sdk_adapter` knows; elsewhere the SDK's own (requests) is kept. Not the SDK's own
urllib3 transport, because stopping the exporter must end a request in flight
(`http_client.HttpClient.close`); per request they cost about the same CPU, half of
requests' (`benchmarks/http_transport_cost.py`).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as _SdkHttpSpanExporter,
)
from opentelemetry.sdk.trace.export import SpanExportResult

from flare.instrumentation import otlp_encoding
from flare.wire import http_client
from flare.wire import sdk_adapter as sdk
from flare.wire.http_client import HttpClient, Reply, TransportError

_log = logging.getLogger(__name__)

# the SDK's pluggable transport; on an older SDK its requests-based transport is kept
BaseHTTPResult, BaseHTTPTransport = sdk.http_transport_classes()


def _accepts_transport() -> bool:
    return (BaseHTTPTransport is not None and sdk.internals_ok()
            and sdk.accepts_transport(_SdkHttpSpanExporter))


def _ssl_context(verify: bool | str, cert: str | tuple | None) -> ssl.SSLContext:
    """requests' verify/cert pair (what the SDK's session-based settings are) as the
    one client context."""
    cert_file, key_file = cert if isinstance(cert, tuple) else (cert, None)
    return http_client.tls_context(verify, cert_file, key_file)


if BaseHTTPTransport is not None:

    @dataclass(frozen=True, slots=True)
    class _Result(BaseHTTPResult):
        reply: Reply | None = None

        def content(self) -> bytes:
            return self.reply.body if self.reply is not None else b""

        def headers(self):
            return self.reply.headers if self.reply is not None else {}

    class HttpClientTransport(BaseHTTPTransport):
        """The SDK's transport interface over `http_client`: one client per origin."""

        def __init__(self, verify: bool | str = True, cert: str | tuple | None = None):
            self._verify = verify
            self._cert = cert
            self._clients: dict[str, HttpClient] = {}
            self._closed = False
            self._lock = threading.Lock()

        def _origin_client(self, scheme: str, netloc: str) -> HttpClient:
            origin = f"{scheme}://{netloc}"
            with self._lock:
                client = self._clients.get(origin)
                if client is None:
                    context = _ssl_context(self._verify, self._cert) if scheme == "https" else None
                    client = self._clients[origin] = HttpClient(origin, 10.0, context)
                return client

        def request(self, method: str, url: str, *, headers=None, timeout=None, data=None):
            if self._closed:  # (the SDK retries a connection error at once, stopped or not)
                return _Result(error=RuntimeError("the exporter was stopped"))
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            try:
                reply = self._origin_client(parts.scheme, parts.netloc).request(
                    method, target, data, headers, timeout)
            except Exception as error:  # unreachable, TLS, timeout, a bad reply or header
                return _Result(error=error)
            return _Result(status_code=reply.status, reason=reply.reason, reply=reply)

        def is_connection_error(self, exception: Exception | None) -> bool:
            # Nothing reached the server, or a kept-alive connection had been closed by
            # it: worth one more connection. A timeout waiting for the reply, or a reply
            # cut off, is not (the request may have been accepted).
            return isinstance(exception, TransportError) and exception.kind == "connect"

        def close(self) -> None:
            """Close the connections and end the requests in flight: the exporter's
            shutdown (Flare's exit deadline) must not wait out a request timeout on a
            collector that accepted the connection and never answers."""
            with self._lock:
                self._closed = True
                clients, self._clients = list(self._clients.values()), {}
            for client in clients:
                client.close()


def _tls_settings(certificate_file, client_key_file, client_certificate_file):
    """verify/cert as the SDK's requests transport derives them (arguments, then the
    traces and generic environment variables: http_client.otlp_tls_from_env)."""
    verify, certificate, key = http_client.otlp_tls_from_env(
        certificate_file, client_key_file, client_certificate_file)
    cert = (certificate, key) if certificate and key else certificate
    return verify, cert


class FlareOTLPHttpSpanExporter(_SdkHttpSpanExporter):
    """OTLP/HTTP protobuf span exporter; the SDK's settings and behaviour, Flare's
    writer, and `http_client` as the transport unless a `session` is given."""

    def __init__(self, endpoint=None, certificate_file=None, client_key_file=None,
                 client_certificate_file=None, headers=None, timeout=None, compression=None,
                 session=None, **kwargs):
        if session is None and _accepts_transport():
            sdk.offer_transport(kwargs, lambda: HttpClientTransport(
                *_tls_settings(certificate_file, client_key_file, client_certificate_file)))
        super().__init__(endpoint, certificate_file, client_key_file, client_certificate_file,
                         headers, timeout, compression, session, **kwargs)
        # Flare's writer, where the SDK exporter is of the shape this export mirrors
        self._parts = sdk.http_export_parts(self) if otlp_encoding.writer_matches_sdk() else None
        self._fast = self._parts is not None

    @property
    def writes_otlp_encoding(self) -> bool:
        """Whether requests are written by otlp_encoding, which also takes the spans
        Flare hands over already written (`otlp_encoding.EncodedSpan`)."""
        return self._fast

    def export(self, spans: Sequence) -> SpanExportResult:
        if not self._fast or sdk.exporter_shut_down(self):
            return super().export(spans)
        # What the SDK's export does after encoding, with the request Flare wrote.
        client, limit, metrics = self._parts
        with metrics.export_operation(len(spans)) as result:
            try:
                data = otlp_encoding.encode_request(spans)
            except Exception as error:
                _log.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if limit and limit > 0 and len(data) > limit:
                _log.warning("Dropping span batch: serialized size %d bytes exceeds "
                             "max_request_size %d bytes.", len(data), limit)
                result.error = ValueError(f"request of {len(data)} bytes exceeds "
                                          f"max_request_size {limit}")
                return SpanExportResult.FAILURE
            outcome = client.export(data)
            if not outcome.success:
                result.error = outcome.error
                if outcome.status_code is not None:
                    result.error_attrs = {"http.response.status_code": outcome.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
