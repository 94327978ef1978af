"""Hostile HTTP framing against a real collector's OTLP/HTTP receiver and extensions.

Raw sockets over loopback. "Bounded" is checked by what the client sends: for every
refusal below the reply has to arrive while the body has *not* been sent (a server
that waits for the body, or reads it to EOF, never answers within the timeout), and
a chunked body streamed past the cap is cut off near the cap.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from flare.collector import config
from flare.collector.errors import ConfigError
from flare.collector.http_server import DISCARD_MAX
from flare.collector.service import Collector

TOKEN = "b0unds-token"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"
CAP = 1 << 20  # the receiver's max_request_body_size here; the extensions' cap too
TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
BODY = ExportTraceServiceRequest(resource_spans=[ResourceSpans()]).SerializeToString()  # no spans


def _collector(tmp_path, health_open: bool | None) -> Collector:
    cfg = config.embedded_config(str(tmp_path / "store.duckdb"))
    protocols = cfg["receivers"]["otlp"]["protocols"]
    protocols["http"].update(max_request_body_size="1MiB", auth={"bearer_token": TOKEN})
    protocols["grpc"]["auth"] = {"bearer_token": TOKEN}
    metrics = {"endpoint": "127.0.0.1:0", "auth": {"bearer_token": TOKEN}}
    if health_open is not None:
        metrics["health_open"] = health_open
    cfg["extensions"]["flare_metrics"] = metrics
    cfg["extensions"]["flare_query"] = {"endpoint": "127.0.0.1:0", "auth": {"bearer_token": TOKEN}}
    cfg["service"]["extensions"] += ["flare_metrics", "flare_query"]
    collector = Collector(cfg)
    collector.start()
    return collector


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    c = _collector(tmp_path_factory.mktemp("bounds"), health_open=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def closed_collector(tmp_path_factory):
    c = _collector(tmp_path_factory.mktemp("closed"), health_open=None)  # the default
    yield c
    c.stop()


def _connect(endpoint: str, timeout_s: float = 2.0) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def _read_reply(sock: socket.socket, buffered: bytes = b"", *, has_body: bool = True,
                ) -> tuple[int, dict[str, str], bytes, bytes]:
    """(status, headers, body, what followed) of one reply; a timeout fails the test."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without a reply: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0)) if has_body else 0
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-reply"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length], rest[length:]


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def exchange(endpoint: str, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes, bool]:
    """Send `head` (and `body`, which may be partial), read the reply; closed afterwards?"""
    with _connect(endpoint) as sock:
        sock.sendall(head.encode("latin-1") + body)
        status, headers, reply, _ = _read_reply(sock, has_body=not head.startswith("HEAD "))
        closed = headers.get("connection") == "close" and _closed(sock)
        return status, headers, reply, closed


ENDPOINTS = {  # (which endpoint, method, path)
    "receiver": ("http_endpoint", "POST", "/v1/traces"),
    "metrics": ("metrics_endpoint", "GET", "/metrics"),
    "query": ("query_endpoint", "GET", "/api/v3/services"),
}


def _head(method: str, path: str, extra: str, token: bool) -> str:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"{AUTH if token else ''}{extra}\r\n")


