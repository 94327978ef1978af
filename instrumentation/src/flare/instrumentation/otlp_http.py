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
CPU per request here) with a lean HTTP/1.1 client on one persistent connection, with the
same TLS settings (`certificate_file`, client certificate and key); it is used where the SDK
accepts a transport (its `_transport` argument), else the SDK's own is kept.
"""

from __future__ import annotations

import inspect
import logging
import re
import socket
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


_MAX_HEAD = 64 * 1024  # bytes of status line and headers a reply may have
_MAX_BODY = 64 * 1024 * 1024


class _Disconnected(ConnectionError):
    """The server closed a kept-alive connection before replying (it had timed it out,
    or restarted): nothing was processed, one more connection is worth it."""


class _Truncated(ConnectionError):
    """The server closed the connection in the middle of its reply: the request may have
    been processed, so it is not retried at once."""


class _BadReply(ValueError):
    """The reply is not HTTP/1.x as this client reads it."""


class _Headers(dict):
    """Reply headers, lower-cased names; repeated ones joined with ', ' (what the SDK's
    transport contract asks: case-insensitive, one string per name)."""

    def get(self, key, default=None):
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key):
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key):
        return dict.__contains__(self, key.lower())


class _Connection:
    """One HTTP/1.1 connection: a request is one `sendall` of head and body, the reply
    is read into one buffer and parsed here (status line, headers, a body by
    Content-Length, chunks or close). http.client builds a file object, an
    email-parser message and several header objects per reply: ~250 µs of CPU per
    request warm and ~3.9 ms after an idle pause, against ~80 µs and ~0.8 ms this way
    (16 kB POST on loopback, measured here)."""

    __slots__ = ("_buffer", "host_header", "sock")

    def __init__(self, sock: socket.socket, host_header: str):
        self.sock = sock
        self.host_header = host_header
        self._buffer = b""  # bytes received past the last reply (none, in practice)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def abort(self) -> None:
        """End a request in flight from another thread: its send or its wait for the
        reply returns at once with an error (closing alone would not wake it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def request(self, method: str, path: str, headers: dict, body: bytes | None,
                timeout: float | None) -> tuple[int, str, _Headers, bytes, bool]:
        """(status, reason, headers, body, keep_alive)."""
        self.sock.settimeout(timeout)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host_header}"]
        for name, value in headers.items():
            name, value = str(name), str(value)
            if _UNSAFE.search(name) or _UNSAFE.search(value):
                raise ValueError(f"invalid HTTP header {name!r}: control characters")
            if name.lower() not in ("host", "content-length", "connection"):
                lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {len(body) if body else 0}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if body and len(body) > 65536:
            self.sock.sendall(head)
            self.sock.sendall(body)
        else:
            self.sock.sendall(head + body if body else head)
        while True:
            status, reason, reply_headers, keep_alive = self._read_head()
            if 100 <= status < 200:  # an interim reply (100 Continue): the final one follows
                continue
            if method == "HEAD" or status in (204, 304):
                return status, reason, reply_headers, b"", keep_alive
            body, to_the_close = self._read_body(reply_headers)
            # a body delimited by the close leaves nothing to reuse
            return status, reason, reply_headers, body, keep_alive and not to_the_close

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise _Truncated("the server closed the connection mid-reply")
        return data

    def _read_head(self) -> tuple[int, str, _Headers, bool]:
        buffer = self._buffer
        first = not buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buffer) > _MAX_HEAD:
                raise _BadReply(f"reply head longer than {_MAX_HEAD} bytes")
            data = self.sock.recv(65536)
            if not data:
                if first:
                    raise _Disconnected("the server closed the connection before replying")
                raise _Truncated("the server closed the connection mid-reply")
            first = False
            buffer += data
        head, self._buffer = buffer[:end].decode("latin-1"), buffer[end + 4:]
        status_line, *header_lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _BadReply(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        reply_headers = _Headers()
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise _BadReply(f"malformed reply header line: {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            previous = dict.get(reply_headers, name)
            dict.__setitem__(reply_headers, name, value if previous is None
                             else f"{previous}, {value}")
        connection = (dict.get(reply_headers, "connection") or "").lower()
        keep_alive = ("close" not in connection if parts[0] == "HTTP/1.1"
                      else "keep-alive" in connection)
        return int(parts[1]), parts[2] if len(parts) > 2 else "", reply_headers, keep_alive

    def _read_body(self, reply_headers: _Headers) -> tuple[bytes, bool]:
        """(body, whether it ran to the connection's close)."""
        if "chunked" in (dict.get(reply_headers, "transfer-encoding") or "").lower():
            return self._read_chunked(), False
        length = dict.get(reply_headers, "content-length")
        if length is None:  # delimited by the close (the connection is not kept)
            chunks = [self._buffer]
            self._buffer = b""
            total = len(chunks[0])
            while data := self.sock.recv(65536):
                chunks.append(data)
                total += len(data)
                if total > _MAX_BODY:
                    raise _BadReply(f"reply body longer than {_MAX_BODY} bytes")
            return b"".join(chunks), True
        try:
            size = int(length.split(",")[0])
        except ValueError:
            raise _BadReply(f"bad Content-Length {length!r}") from None
        if not 0 <= size <= _MAX_BODY:
            raise _BadReply(f"bad Content-Length {length!r}")
        return self._take(size), False

    def _take(self, size: int) -> bytes:
        buffer = self._buffer
        while len(buffer) < size:
            buffer += self._recv()
        self._buffer = buffer[size:]
        return buffer[:size]

    def _line(self) -> bytes:
        buffer = self._buffer
        while (end := buffer.find(b"\r\n")) < 0:
            if len(buffer) > _MAX_HEAD:
                raise _BadReply("chunk header too long")
            buffer += self._recv()
        self._buffer = buffer[end + 2:]
        return buffer[:end]

    def _read_chunked(self) -> bytes:
        chunks, total = [], 0
        while True:
            line = self._line().split(b";", 1)[0].strip()
            try:
                size = int(line, 16)
            except ValueError:
                raise _BadReply(f"bad chunk size {line[:20]!r}") from None
            if size == 0:
                while self._line():  # trailers, up to the empty line
                    pass
                return b"".join(chunks)
            total += size
            if total > _MAX_BODY:
                raise _BadReply(f"reply body longer than {_MAX_BODY} bytes")
            chunks.append(self._take(size))
            if self._take(2) != b"\r\n":
                raise _BadReply("chunk not followed by CRLF")


_UNSAFE = re.compile(r"[\r\n\x00]")


if BaseHTTPTransport is not None:

    @dataclass(frozen=True, slots=True)
    class _Result(BaseHTTPResult):
        body: bytes = b""
        response_headers: object = None  # _Headers: case-insensitive

        def content(self) -> bytes:
            return self.body

        def headers(self):
            return self.response_headers if self.response_headers is not None else {}

    class HttpClientTransport(BaseHTTPTransport):
        """HTTP/1.1 on kept-alive connections (plain or TLS), one per server and caller
        at a time (an export takes a connection, returns it when done)."""

        def __init__(self, verify: bool | str = True, cert: str | tuple | None = None):
            self._verify = verify
            self._cert = cert
            self._ssl_context: ssl.SSLContext | None = None
            self._idle: dict[tuple, _Connection] = {}
            self._busy: set[_Connection] = set()  # requests in flight, for close()
            self._closed = False
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

        def _open(self, scheme: str, host: str, port: int | None,
                  timeout: float | None) -> _Connection:
            if scheme not in ("http", "https"):
                raise ValueError(f"unsupported URL scheme {scheme!r} (http or https)")
            port = port or (443 if scheme == "https" else 80)
            sock = socket.create_connection((host, port), timeout=timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if scheme == "https":
                    sock = self._context().wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
            bracketed = f"[{host}]" if ":" in host else host
            default = port == (443 if scheme == "https" else 80)
            return _Connection(sock, bracketed if default else f"{bracketed}:{port}")

        def request(self, method: str, url: str, *, headers=None, timeout=None, data=None):
            parts = urlsplit(url)
            key = (parts.scheme, parts.hostname, parts.port)
            if self._closed:  # (the SDK retries a connection error at once, stopped or not)
                return _Result(error=RuntimeError("the exporter was stopped"))
            with self._lock:
                connection = self._idle.pop(key, None)
            if connection is None:
                try:
                    connection = self._open(parts.scheme, parts.hostname or "", parts.port,
                                            timeout)
                except (OSError, ValueError) as error:
                    failure = _ConnectFailed(f"cannot connect to {url}: {error}")
                    return _Result(error=failure if isinstance(error, OSError) else error)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            with self._lock:
                self._busy.add(connection)
            try:
                status, reason, reply_headers, body, keep_alive = connection.request(
                    method, path, headers or {}, data, timeout)
            except Exception as error:  # reset, timeout, a malformed reply: no result
                connection.close()
                return _Result(error=error)
            finally:
                with self._lock:
                    self._busy.discard(connection)
            if not keep_alive:
                connection.close()
            else:
                with self._lock:
                    spare = self._idle.setdefault(key, connection)
                if spare is not connection:  # another caller's is kept: one idle per server
                    connection.close()
            return _Result(status_code=status, reason=reason, body=body,
                           response_headers=reply_headers)

        def is_connection_error(self, exception: Exception | None) -> bool:
            # Nothing reached the server (refused, unreachable, TLS failed) or a kept-alive
            # connection had been closed by it (reset, closed before the reply): worth
            # one more connection. A timeout waiting for the reply is not (the request
            # may have been accepted).
            return isinstance(exception, (_ConnectFailed, _Disconnected,
                                          ConnectionResetError, BrokenPipeError))

        def close(self) -> None:
            """Close the idle connections and end the requests in flight: the exporter's
            shutdown (Flare's exit deadline) must not wait out a request timeout on a
            collector that accepted the connection and never answers."""
            with self._lock:
                self._closed = True
                idle, self._idle = list(self._idle.values()), {}
                busy = list(self._busy)
            for connection in idle:
                connection.close()
            for connection in busy:
                connection.abort()


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
    writer, and the lean HTTP/1.1 transport above unless a `session` is given."""

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

    @property
    def writes_otlp_encoding(self) -> bool:
        """Whether requests are written by otlp_encoding, which also takes the spans
        Flare hands over already written (`otlp_encoding.EncodedSpan`)."""
        return self._fast

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
