"""The one HTTP server under the OTLP/HTTP receiver and the HTTP extensions.

Built on the standard library's threading HTTP server (HTTP/1.1 keep-alive, one thread
per connection, the TLS handshake on that thread). Every request, on every endpoint,
goes through `Handler._dispatch`, which fixes the order:

1. the bearer token (all `Authorization` headers: more than one is refused), before
   any byte of the body is read: 401, the connection closed unless the body is a
   small `Content-Length` one that is read and dropped;
2. the framing headers: `Content-Length` (ASCII digits) or `Transfer-Encoding: chunked`,
   not both; anything else is 400, and a declared length over the cap 413 (read and
   dropped up to `DISCARD_MAX` over the cap so the client sees the status; beyond
   that the connection is closed unread); `Expect: 100-continue` is answered only now;
3. the endpoint's `respond`, which reads the body with `read_body` (never more than
   the cap: a chunked body is refused at the first chunk size that is not hex or
   that takes it over the cap); what it leaves unread is dropped, within the cap.

Slow and half-open clients are bounded (`config.Limits`): connections over
`max_connections` are closed at accept; a TLS handshake has `handshake_timeout`, a
request's line and headers `read_header_timeout` from their first byte (from accept
for a connection's first request), its body `read_timeout`, and a kept-alive
connection waits `idle_timeout` for its next request. Each is a deadline for the whole
phase, not for one read, so a client that trickles a byte at a time is cut off too.
Refusals and timeouts are counted (`refused_connections`, `timed_out_requests`, by
cause) and logged at most once a minute per cause.
"""

from __future__ import annotations

import io
import logging
import re
import select
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from flare.collector.config import Limits
from flare.collector.config_values import Endpoint
from flare.collector.errors import MalformedPayload, PayloadTooLarge, StartError
from flare.collector.security_hooks import ssl_context
from flare.collector.telemetry import Counters, Refusals

log = logging.getLogger(__name__)

DISCARD_MAX = 16 << 20  # oversized bodies up to this much over the cap are read and dropped
UNAUTHENTICATED_DRAIN = 1 << 20  # a refused request's body is dropped up to this size
CHUNKED = -1
_LINE_MAX = 1024
_TRAILERS_MAX = 8 << 10
_DIGITS = re.compile(r"[0-9]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")

# (status, headers, body) as an endpoint answers
Response = tuple[int, dict[str, str], bytes]


