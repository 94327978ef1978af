"""Slow, half-open and idle clients against a real collector's listeners.

Each test is one finding of the security probe, kept standing: half-open gRPC calls
(with and without the token), TCP connections that never start TLS, headers and bodies
that trickle in, more connections than the cap. Timeouts are set short here (the
defaults are in `config.Limits`); `benchmarks/slow_clients.py` measures the same at
the defaults and at scale.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

TOKEN = "t0ken-for-slow-client-tests"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _collector(tmp_path, tls=None, auth=True, **limits):
    from flare.collector.config import embedded_config
    from flare.collector.service import Collector

    config = embedded_config(str(tmp_path / "store.duckdb"))
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        protocol.update(limits)
        if auth:
            protocol["auth"] = {"bearer_token": TOKEN}
        if tls:
            protocol["tls"] = tls
    collector = Collector(config)
    collector.start()
    return collector


def _export(channel, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5.0) -> float:
    """One valid OTLP/gRPC export; its latency in seconds."""
    call = channel.unary_unary(EXPORT)
    started = time.perf_counter()
    call(trace_service_pb2.ExportTraceServiceRequest().SerializeToString(), metadata=metadata, timeout=timeout)
    return time.perf_counter() - started


def _half_open(channel, n: int, metadata) -> tuple[list, threading.Event]:
    """`n` calls that send their headers and never their request message."""
    never = threading.Event()

    def body():
        never.wait()
        return
        yield  # (a generator that yields nothing until released)

    call = channel.stream_unary(EXPORT)
    return [call.future(body(), metadata=metadata) for _ in range(n)], never


def _counter(collector, name: str, **labels) -> float:
    return collector.counters.get(name, **labels)


def test_half_open_grpc_calls_without_the_token_are_refused_at_once(tmp_path):
    collector = _collector(tmp_path)
    channel = grpc.insecure_channel(collector.grpc_endpoint)
    try:
        calls, never = _half_open(channel, 100, metadata=())
        for call in calls:  # refused before any body byte: no call waits for its request
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        latency = max(_export(channel) for _ in range(5))
        assert latency < 2.0, latency  # (≤ 100 ms on a quiet host: benchmarks/slow_clients.py)
        assert _counter(collector, "unauthenticated_requests", transport="grpc") == 100
        never.set()
    finally:
        channel.close()
        collector.stop()


def test_half_open_grpc_calls_with_the_token_hold_no_worker_and_end_at_the_read_timeout(tmp_path):
    collector = _collector(tmp_path, read_timeout="1500ms", max_concurrent_calls=120)
    channel = grpc.insecure_channel(collector.grpc_endpoint)
    auth = (("authorization", f"Bearer {TOKEN}"),)
    try:
        calls, never = _half_open(channel, 100, metadata=auth)
        time.sleep(0.3)
        # 100 calls wait for their bodies (16 workers): exports are still answered at once
        latencies = [_export(channel) for _ in range(5)]
        assert max(latencies) < 1.0, latencies
        # over the cap: refused at once with a retry delay, counted
        more, _ = _half_open(channel, 30, metadata=auth)
        refused = 0
        for call in more:
            try:
                call.result(timeout=10)
            except grpc.RpcError as exc:
                refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused >= 10, refused
        assert _counter(collector, "refused_connections", cause="in_flight_cap", transport="grpc") == refused
        # the read timeout ends the half-open ones
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _counter(collector, "timed_out_requests", cause="body", transport="grpc") >= 100
        never.set()
        assert _export(channel) < 1.0
    finally:
        channel.close()
        collector.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the peer closes `sock` (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def test_connections_that_never_start_tls_are_closed_at_the_handshake_timeout(tmp_path, certs):
    tls = {"cert_file": certs["server"] + ".pem", "key_file": certs["server"] + ".key"}
    collector = _collector(tmp_path, tls=tls, handshake_timeout="1s")
    try:
        for endpoint in (collector.http_endpoint, collector.grpc_endpoint):
            idle = [socket.create_connection(_host_port(endpoint)) for _ in range(5)]
            assert all(_closed_within(s, 8.0) for s in idle), endpoint
            for s in idle:
                s.close()
        assert _counter(collector, "timed_out_requests", cause="handshake", transport="http") == 5
        # a client hello sent a byte every 0.2 s: the deadline is for the whole handshake
        hello_context = ssl.create_default_context()
        hello_context.check_hostname, hello_context.verify_mode = False, ssl.CERT_NONE
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        client = hello_context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
        with pytest.raises(ssl.SSLWantReadError):
            client.do_handshake()
        hello = outgoing.read()
        with socket.create_connection(_host_port(collector.http_endpoint)) as slow:
            started = time.monotonic()
            try:
                for byte in hello:
                    slow.sendall(bytes([byte]))
                    time.sleep(0.2)
            except OSError:
                pass  # cut off
            assert time.monotonic() - started < 5.0
        assert _counter(collector, "timed_out_requests", cause="handshake", transport="http") == 6
        # a client that does handshake is served as before
        context = ssl.create_default_context(cafile=certs["ca"] + ".pem")
        with socket.create_connection(_host_port(collector.http_endpoint)) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            conn.sendall(b"GET /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n")
            assert conn.recv(64).startswith(b"HTTP/1.1 ")
    finally:
        collector.stop()


def test_headers_and_bodies_that_trickle_in_are_cut_off_at_their_deadline(tmp_path):
    collector = _collector(tmp_path, read_header_timeout="1s", read_timeout="1s")
    host, port = _host_port(collector.http_endpoint)
    try:
        # slowloris: one byte of headers every 0.2 s never ends the phase's deadline
        with socket.create_connection((host, port)) as s:
            s.sendall(b"POST /v1/traces HTTP/1.1\r\n")
            started = time.monotonic()
            try:
                for _ in range(50):
                    s.sendall(b"X")
                    time.sleep(0.2)
            except OSError:
                pass
            assert time.monotonic() - started < 6.0
        assert _counter(collector, "timed_out_requests", cause="headers", transport="http") == 1
        # a body that stops half-way
        with socket.create_connection((host, port)) as s:
            s.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      "Content-Type: application/x-protobuf\r\nContent-Length: 1000\r\n\r\n".encode() + b"x" * 10)
            assert _closed_within(s, 6.0)
        assert _counter(collector, "timed_out_requests", cause="body", transport="http") == 1
        # an idle connection that never sends a byte: cut off at the header deadline too
        with socket.create_connection((host, port)) as s:
            assert _closed_within(s, 6.0)
    finally:
        collector.stop()


def test_connections_over_the_cap_are_closed_at_accept_and_threads_stay_bounded(tmp_path):
    collector = _collector(tmp_path, auth=False, max_connections=40)
    host, port = _host_port(collector.http_endpoint)
    before = threading.active_count()
    held = []
    try:
        for _ in range(60):
            held.append(socket.create_connection((host, port)))
        time.sleep(0.5)
        assert threading.active_count() - before <= 40
        assert _counter(collector, "refused_connections", cause="connection_cap", transport="http") >= 20
        for s in held[40:]:
            assert _closed_within(s, 5.0)
        for s in held[:10]:  # room again: a request is served
            s.close()
        time.sleep(0.3)
        with socket.create_connection((host, port)) as s:
            s.sendall(b"GET /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(5)
            assert s.recv(64).startswith(b"HTTP/1.1 405")
    finally:
        for s in held:
            s.close()
        collector.stop()


def _env(**values: str) -> dict[str, str]:
    """A bare environment for a `flare collector` child (PYTHONPATH kept where set)."""
    keep = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}
    return {**keep, **values}


def test_a_port_already_taken_is_one_line_without_grpc_cores_own(tmp_path):
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env(FLARE_OTLP_GRPC_PORT=str(port), FLARE_OTLP_HTTP_PORT="0", FLARE_METRICS_PORT="0",
                   FLARE_STORE=str(tmp_path / "s.duckdb"))
        done = subprocess.run([sys.executable, "-m", "flare.collector", "--config", "embedded"],
                              env=env, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert f"cannot listen for OTLP/gRPC on 127.0.0.1:{port}" in lines[0]


def test_exposure_without_tls_or_token_needs_the_explicit_flag(tmp_path):
    import subprocess
    import sys

    env = _env(FLARE_HOST="0.0.0.0", FLARE_OTLP_GRPC_PORT="0", FLARE_OTLP_HTTP_PORT="0",
               FLARE_METRICS_PORT="0", FLARE_STORE=str(tmp_path / "s.duckdb"))
    command = [sys.executable, "-m", "flare.collector", "--config", "embedded"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "0.0.0.0" in done.stderr and "--insecure-expose" in done.stderr
    assert not Path(tmp_path / "s.duckdb").exists()  # refused before anything was made
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no WAL
    proc = subprocess.Popen([*command, "--insecure-expose"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("ready:" in line for line in lines):
            lines.append(proc.stderr.readline())
        warnings = [line for line in lines if "WARNING" in line and "insecure_expose" in line]
        assert len(warnings) == 3, lines  # OTLP/gRPC, OTLP/HTTP, metrics: each listener once
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_secure_configuration_serves_off_loopback_with_tls_and_the_token(tmp_path, certs):
    """The documented `FLARE_HOST=0.0.0.0 … flare collector --config secure` starts (no
    --insecure-expose needed) and refuses a request without the token."""
    import subprocess
    import sys
    import urllib.request

    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    env = _env(FLARE_HOST="0.0.0.0", FLARE_OTLP_GRPC_PORT="0", FLARE_OTLP_HTTP_PORT="0", FLARE_METRICS_PORT="0",
               FLARE_STORE=str(tmp_path / "s.duckdb"), FLARE_TLS_CERT=certs["server"] + ".pem",
               FLARE_TLS_KEY=certs["server"] + ".key", FLARE_TOKEN_FILE=str(token))
    proc = subprocess.Popen([sys.executable, "-m", "flare.collector", "--config", "secure"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "ready:" not in line:
            line = proc.stderr.readline()
            assert "WARNING" not in line, line
        http = line.split("OTLP/HTTP ", 1)[1].split(",", 1)[0]
        port = http.rsplit(":", 1)[1]
        context = ssl.create_default_context(cafile=certs["ca"] + ".pem")
        request = urllib.request.Request(f"https://127.0.0.1:{port}/flare/v1/agents")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, context=context, timeout=10)
        assert err.value.code == 401
        request.add_header("Authorization", f"Bearer {TOKEN}")
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        proc.wait(30)
    # without its files it is an error naming them (after a warning per unset variable),
    # not a server without TLS
    bare = {k: v for k, v in env.items() if not k.startswith("FLARE_TLS")}
    done = subprocess.run([sys.executable, "-m", "flare.collector", "--config", "secure"], env=bare,
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 3, done.stderr  # FLARE_TLS_CERT, FLARE_TLS_KEY, the error
    assert lines[-1] == "flare collector: error: receivers.otlp.protocols.grpc.tls needs both cert_file and key_file"
