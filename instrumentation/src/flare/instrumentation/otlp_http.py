"""`flare_otlp` over OTLP/HTTP (protobuf): the SDK's HTTP span exporter with Flare's
writer and a lean HTTP/1.1 transport.

Selected by `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` =
`http/protobuf` (see `otlp_exporter.FlareOTLPSpanExporter`); `flare run` uses it.

Why a rank would rather speak HTTP than gRPC to its collector: a gRPC channel keeps an
event engine, a timer thread and a lifeguard thread alive that cost the process ~1-2 ms
of CPU every second even when nothing is sent (measured here with grpcio 1.85, idle
channel), on top of ~1.3 ms per request: with four ranks on two cores that CPU comes
straight out of the training steps. Over HTTP nothing runs between exports, and one
export is a POST on a kept-alive connection from the batch processor's thread.

Everything but the encoding and the socket is the SDK's `OTLPSpanExporter` (endpoint,
headers, compression, timeout, retries with backoff and Retry-After, the size limit,
the environment variables it reads). The transport here replaces `requests` (~2-3 ms of
CPU per request here) with `http.client` on one persistent connection, with the same
TLS settings (`certificate_file`, client certificate and key); it is used where the SDK
accepts a transport (its `_transport` argument), else the SDK's own is kept.
"""

from __future__ import annotations

import http.client
import inspect
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

_log = logging.getLogger(__name__)

try:  # the SDK's pluggable transport (private API, opentelemetry-exporter-otlp >= 1.4x)
    from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport
except ImportError:  # an older SDK: its requests-based transport is kept
    BaseHTTPResult = BaseHTTPTransport = None


def _accepts_transport() -> bool:
    if BaseHTTPTransport is None:
        return False
    try:
        return "_transport" in inspect.signature(_SdkHttpSpanExporter.__init__).parameters
    except (TypeError, ValueError):
        return False


class _ConnectFailed(ConnectionError):
    """The connection (TCP, TLS) could not be opened: nothing was sent."""


if BaseHTTPTransport is not None:

    @dataclass(frozen=True, slots=True)
    class _Result(BaseHTTPResult):
        body: bytes = b""
        response_headers: object = None  # http.client.HTTPMessage: case-insensitive

        def content(self) -> bytes:
            return self.body

        def headers(self):
            return self.response_headers if self.response_headers is not None else {}

    class HttpClientTransport(BaseHTTPTransport):
        """HTTP/1.1 on kept-alive `http.client` connections, one per server and
        caller at a time (an export takes a connection, returns it when done)."""

        def __init__(self, verify: bool | str = True, cert: str | tuple | None = None):
            self._verify = verify
            self._cert = cert
            self._ssl_context: ssl.SSLContext | None = None
            self._idle: dict[tuple, http.client.HTTPConnection] = {}
            self._lock = threading.Lock()

        def _context(self) -> ssl.SSLContext:
            if self._ssl_context is None:
                if self._verify is False:
                    context = ssl._create_unverified_context()
                elif isinstance(self._verify, str):
                    context = ssl.create_default_context(cafile=self._verify)
                else:
                    context = ssl.create_default_context()
                if isinstance(self._cert, tuple):
                    context.load_cert_chain(self._cert[0], self._cert[1])
                elif isinstance(self._cert, str):
                    context.load_cert_chain(self._cert)
                self._ssl_context = context
            return self._ssl_context

        def _open(self, scheme: str, host: str, port: int | None, timeout: float | None):
            if scheme == "https":
                return http.client.HTTPSConnection(host, port, timeout=timeout,
                                                   context=self._context())
            if scheme == "http":
                return http.client.HTTPConnection(host, port, timeout=timeout)
            raise ValueError(f"unsupported URL scheme {scheme!r} (http or https)")

        def request(self, method: str, url: str, *, headers=None, timeout=None, data=None):
            parts = urlsplit(url)
            key = (parts.scheme, parts.hostname, parts.port)
            with self._lock:
                connection = self._idle.pop(key, None)
            try:
                if connection is None:
                    connection = self._open(parts.scheme, parts.hostname or "", parts.port,
                                            timeout)
                    connection.connect()
                elif connection.sock is not None:
                    connection.sock.settimeout(timeout)
            except (OSError, ValueError) as error:
                if connection is not None:
                    connection.close()
                failure = _ConnectFailed(f"cannot connect to {url}: {error}")
                return _Result(error=failure if isinstance(error, OSError) else error)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            try:
                connection.request(method, path, body=data, headers=headers or {})
                response = connection.getresponse()
                body = response.read()
            except Exception as error:  # reset, timeout, a malformed reply: no result
                connection.close()
                return _Result(error=error)
            if response.will_close:
                connection.close()
            else:
                with self._lock:
                    spare = self._idle.setdefault(key, connection)
                if spare is not connection:  # another caller's is kept: one idle per server
                    connection.close()
            return _Result(status_code=response.status, reason=response.reason, body=body,
                           response_headers=response.headers)

        def is_connection_error(self, exception: Exception | None) -> bool:
            # Nothing reached the server (refused, unreachable, TLS failed) or a kept-alive
            # connection had been closed by it (reset, closed before the reply): worth
            # one more connection. A timeout waiting for the reply is not (the request
            # may have been accepted).
            return isinstance(exception, (_ConnectFailed, http.client.RemoteDisconnected,
                                          ConnectionResetError, BrokenPipeError))

        def close(self) -> None:
            with self._lock:
                idle, self._idle = list(self._idle.values()), {}
            for connection in idle:
                connection.close()


