"""HTTP extensions: `flare_metrics` (Prometheus scrape) and `flare_query` (read API).

Each runs its own `http_server` (the receiver's: the token before any body byte,
bounded bodies) on its own port, so a slow scrape or a heavy trace query never
competes with the OTLP receivers' accept loop. `flare_metrics.health_open` lets
GET /health (and /healthz) through without the token.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from flare.collector.config import HttpExtensionConfig
from flare.collector.http_server import Handler, HttpService, Response
from flare.collector.security_hooks import bearer_auth, load_query_api
from flare.collector.telemetry import Counters, Registry

# (method, path, query, headers) -> (status, headers, body)
Responder = Callable[[str, str, dict[str, list[str]], dict[str, str]], Response]
HEALTH_PATHS = frozenset(("/health", "/healthz"))
MAX_BODY = 1 << 20  # neither extension reads a body; one up to this size is dropped


class _Handler(Handler):
    def respond(self, method: str, path: str) -> Response:
        query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
        return self.server.owner.responder(method, path, query, dict(self.headers.items()))


class HttpExtension(HttpService):
    handler = _Handler

    def __init__(self, name: str, options: HttpExtensionConfig, responder: Responder, counters: Counters) -> None:
        super().__init__(name, name, name, options.endpoint, options.tls, counters, MAX_BODY)
        self.name = name
        self.options = options
        self.responder = responder
        self.open_paths = HEALTH_PATHS if options.health_open else frozenset()

    def start(self) -> str:
        self.auth = bearer_auth(self.options.auth)
        return super().start()


def metrics_responder(registry: Registry) -> Responder:
    def respond(method, path, query, headers):
        if path in HEALTH_PATHS:  # liveness for orchestrators
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
