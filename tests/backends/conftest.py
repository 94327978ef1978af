"""A real loopback HTTP server that answers from recorded responses, for contract tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

SHARED_FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
TEMPO_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tempo"

# A route answers (status, body); body is bytes, or anything JSON-serialisable.
Route = Callable[[dict[str, list[str]]], tuple[int, Any]]


class RecordedServer:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[tuple[str, dict[str, list[str]], dict[str, str]]] = []
        self.delay_s = 0.0
        self.bytes_sent = 0  # response bodies, for what a backend pulls
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                server.requests.append((url.path, query, dict(self.headers)))
                if server.delay_s:
                    time.sleep(server.delay_s)
                route = server.routes.get(url.path)
                status, body = route(query) if route else (404, b"404 page not found\n")
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                server.bytes_sent += len(data)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, path: str, body: Any, status: int = 200) -> None:
        self.routes[path] = lambda _query: (status, body)

    def paths(self) -> list[str]:
        return [p for p, _, _ in self.requests]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def recorded_server():
    server = RecordedServer()
    yield server
    server.close()


def load_fixture(directory: Path, name: str) -> Any:
    path = directory / name
    if not path.exists():
        pytest.skip(f"recorded response {path} is not on this machine")
    return json.loads(path.read_text())


@pytest.fixture
def jaeger_fixture():
    """Load a recorded Jaeger response from ../shared/fixtures/jaeger (skip if absent)."""
    return lambda name: load_fixture(SHARED_FIXTURES / "jaeger", name)


@pytest.fixture
def tempo_fixture():
    """Load a recorded Tempo response kept in tests/fixtures/tempo."""
    return lambda name: load_fixture(TEMPO_FIXTURES, name)