def _plain(status: int, text: str) -> Response:
    return status, {"Content-Type": "text/plain; charset=utf-8"}, (text + "\n").encode()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[Handler], owner: HttpService, ssl_ctx: Any) -> None:
        self.owner = owner
        self.ssl_ctx = ssl_ctx
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.connections: set[socket.socket] = set()  # open ones, closed at stop
        self.connections_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        owner = self.owner
        with self.connections_lock:
            full = len(self.connections) >= owner.limits.max_connections
            if not full:
                self.connections.add(request)
        if full:  # closed unread: a thread per connection is what the cap bounds
            owner.refusals.add("refused_connections", "connection_cap",
                               "%s: %d connections open, the cap; new ones are closed at accept",
                               owner.label, owner.limits.max_connections, transport=owner.transport)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End the kept-alive connections too: a stopped server answers nothing more."""
        with self.connections_lock:
            connections, self.connections = list(self.connections), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        # One line instead of the stdlib's traceback on stderr.
        error = sys.exc_info()[1]
        self.owner.counters.add("connection_errors", transport=self.owner.transport)
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            # The client went away before it read the answer (a rank exiting as its
            # last export is answered): counted, but no failure to tell the user of.
            log.debug("%s client %s went away: %s", self.owner.label, client_address[0], error)
            return
        log.warning("%s connection from %s failed: %s", self.owner.label, client_address[0], error)

    def finish_request(self, request, client_address) -> None:
        # The TLS handshake runs here, on the connection's own thread, so a slow or
        # broken client cannot hold up accept() for everyone else.
        if self.ssl_ctx is not None:
            owner = self.owner
            try:
                request = self._handshake(request)
            except TimeoutError:
                owner.refusals.add("timed_out_requests", "handshake",
                                   "%s: a TLS handshake did not finish within %g s; connection closed",
                                   owner.label, owner.limits.handshake_timeout_s, transport=owner.transport)
                return
            except (OSError, ValueError) as exc:
                owner.counters.add("tls_handshake_errors", transport=owner.transport)
                log.debug("TLS handshake from %s failed: %s", client_address, exc)
                return
        super().finish_request(request, client_address)

    def _handshake(self, sock: socket.socket) -> ssl.SSLSocket:
        """The server side of a TLS handshake, all of it within `handshake_timeout` (a
        client that sends its hello a byte at a time is cut off too)."""
        deadline = time.monotonic() + self.owner.limits.handshake_timeout_s
        conn = self.ssl_ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        conn.setblocking(False)
        while True:
            try:
                conn.do_handshake()
                break
            except ssl.SSLWantReadError:
                event = select.POLLIN
            except ssl.SSLWantWriteError:
                event = select.POLLOUT
            poller = select.poll()  # (not select(): descriptors past 1,024 are normal here)
            poller.register(conn, event)
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                conn.close()
                raise TimeoutError
        conn.setblocking(True)
        return conn


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each within what is left of the current phase's deadline.

    Phases: "idle" (waiting for a request; its first byte starts "headers"),
    "headers", "body". A deadline that passes ends the connection with TimeoutError,
    counted for "headers" and "body" (an idle keep-alive connection ending is normal)."""

    def __init__(self, sock: socket.socket, owner: HttpService) -> None:
        self.sock = sock
        self.owner = owner
        self.phase = "headers"
        self.deadline = time.monotonic() + owner.limits.read_header_timeout_s

    def expect(self, phase: str, within_s: float) -> None:
        self.phase, self.deadline = phase, time.monotonic() + within_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            owner, limits = self.owner, self.owner.limits
            if self.phase != "idle":
                timeout = limits.read_timeout_s if self.phase == "body" else limits.read_header_timeout_s
                owner.refusals.add("timed_out_requests", self.phase,
                                   "%s: a request's %s did not arrive within %g s; connection closed",
                                   owner.label, self.phase, timeout, transport=owner.transport)
            raise TimeoutError(f"no request {self.phase} within the deadline") from None
        if n and self.phase == "idle":
            self.expect("headers", self.owner.limits.read_header_timeout_s)
        return n