def _tls_settings(certificate_file, client_key_file, client_certificate_file):
    """verify/cert as the SDK's requests transport derives them (arguments, then the
    traces and generic environment variables)."""
    import os

    verify = (certificate_file or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE")
              or os.environ.get("OTEL_EXPORTER_OTLP_CERTIFICATE") or True)
    key = (client_key_file or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY")
           or os.environ.get("OTEL_EXPORTER_OTLP_CLIENT_KEY"))
    certificate = (client_certificate_file
                   or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE")
                   or os.environ.get("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"))
    cert = (certificate, key) if certificate and key else certificate
    return verify, cert


class FlareOTLPHttpSpanExporter(_SdkHttpSpanExporter):
    """OTLP/HTTP protobuf span exporter; the SDK's settings and behaviour, Flare's
    writer, and an `http.client` transport unless a `session` is given."""

    def __init__(self, endpoint=None, certificate_file=None, client_key_file=None,
                 client_certificate_file=None, headers=None, timeout=None, compression=None,
                 session=None, **kwargs):
        if session is None and "_transport" not in kwargs and _accepts_transport():
            kwargs["_transport"] = HttpClientTransport(
                *_tls_settings(certificate_file, client_key_file, client_certificate_file))
        super().__init__(endpoint, certificate_file, client_key_file, client_certificate_file,
                         headers, timeout, compression, session, **kwargs)
        from flare.instrumentation.otlp_exporter import writer_matches_sdk

        # Flare's writer, where the SDK exporter is of the shape this export mirrors
        self._fast = (writer_matches_sdk() and hasattr(self, "_client")
                      and hasattr(self, "_max_request_size")
                      and hasattr(getattr(self, "_metrics", None), "export_operation"))

    def export(self, spans: Sequence) -> SpanExportResult:
        if not self._fast or self._shutdown:
            return super().export(spans)
        # What the SDK's export does after encoding, with the request Flare wrote.
        with self._metrics.export_operation(len(spans)) as result:
            try:
                data = otlp_encoding.encode_request(spans)
            except Exception as error:
                _log.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            limit = self._max_request_size
            if limit and limit > 0 and len(data) > limit:
                _log.warning("Dropping span batch: serialized size %d bytes exceeds "
                             "max_request_size %d bytes.", len(data), limit)
                result.error = ValueError(f"request of {len(data)} bytes exceeds "
                                          f"max_request_size {limit}")
                return SpanExportResult.FAILURE
            outcome = self._client.export(data)
            if not outcome.success:
                result.error = outcome.error
                if outcome.status_code is not None:
                    result.error_attrs = {"http.response.status_code": outcome.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
