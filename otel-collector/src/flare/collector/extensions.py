"""HTTP extensions: `flare_metrics` (Prometheus scrape) and `flare_query` (read API).

Each runs its own small threaded HTTP server on its own port, so a slow scrape or a
heavy trace query never competes with the OTLP receivers' accept loop.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from flare.collector.config import HttpExtensionConfig
from flare.collector.errors import StartError
from flare.collector.security_hooks import bearer_auth, load_query_api, ssl_context
from flare.collector.telemetry import Counters, Registry

log = logging.getLogger(__name__)

# (method, path, query, headers) -> (status, headers, body)
Responder = Callable[[str, str, dict[str, list[str]], dict[str, str]], tuple[int, dict[str, str], bytes]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, responder: Responder, auth: Any, ssl_ctx: Any, counters: Counters, name: str) -> None:
        self.responder = responder
        self.auth = auth
        self.ssl_ctx = ssl_ctx
        self.counters = counters
        self.name = name
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address) -> None:
        log.warning("%s connection from %s failed: %s", self.name, client_address[0], sys.exc_info()[1])

    def finish_request(self, request, client_address) -> None:
        if self.ssl_ctx is not None:
            try:
                request = self.ssl_ctx.wrap_socket(request, server_side=True)
            except (OSError, ValueError):
                self.counters.add("tls_handshake_errors", transport=self.name)
                return
        super().finish_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "flare-collector"
    timeout = 120
    server: _Server

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _respond(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(min(length, 1 << 20))
        if self.server.auth is not None and not self.server.auth.check(self.headers.get("Authorization")):
            self.server.counters.add("unauthenticated_requests", transport=self.server.name)
            status, headers, body = 401, {"Content-Type": "text/plain"}, b"missing or invalid bearer token\n"
        else:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query, keep_blank_values=True)
            try:
                status, headers, body = self.server.responder(method, parts.path, query, dict(self.headers.items()))
            except Exception as exc:  # a bug in a responder is a 500, not a dead thread
                log.error("%s failed on %s: %s", self.server.name, self.path, exc)
                status, headers, body = 500, {"Content-Type": "text/plain"}, f"internal error: {exc}\n".encode()
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() != "content-length":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._respond("GET")

    def do_HEAD(self) -> None:
        self._respond("HEAD")

    def do_POST(self) -> None:
        self._respond("POST")


class HttpExtension:
    def __init__(self, name: str, options: HttpExtensionConfig, responder: Responder, counters: Counters) -> None:
        self.name = name
        self.options = options
        self.responder = responder
        self.counters = counters
        self.endpoint: str | None = None
        self._server: _Server | None = None

    def start(self) -> str:
        auth = bearer_auth(self.options.auth)
        ctx = ssl_context(self.options.tls)
        host, port = self.options.endpoint.host, self.options.endpoint.port
        try:
            server = _Server((host, port), self.responder, auth, ctx, self.counters, self.name)
        except OSError as exc:
            raise StartError(f"cannot listen for {self.name} on {self.options.endpoint}: {exc.strerror}") from None
        self._server = server
        bound = server.server_address[1]
        self.endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"flare-{self.name}", daemon=True,
        ).start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def metrics_responder(registry: Registry) -> Responder:
    def respond(method, path, query, headers):
        if path in ("/health", "/healthz"):  # liveness for orchestrators
            return 200, {"Content-Type": "text/plain"}, b"ok\n"
        if path not in ("/metrics", "/"):
            return 404, {"Content-Type": "text/plain"}, b"scrape /metrics (or /health)\n"
        body = registry.render().encode()
        return 200, {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}, body

    return respond


def query_responder(store_path: str) -> Responder:
    handle = load_query_api().handle

    def respond(method, path, query, headers):
        return handle(store_path, method, path, query, headers)

    return respond