class Handler(BaseHTTPRequestHandler):
    """Framing, auth and error handling; an endpoint overrides `respond` (and `error`)."""

    protocol_version = "HTTP/1.1"
    server_version = "flare-collector"
    # The head and the body of a reply are two writes: with Nagle's algorithm the body
    # waits for the client's delayed ACK of the head, 40 ms per request on Linux.
    disable_nagle_algorithm = True
    timeout = None  # each phase has a deadline of its own (_DeadlineReader)
    server: Server
    body_length: int | None  # None: no framing headers; CHUNKED; else Content-Length

    def version_string(self) -> str:
        return self.server_version

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self._reader = _DeadlineReader(self.connection, self.server.owner)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        super().handle_one_request()
        limits = self.server.owner.limits
        self._reader.expect("idle", limits.idle_timeout_s)
        # the reply to a client that does not read it is given up after read_timeout
        self.connection.settimeout(limits.read_timeout_s)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def parse_request(self) -> bool:
        self._expect_continue = False
        return super().parse_request()

    def handle_expect_100(self) -> bool:
        self._expect_continue = True  # "100 Continue" only once the token and framing pass
        return True

    # ------------------------------------------------------------------ the request
    def respond(self, method: str, path: str) -> Response:
        """The endpoint's answer (each server's handler defines it; nothing is served here)."""
        return _plain(404, f"no endpoint at {path}")

    def error(self, status: int, message: str, retry_after_s: float | None = None) -> Response:
        return _plain(status, message)

    def _dispatch(self) -> None:
        method, owner = self.command, self.server.owner
        path = urlsplit(self.path).path
        self.body_length = None
        self._body_done = False
        try:
            self._reader.expect("body", owner.limits.read_timeout_s)
            if not self._authorized(method, path):
                owner.counters.add("unauthenticated_requests", transport=owner.transport)
                self._drop_unauthenticated_body()
                response = self.error(401, "missing or invalid bearer token")
            else:
                self.body_length = self._framing()
                if self._expect_continue and self.body_length:
                    self.send_response_only(100)
                    self.end_headers()
                response = self.respond(method, path)
                if not self._body_done:
                    self.read_body()  # what the endpoint did not read, dropped within the cap
        except MalformedPayload as exc:
            response = self.error(400, str(exc))
        except PayloadTooLarge as exc:
            owner.counters.add("too_large_requests", transport=owner.transport)
            response = self.error(413, str(exc))
        except (ConnectionError, TimeoutError) as exc:  # the client went away mid-body
            self.close_connection = True
            log.debug("%s request from %s ended: %s", owner.label, self.client_address[0], exc)
            return
        except Exception as exc:  # a bug: one log line and a 500, not a traceback
            owner.counters.add("internal_errors", transport=owner.transport)
            log.error("%s failed on %s %s: %s", owner.label, method, path, exc)
            response = self.error(500, "internal error in the collector")
        self._send(method, *response)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

    def _authorized(self, method: str, path: str) -> bool:
        owner = self.server.owner
        if owner.auth is None or (method in ("GET", "HEAD") and path in owner.open_paths):
            return True
        return owner.auth.check(*(self.headers.get_all("Authorization") or ()))

    def _drop_unauthenticated_body(self) -> None:
        length = self.headers.get_all("Content-Length") or []
        if self._expect_continue or self.headers.get("Transfer-Encoding") or len(length) > 1:
            self.close_connection = True
        elif length:
            text = length[0].strip()
            if _DIGITS.fullmatch(text) and len(text) < 10 and int(text) <= UNAUTHENTICATED_DRAIN:
                self._discard(int(text))
            else:
                self.close_connection = True

    # ------------------------------------------------------------------ bodies
    def _framing(self) -> int | None:
        """The body's length from its headers (checked, not read); 400 or 413 at once."""
        codings = self.headers.get_all("Transfer-Encoding") or []
        lengths = self.headers.get_all("Content-Length") or []
        try:
            if codings:
                names = [c.strip().lower() for value in codings for c in value.split(",") if c.strip()]
                if names != ["chunked"]:
                    raise MalformedPayload(f"unsupported Transfer-Encoding {', '.join(codings)!r} (only chunked)")
                if lengths:
                    raise MalformedPayload("Content-Length and Transfer-Encoding together")
                return CHUNKED
            if not lengths:
                return None
            text = lengths[0].strip()
            if len({value.strip() for value in lengths}) > 1:
                raise MalformedPayload("conflicting Content-Length headers")
            if text.startswith("-"):
                raise MalformedPayload("Content-Length is negative")
            if not _DIGITS.fullmatch(text):
                raise MalformedPayload(f"Content-Length {text[:40]!r} is not a number")
        except MalformedPayload:
            self.close_connection = True  # where the body ends is unknown
            raise
        length = int(text) if len(text) <= 18 else 1 << 62
        limit = self.server.owner.max_body_bytes
        if length > limit:
            # Read (and drop) a moderately oversized body so the client, still sending,
            # gets the 413 rather than a reset connection; beyond that, hang up.
            if length <= limit + DISCARD_MAX and not self._expect_continue:
                self._discard(length)
            else:
                self.close_connection = True
            raise PayloadTooLarge(f"body of {length} bytes exceeds the {limit} byte limit")
        return length

    def read_body(self, limit: int | None = None) -> bytes:
        """The body, at most the cap (or `limit` when smaller: 413 over it); b"" without
        one. A second call returns b""."""
        if self._body_done:
            return b""
        self._body_done = True
        if self.body_length is None:
            return b""
        limit = min(limit or self.server.owner.max_body_bytes, self.server.owner.max_body_bytes)
        if self.body_length == CHUNKED:
            return self._read_chunked(limit)
        if self.body_length > limit:
            # Read and dropped up to 1 MiB over, so the client, still sending, gets the
            # 413 rather than a reset connection; beyond that, hang up.
            if self.body_length <= limit + UNAUTHENTICATED_DRAIN and not self._expect_continue:
                self._discard(self.body_length)
            else:
                self.close_connection = True
            raise PayloadTooLarge(f"body of {self.body_length} bytes exceeds the {limit} byte limit here")
        body = self.rfile.read(self.body_length)
        if len(body) != self.body_length:
            raise ConnectionError("client closed the connection mid-body")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        parts = []
        total = 0
        try:
            while True:
                size_text = self._line().split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size_text):
                    raise MalformedPayload(f"bad chunk size {size_text[:20].decode('latin-1')!r} in chunked body")
                size = int(size_text, 16)
                if size == 0:
                    break
                total += size
                if total > limit:
                    self.close_connection = True  # the rest of the stream is not read
                    raise PayloadTooLarge(f"chunked body exceeds the {limit} byte limit")
                chunk = self.rfile.read(size)
                if len(chunk) != size:
                    raise ConnectionError("client closed the connection mid-body")
                parts.append(chunk)
                if self._line().strip():
                    raise MalformedPayload("chunk data longer than its chunk size")
            trailers = 0
            while (line := self._line()).strip():
                trailers += len(line)
                if trailers > _TRAILERS_MAX:
                    raise MalformedPayload("chunked body trailers are too long")
        except MalformedPayload:
            self.close_connection = True
            raise
        return b"".join(parts)

    def _line(self) -> bytes:
        line = self.rfile.readline(_LINE_MAX + 1)
        if not line.endswith(b"\n"):
            if len(line) > _LINE_MAX:
                raise MalformedPayload("line too long in chunked body")
            raise ConnectionError("client closed the connection mid-body")
        return line

    def _discard(self, length: int) -> None:
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 20))
            if not chunk:
                self.close_connection = True
                break
            length -= len(chunk)

    # ------------------------------------------------------------------ the reply
    def _send(self, method: str, status: int, headers: dict[str, str], body: bytes) -> None:
        self.connection.settimeout(self.server.owner.limits.read_timeout_s)
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in ("content-length", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)


class HttpService:
    """One listening server on its own thread; `handler` answers its requests."""

    handler: type[Handler] = Handler

    def __init__(self, label: str, transport: str, thread: str, endpoint: Endpoint,
                 tls: dict[str, Any] | None, counters: Counters, max_body_bytes: int,
                 limits: Limits | None = None) -> None:
        self.label = label  # for log lines and start errors: "OTLP/HTTP", "flare_query"
        self.transport = transport  # the counters' transport label
        self.thread = thread
        self.listen = endpoint
        self.tls = tls
        self.counters = counters
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.refusals = Refusals(counters)
        self.auth: Any | None = None  # security.BearerAuth
        self.open_paths: frozenset[str] = frozenset()  # GET/HEAD without the token
        self.endpoint: str | None = None
        self._server: Server | None = None

    def start(self) -> str:
        host, port = self.listen.host, self.listen.port
        ctx = ssl_context(self.tls)
        try:
            server = Server((host, port), self.handler, self, ctx)
        except OSError as exc:
            raise StartError(f"cannot listen for {self.label} on {self.listen}: {exc.strerror}") from None
        self._server = server
        bound = server.server_address[1]
        self.endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"flare-{self.thread}", daemon=True,
        ).start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.close_connections()
            self._server = None
