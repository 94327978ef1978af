"""OTLP/HTTP receiver: POST /v1/traces and /v1/metrics, protobuf or JSON.

Built on the standard library's threading HTTP server (HTTP/1.1 keep-alive, one
thread per connection): OTLP clients send few, large requests per connection, so
per-request overhead is small next to decoding (`benchmarks/collector_e2e_ingest.py`
measures it). Status codes per the OTLP spec: 400 malformed (with a google.rpc.Status
body), 413 over the body cap (compressed or decompressed), 415 unknown content type
or encoding, 429 (full memory or queue budget) and 503 (cannot persist) with
Retry-After, 401 without a valid bearer token.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.rpc import code_pb2, status_pb2

from flare.collector import otlp_json
from flare.collector.config import ProtocolConfig
from flare.collector.errors import MalformedPayload, PayloadTooLarge, Refused, StartError
from flare.collector.receiver import METRICS, TRACES, Acceptor
from flare.collector.security_hooks import ssl_context
from flare.collector.telemetry import Counters

log = logging.getLogger(__name__)

_PATHS = {"/v1/traces": TRACES, "/v1/metrics": METRICS}
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_DISCARD_MAX = 16 << 20  # oversized bodies up to this much over the cap are read and dropped


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo Content-Encoding, refusing output over `limit` bytes (zip bombs included)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    else:
        raise MalformedPayload(f"unsupported Content-Encoding {encoding!r} (use gzip, deflate or none)")
    try:
        out = decoder.decompress(body, limit + 1)
        if len(out) > limit:
            raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes")
        if not decoder.eof:
            raise MalformedPayload(f"truncated {encoding} body")
    except zlib.error as exc:
        raise MalformedPayload(f"body is not valid {encoding}: {exc}") from None
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, handler, receiver: HttpReceiver, ssl_ctx) -> None:
        self.receiver = receiver
        self.ssl_ctx = ssl_ctx
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:
        # One line instead of the stdlib's traceback on stderr.
        exc = sys.exc_info()[1]
        self.receiver.counters.add("connection_errors", transport="http")
        log.warning("OTLP/HTTP connection from %s failed: %s", client_address[0], exc)

    def finish_request(self, request, client_address) -> None:
        # The TLS handshake runs here, on the connection's own thread, so a slow or
        # broken client cannot hold up accept() for everyone else.
        if self.ssl_ctx is not None:
            try:
                request = self.ssl_ctx.wrap_socket(request, server_side=True)
            except (OSError, ValueError) as exc:
                self.receiver.counters.add("tls_handshake_errors", transport="http")
                log.debug("TLS handshake from %s failed: %s", client_address, exc)
                return
        super().finish_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "flare-collector"
    timeout = 120  # idle keep-alive connections end, so their threads do too
    server: _Server

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    # ------------------------------------------------------------------ routing
    def do_POST(self) -> None:
        receiver = self.server.receiver
        kind = _PATHS.get(self.path.split("?", 1)[0])
        if kind is None:
            receiver.counters.add("unsupported_requests", transport="http")
            self._discard_body()
            self._plain(404, f"no OTLP endpoint at {self.path}; use /v1/traces or /v1/metrics")
            return
        if receiver.auth is not None and not receiver.auth.check(self.headers.get("Authorization")):
            receiver.counters.add("unauthenticated_requests", transport="http")
            self._discard_body()
            self._status(401, code_pb2.UNAUTHENTICATED, "missing or invalid bearer token", False)
            return
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if content_type not in (_PROTOBUF, _JSON):
            receiver.counters.add("unsupported_requests", transport="http")
            self._discard_body()
            self._plain(415, f"unsupported Content-Type {content_type or '(none)'!r}; use {_PROTOBUF} or {_JSON}")
            return
        is_json = content_type == _JSON
        limit = receiver.options.max_body_bytes
        try:
            try:
                body = self._read_body(limit)
                body = decompress(body, self.headers.get("Content-Encoding") or "", limit)
            except MalformedPayload:  # a body that is not one (framing, encoding): counted
                receiver.counters.add("malformed_requests", transport="http")  # here, as the
                raise  # acceptor counts what does not decode as OTLP
            response = receiver.acceptor.accept(kind, body, "http", is_json=is_json)
        except PayloadTooLarge as exc:
            receiver.counters.add("too_large_requests", transport="http")
            self._status(413, code_pb2.INVALID_ARGUMENT, str(exc), is_json)
            return
        except MalformedPayload as exc:
            self._status(400, code_pb2.INVALID_ARGUMENT, str(exc), is_json)
            return
        except Refused as refused:
            status = 429 if refused.overloaded else 503
            code = code_pb2.RESOURCE_EXHAUSTED if refused.overloaded else code_pb2.UNAVAILABLE
            self._status(status, code, refused.reason, is_json, retry_after_s=refused.retry_after_s)
            return
        except ConnectionError:
            self.close_connection = True
            return
        except Exception as exc:  # a bug: one log line and a 500, not a traceback
            receiver.counters.add("internal_errors", transport="http")
            log.error("OTLP/HTTP export failed: %s", exc)
            self._status(500, code_pb2.INTERNAL, "internal error in the collector", is_json)
            return
        self._send(200, otlp_json.dumps(response) if is_json else response.SerializeToString(),
                   _JSON if is_json else _PROTOBUF)

    def do_GET(self) -> None:
        self.server.receiver.counters.add("unsupported_requests", transport="http")
        self._plain(405, "OTLP/HTTP takes POST requests")

    do_PUT = do_DELETE = do_PATCH = do_GET

    # ------------------------------------------------------------------ bodies
    def _read_body(self, limit: int) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._read_chunked(limit)
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise MalformedPayload("Content-Length or chunked Transfer-Encoding is required")
        try:
            length = int(length_text)
        except ValueError:
            raise MalformedPayload(f"Content-Length {length_text!r} is not a number") from None
        if length < 0:
            raise MalformedPayload("Content-Length is negative")
        if length > limit:
            # Read (and drop) a moderately oversized body so the client, still sending,
            # gets the 413 rather than a reset connection; beyond that, hang up.
            if length <= limit + _DISCARD_MAX:
                self._discard(length)
            else:
                self.close_connection = True
            raise PayloadTooLarge(f"body of {length} bytes exceeds the {limit} byte limit")
        body = self.rfile.read(length)
        if len(body) != length:
            raise ConnectionError("client closed the connection mid-body")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        parts = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise MalformedPayload("bad chunk size in chunked body") from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > limit:
                self.close_connection = True  # the rest of the stream is not read
                raise PayloadTooLarge(f"chunked body exceeds the {limit} byte limit")
            parts.append(self.rfile.read(size))
            self.rfile.readline(8)

    def _discard(self, length: int) -> None:
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 20))
            if not chunk:
                break
            length -= len(chunk)

    def _discard_body(self) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= 1 << 20:
            self.rfile.read(int(length))
        elif length or self.headers.get("Transfer-Encoding"):
            self.close_connection = True

    # ------------------------------------------------------------------ replies
    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _plain(self, status: int, text: str) -> None:
        self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

    def _status(self, status: int, code: int, message: str, is_json: bool, retry_after_s: float | None = None) -> None:
        extra = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
        if is_json:
            body = json.dumps({"code": code, "message": message}).encode()
            self._send(status, body, _JSON, extra)
        else:
            body = status_pb2.Status(code=code, message=message).SerializeToString()
            self._send(status, body, _PROTOBUF, extra)


class HttpReceiver:
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
        self.acceptor = acceptor
        self.counters = counters
        self.auth = auth
        self.endpoint: str | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        host, port = self.options.endpoint.host, self.options.endpoint.port
        ctx = ssl_context(self.options.tls)
        try:
            server = _Server((host, port), _Handler, self, ctx)
        except OSError as exc:
            raise StartError(f"cannot listen for OTLP/HTTP on {self.options.endpoint}: {exc.strerror}") from None
        self._server = server
        bound = server.server_address[1]
        self.endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"flare-http-{self.id}", daemon=True,
        )
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
