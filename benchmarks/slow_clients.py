"""Valid exports while strangers and slow clients press on every listener.

A real `flare collector` process (TLS and a bearer token on OTLP/gRPC and OTLP/HTTP,
the default limits of `config.Limits`) is measured twice in one run: valid exports over
gRPC and HTTP on a quiet collector, then the same exports while, at once,

- `--half-open` gRPC calls (half without the token, half with it) send their headers
  and never their request,
- `--slow-http` HTTP connections (four in five never start TLS, the rest finish TLS and
  trickle their headers a byte a second), each reopened as soon as it is closed,
- `--agents` OpAMP agents register (distinct uids and keys, 4 senders; every field an
  agent may send at its cap: a 256-character host name, a 4 KiB reported config, a
  1 KiB status message, so that the RSS is the worst case),

and prints the exports' latencies side by side, the collector's threads and RSS (now
and peak), and what it counted as refused or timed out. The attack runs in this process
(threads), beside the collector, on the same cores.

    .venv/bin/python benchmarks/slow_clients.py [--half-open 100] [--slow-http 500] [--agents 10000]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import secrets
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import yaml
from opentelemetry._opamp.proto import opamp_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

TOKEN = "benchmark-token-0123456789"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _certs(d: Path) -> dict[str, str]:
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", "ca.key",
            "-out", "ca.pem", "-subj", "/CN=bench-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=server")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-out", "server.pem", "-extfile", "ext")
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}


def _collector(d: Path, certs: dict[str, str]) -> tuple[subprocess.Popen, dict[str, str]]:
    secure = {"tls": {"cert_file": certs["cert"], "key_file": certs["key"]}, "auth": {"bearer_token": TOKEN}}
    config = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0", **secure},
                                             "http": {"endpoint": "127.0.0.1:0", **secure}}}},
        "processors": {"memory_limiter": {}, "rank_correlation": {}},
        "exporters": {"flare_store": {"path": str(d / "store.duckdb")}},
        "extensions": {"flare_wal": {"directory": str(d / "wal")},
                       "flare_metrics": {"endpoint": "127.0.0.1:0"}},
        "service": {"extensions": ["flare_wal", "flare_metrics"], "pipelines": {"traces": {
            "receivers": ["otlp"], "processors": ["memory_limiter", "rank_correlation"],
            "exporters": ["flare_store"]}}},
    }
    (d / "c.yaml").write_text(yaml.safe_dump(config))
    with open(d / "c.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flare.collector", "--config", str(d / "c.yaml"),
                                 "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"ready: (.*)$", (d / "c.log").read_text(), re.MULTILINE)
        if match:
            return proc, dict(p.split(" ", 1) for p in match.group(1).split(", "))
        time.sleep(0.1)
    proc.kill()
    proc.wait(10)
    raise SystemExit(f"the collector did not start:\n{(d / 'c.log').read_text()}")


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _scrape(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("flare_collector_") and any(k in line for k in (
                "refused", "timed_out", "unauthenticated", "opamp_messages", "accepted_requests")):
            name, value = line.rsplit(" ", 1)
            if float(value):
                out[name.replace("flare_collector_", "")] = float(value)
    return out


class Probe:
    """Valid exports, one every `every_s` over each transport; their latencies."""

    def __init__(self, endpoints: dict[str, str], ca: str) -> None:
        creds = grpc.ssl_channel_credentials(Path(ca).read_bytes())
        self.channel = grpc.secure_channel(endpoints["OTLP/gRPC"], creds)
        self.grpc_call = self.channel.unary_unary(EXPORT)
        host, port = endpoints["OTLP/HTTP"].rsplit(":", 1)
        self.http = http.client.HTTPSConnection(host, int(port), context=ssl.create_default_context(cafile=ca),
                                                timeout=10)
        self.body = trace_service_pb2.ExportTraceServiceRequest().SerializeToString()

    def once(self) -> tuple[float, float]:
        started = time.perf_counter()
        self.grpc_call(self.body, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        grpc_s = time.perf_counter() - started
        started = time.perf_counter()
        self.http.request("POST", "/v1/traces", self.body, {"Authorization": f"Bearer {TOKEN}",
                                                           "Content-Type": "application/x-protobuf"})
        response = self.http.getresponse()
        response.read()
        assert response.status == 200, response.status
        return grpc_s, time.perf_counter() - started

    def series(self, n: int, every_s: float) -> tuple[list[float], list[float]]:
        grpc_s, http_s = [], []
        for _ in range(n):
            g, h = self.once()
            grpc_s.append(g)
            http_s.append(h)
            time.sleep(every_s)
        return grpc_s, http_s


def _summary(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {statistics.median(ms):6.1f}  p99 {p99:6.1f}  max {ms[-1]:6.1f} ms"


def _half_open(endpoint: str, ca: str, n: int, stop: threading.Event) -> list:
    channel = grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(Path(ca).read_bytes()))
    call = channel.stream_unary(EXPORT)

    def never():
        stop.wait()
        return
        yield

    futures = []
    for i in range(n):  # half strangers, half token holders
        metadata = (("authorization", f"Bearer {TOKEN}"),) if i % 2 else ()
        futures.append(call.future(never(), metadata=metadata))
    return [channel, futures]


def _slow_http(endpoint: str, ca: str, n: int, stop: threading.Event) -> threading.Thread:
    host, port = endpoint.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)

    def idle():
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port))) as s:
                    s.settimeout(1.0)
                    while not stop.is_set():
                        try:
                            if not s.recv(1):
                                break  # closed by the collector: open another
                        except TimeoutError:
                            continue
            except OSError:
                time.sleep(0.2)

    def slowloris():
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port))) as raw, \
                        context.wrap_socket(raw, server_hostname=host) as s:
                    s.sendall(b"POST /v1/traces HTTP/1.1\r\n")
                    while not stop.wait(1.0):
                        s.sendall(b"X")
            except OSError:
                time.sleep(0.2)

    threads = [threading.Thread(target=idle if i % 5 else slowloris, daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _register_agents(endpoint: str, ca: str, n: int, done: list[int]) -> list[threading.Thread]:
    host, port = endpoint.rsplit(":", 1)

    def sender(first: int, step: int):
        conn = http.client.HTTPSConnection(host, int(port), context=ssl.create_default_context(cafile=ca),
                                           timeout=10)
        for i in range(first, n, step):
            message = opamp_pb2.AgentToServer(instance_uid=secrets.token_bytes(16))
            attrs = message.agent_description.identifying_attributes
            attrs.add(key="flare.job.id").value.string_value = f"bench-job-{i // 1000}"
            attrs.add(key="flare.rank").value.int_value = i % 1000
            # every field at its cap (what a hostile agent can make the collector keep)
            message.agent_description.non_identifying_attributes.add(
                key="host.name").value.string_value = f"{i:08d}" + "h" * 248
            config = message.effective_config.config_map.config_map["flare"]
            config.body = b'{"pad": "' + secrets.token_hex(2040).encode() + b'"}'
            message.remote_config_status.error_message = "e" * 1024
            conn.request("POST", "/v1/opamp", message.SerializeToString(), {
                "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf",
                "X-Flare-Agent-Key": secrets.token_urlsafe(24)})
            response = conn.getresponse()
            response.read()
            done[0] += response.status == 200

    threads = [threading.Thread(target=sender, args=(k, 4), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half-open", type=int, default=100)
    parser.add_argument("--slow-http", type=int, default=500)
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--probes", type=int, default=100, help="valid exports on the quiet collector")
    parser.add_argument("--seconds", type=float, default=25.0, help="how long the attack is probed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        certs = _certs(d)
        proc, endpoints = _collector(d, certs)
        try:
            probe = Probe(endpoints, certs["ca"])
            probe.series(5, 0.0)  # warm
            quiet = probe.series(args.probes, 0.05)
            idle_status = _status(proc.pid)
            stop = threading.Event()
            held = _half_open(endpoints["OTLP/gRPC"], certs["ca"], args.half_open, stop)
            _slow_http(endpoints["OTLP/HTTP"], certs["ca"], args.slow_http, stop)
            registered = [0]
            agents_s, attack_started = 0.0, time.monotonic()
            senders = _register_agents(endpoints["OTLP/HTTP"], certs["ca"], args.agents, registered)
            time.sleep(2.0)  # the attack established
            started = time.monotonic()
            loaded: tuple[list[float], list[float]] = ([], [])
            # past the handshake and header deadlines (10 s), so slow clients are cut and return
            while time.monotonic() - started < args.seconds or any(t.is_alive() for t in senders):
                g, h = probe.once()
                loaded[0].append(g)
                loaded[1].append(h)
                time.sleep(0.05)
                if not any(t.is_alive() for t in senders) and not agents_s:
                    agents_s = time.monotonic() - attack_started
            attack_status = _status(proc.pid)
            after_status = _status(proc.pid)
            counters = _scrape(f"{endpoints['metrics']}")
            stop.set()
            held[0].close()
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"valid exports, one per transport every 50 ms: {args.probes} quiet, {len(loaded[0])} over "
          f"{args.seconds:g} s of attack (TLS and a token on both; default limits)")
    print(f"  quiet        gRPC {_summary(quiet[0])}   HTTP {_summary(quiet[1])}")
    print(f"  under attack gRPC {_summary(loaded[0])}   HTTP {_summary(loaded[1])}")
    print(f"attack: {args.half_open} half-open gRPC calls (half without the token), {args.slow_http} slow "
          f"HTTP connections (4/5 never start TLS, 1/5 trickle headers), {args.agents} agent "
          f"registrations ({registered[0]} accepted, all in {agents_s:.1f} s)")
    print(f"collector threads: {idle_status['Threads']} quiet, {attack_status['Threads']} under attack; "
          f"RSS {idle_status['VmRSS'] / 1024:.0f} MiB quiet, {after_status['VmRSS'] / 1024:.0f} MiB after "
          f"{registered[0]} agents, peak {after_status['VmHWM'] / 1024:.0f} MiB")
    print("counted: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counters.items())))
    ratio = statistics.median(loaded[0]) / statistics.median(quiet[0])
    print(f"median export latency under attack / quiet: gRPC {ratio:.2f}, "
          f"HTTP {statistics.median(loaded[1]) / statistics.median(quiet[1]):.2f}")


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    main()