# (framing headers, partial body sent, status with the token) — never the whole body
HOSTILE = {
    "content-length -1": ("Content-Length: -1\r\n", b"x" * 100, 400),
    "content-length abc": ("Content-Length: abc\r\n", b"x" * 100, 400),
    "content-length +5": ("Content-Length: +5\r\n", b"x" * 5, 400),
    "content-length twice": ("Content-Length: 5\r\nContent-Length: 6\r\n", b"x" * 5, 400),
    "content-length beyond discard": (f"Content-Length: {CAP + DISCARD_MAX + 1}\r\n", b"x" * 100, 413),
    "content-length huge": (f"Content-Length: {'9' * 40}\r\n", b"", 413),
    "chunk size -1": ("Transfer-Encoding: chunked\r\n", b"-1\r\n" + b"x" * 100, 400),
    "chunk size zz": ("Transfer-Encoding: chunked\r\n", b"zz\r\n" + b"x" * 100, 400),
    "chunk size 0x10": ("Transfer-Encoding: chunked\r\n", b"0x10\r\n" + b"x" * 16, 400),
    "chunk size huge": ("Transfer-Encoding: chunked\r\n", b"f" * 40 + b"\r\n" + b"x" * 100, 413),
    "chunk over cap": ("Transfer-Encoding: chunked\r\n", b"%x\r\n" % (CAP + 1) + b"x" * 100, 413),
    "chunk size line endless": ("Transfer-Encoding: chunked\r\n", b"1" * 5000, 400),
    "chunked and length": ("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", b"5\r\n", 400),
    "transfer-encoding gzip": ("Transfer-Encoding: gzip\r\n", b"x" * 100, 400),
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_hostile_framing_is_refused_before_the_body(collector, endpoint, case, token):
    attr, method, path = ENDPOINTS[endpoint]
    extra, partial, status = HOSTILE[case]
    code, _, reply, closed = exchange(getattr(collector, attr), _head(method, path, extra, token), partial)
    assert code == (status if token else 401), reply
    assert closed  # the rest of the stream is never read
    assert reply.count(b"\n") <= 1 and reply  # one line (or one google.rpc.Status)


def test_over_cap_within_the_discard_allowance_keeps_the_connection(collector):
    body = b"x" * (CAP + 1000)
    with _connect(collector.http_endpoint, timeout_s=5) as sock:
        sock.sendall(_head("POST", "/v1/traces", f"Content-Length: {len(body)}\r\n", True).encode() + body)
        assert _read_reply(sock)[0] == 413
        sock.sendall(_head("POST", "/v1/traces", f"Content-Length: {len(BODY)}\r\n", True).encode() + BODY)
        assert _read_reply(sock)[0] == 200


def test_chunked_stream_past_the_cap_is_cut_off_near_the_cap(collector):
    """A body streamed in valid chunks: the server stops reading at the cap."""
    sock = _connect(collector.http_endpoint, timeout_s=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    sock.sendall(_head("POST", "/v1/traces", "Transfer-Encoding: chunked\r\n", True).encode())
    sent = 0
    chunk = b"%x\r\n" % (64 << 10) + b"x" * (64 << 10) + b"\r\n"

    def stream() -> None:
        nonlocal sent
        try:
            while sent < (64 << 20):
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server hung up

    sender = threading.Thread(target=stream)
    sender.start()
    try:
        status = _read_reply(sock)[0]
    finally:
        sender.join(5)
        sock.close()
    assert status == 413
    assert sent < CAP + (8 << 20), sent  # the cap plus what the socket buffers hold


def test_valid_chunked_body_with_trailers_is_accepted(collector):
    body = b"%x\r\n" % len(BODY) + BODY + b"\r\n"
    head = _head("POST", "/v1/traces", "Transfer-Encoding: chunked\r\n", True)
    status, _, _, closed = exchange(collector.http_endpoint, head, body + b"0\r\nX-Trailer: 1\r\n\r\n")
    assert status == 200 and not closed


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_unknown_path_is_401_without_the_token_and_404_with_it(collector, endpoint):
    attr, method, _ = ENDPOINTS[endpoint]
    with _connect(getattr(collector, attr)) as sock:
        sock.sendall(_head(method, "/nope", "Content-Length: 3\r\n", False).encode() + b"abc")
        assert _read_reply(sock)[0] == 401
        sock.sendall(_head(method, "/nope", "Content-Length: 3\r\n", True).encode() + b"abc")
        assert _read_reply(sock)[0] == 404  # the 401's small body was dropped: same connection


def test_expect_continue_is_answered_only_with_the_token(collector):
    head = "Content-Length: 100\r\nExpect: 100-continue\r\n"
    status, _, _, closed = exchange(collector.http_endpoint, _head("POST", "/v1/traces", head, False))
    assert status == 401 and closed  # no "100 Continue": the client never sends the body
    with _connect(collector.http_endpoint) as sock:
        head = f"Content-Length: {len(BODY)}\r\nExpect: 100-continue\r\n"
        sock.sendall(_head("POST", "/v1/traces", head, True).encode())
        status, _, _, rest = _read_reply(sock)
        assert status == 100
        sock.sendall(BODY)
        assert _read_reply(sock, rest)[0] == 200


def test_health_open_lets_only_get_health_through(collector):
    metrics = collector.metrics_endpoint
    for method in ("GET", "HEAD"):
        status, _, reply, _ = exchange(metrics, _head(method, "/health", "", False))
        assert status == 200 and reply == (b"ok\n" if method == "GET" else b"")
    assert exchange(metrics, _head("GET", "/healthz?x=1", "", False))[0] == 200
    assert exchange(metrics, _head("POST", "/health", "Content-Length: 0\r\n", False))[0] == 401
    assert exchange(metrics, _head("GET", "/metrics", "", False))[0] == 401
    assert exchange(metrics, _head("GET", "/metrics", "", True))[0] == 200
    # the other endpoints keep /health behind the token
    assert exchange(collector.query_endpoint, _head("GET", "/health", "", False))[0] == 401


def test_health_is_behind_the_token_by_default(closed_collector):
    metrics = closed_collector.metrics_endpoint
    assert exchange(metrics, _head("GET", "/health", "", False))[0] == 401
    assert exchange(metrics, _head("GET", "/health", "", True))[0] == 200


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_duplicate_authorization_headers_are_refused_over_http(collector, endpoint):
    attr, method, path = ENDPOINTS[endpoint]
    body = BODY if method == "POST" else b""
    twice = f"{AUTH}Content-Length: {len(body)}\r\n"
    assert exchange(getattr(collector, attr), _head(method, path, twice, True), body)[0] == 401
    wrong_first = f"Authorization: Bearer wrong\r\nContent-Length: {len(body)}\r\n"
    assert exchange(getattr(collector, attr), _head(method, path, wrong_first, True), body)[0] == 401
    once = f"Content-Length: {len(body)}\r\n"  # the query endpoint: 503 until the store exists
    assert exchange(getattr(collector, attr), _head(method, path, once, True), body)[0] in (200, 503)


def test_duplicate_authorization_metadata_is_refused_over_grpc(collector):
    with grpc.insecure_channel(collector.grpc_endpoint) as channel:
        export = channel.unary_unary(TRACE_METHOD)
        export(BODY, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)
        for metadata in ([("authorization", f"Bearer {TOKEN}")] * 2,
                         [("authorization", "Bearer wrong"), ("authorization", f"Bearer {TOKEN}")]):
            with pytest.raises(grpc.RpcError) as info:
                export(BODY, metadata=metadata, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_open_is_validated(tmp_path):
    def metrics(**options):
        cfg = config.embedded_config(str(tmp_path / "s.duckdb"), metrics_port=0)
        cfg["extensions"]["flare_metrics"].update(options)
        return cfg

    assert config.parse(metrics(health_open=True)).metrics_endpoint.health_open is True
    assert config.parse(metrics()).metrics_endpoint.health_open is False
    with pytest.raises(ConfigError, match=r"^extensions\.flare_metrics\.health_open: expected true or false"):
        config.parse(metrics(health_open="yes"))
    cfg = metrics()
    cfg["extensions"]["flare_query"] = {"health_open": True}
    cfg["service"]["extensions"].append("flare_query")
    with pytest.raises(ConfigError, match=r"flare_query: unknown option 'health_open'"):
        config.parse(cfg)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(metrics(health_open="sometimes")))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "flare.collector", "--config", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "health_open" in result.stderr
    assert time.monotonic() - started < 10


def test_a_client_that_goes_away_unanswered_is_no_warning(collector, caplog):
    """A rank that exits as its last export is answered resets the connection: the
    server's write fails, which is the client's leaving, not a failure to tell the user
    of (`flare run` printed "OTLP/HTTP connection from 127.0.0.1 failed: [Errno 32]
    Broken pipe" after a job now and then). The server answers the next client."""
    import logging
    import struct

    caplog.set_level(logging.DEBUG, logger="flare.collector.http_server")
    request = _head("POST", "/v1/traces", f"Content-Length: {len(BODY)}\r\n", True).encode() + BODY
    for _ in range(20):
        sock = _connect(collector.http_endpoint, timeout_s=5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        sock.sendall(request)
        sock.close()
    with _connect(collector.http_endpoint, timeout_s=5) as sock:
        sock.sendall(request)
        assert _read_reply(sock)[0] == 200
    said = [r for r in caplog.records if r.name == "flare.collector.http_server"]
    assert not [r for r in said if r.levelno >= logging.WARNING], [r.getMessage() for r in said]
    assert any("went away" in r.getMessage() for r in said)  # the resets did reach the server
