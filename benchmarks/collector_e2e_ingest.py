"""End-to-end ingest through the real collector: OTLP over the wire → WAL → store.

A real collector process (`python -m flare.collector`, the embedded pipeline:
memory_limiter → rank_correlation → flare_store, write-ahead log on) receives the
same requests `benchmarks/ingest.py` builds (Flare's span mix, ~512 spans per
request, one rank per request) over OTLP/HTTP and OTLP/gRPC from client threads in
this process. The clock stops when the store has committed the last request (the
collector's committed WAL position reaches its last one), so every span counted is
in the DuckDB file.

Printed side by side, in one run:
  parse ceiling     ExportTraceServiceRequest.FromString alone, this process, 1 thread
  front door        the receivers' own share, in this process, 1 thread: check the
                    request (in C; parsed with protobuf only when the check is not sure),
                    append to a write-ahead log, enqueue (no network, no pipeline)
  no transport      the same pipeline in this process, requests handed straight to
                    the receivers' accept(): spans per CPU-second of this process, so
                    the difference to the lines below is what the transports cost
  request rate      1-span requests/s on one connection per transport (the HTTP
                    server's and gRPC's per-request overhead, not the pipeline's)
  <pipeline> <transport>
                    spans/s of wall time, and spans per CPU-second of the collector
                    process (utime + stime from /proc: "per core", independent of how
                    many cores the client and other tenants take)

    .venv/bin/python benchmarks/collector_e2e_ingest.py [--spans 200000] [--clients 2]
        [--pipeline embedded|no-correlation] [--fsync] [--collectives 0]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import build_payloads  # the workload benchmarks/ingest.py defines

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_TICKS = os.sysconf("SC_CLK_TCK")


PIPELINES = {
    "embedded": ["memory_limiter", "rank_correlation"],  # what `flare run` uses
    "no-correlation": ["memory_limiter"],  # shows the correlator's share
}


def collector_config(store_path: Path, fsync: bool, processors: list[str]) -> dict:
    return {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"},
                                             "http": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {"memory_limiter": {"limit_mib": 512}, "rank_correlation": {}},
        "exporters": {"flare_store": {"path": str(store_path)}},
        "extensions": {"flare_wal": {"directory": f"{store_path}.ingest-wal", "fsync": fsync},
                       "flare_metrics": {"endpoint": "127.0.0.1:0"}},
        "service": {
            "extensions": ["flare_wal", "flare_metrics"],
            "flush_interval": "500ms",
            "pipelines": {"traces": {"receivers": ["otlp"],
                                     "processors": processors,
                                     "exporters": ["flare_store"]}},
        },
    }


class Collector:
    def __init__(self, workdir: Path, fsync: bool, processors: list[str]) -> None:
        config_path = workdir / "collector.yaml"
        config_path.write_text(yaml.safe_dump(collector_config(workdir / "bench.duckdb", fsync, processors)))
        self.log_path = workdir / "collector.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flare.collector", "--config", str(config_path)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            match = re.search(r"ready: (.*)$", self.log_path.read_text(), re.MULTILINE)
            if match:
                parts = dict(p.split(" ", 1) for p in match.group(1).split(", "))
                self.grpc, self.http, self.metrics = parts["OTLP/gRPC"], parts["OTLP/HTTP"], parts["metrics"]
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"collector did not start:\n{self.log_path.read_text()}")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime

    def gauges(self, *names: str) -> list[float]:
        """Values of `names` from one scrape (each scrape costs the collector ~0.5 ms of
        CPU, which the figures below count)."""
        values = dict.fromkeys(names, 0.0)
        with urllib.request.urlopen(self.metrics, timeout=30) as reply:
            for line in reply.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in values:
                    values[name] = float(value.split()[0])
        return [values[name] for name in names]

    def wait_committed(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            committed, last = self.gauges("flare_collector_wal_committed_lsn", "flare_collector_wal_last_lsn")
            if committed >= last:
                return
            time.sleep(0.02)
        raise SystemExit("store did not catch up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def send_http(endpoint: str, payloads: list[bytes]) -> None:
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    for body in payloads:
        while True:
            conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
            reply = conn.getresponse()
            reply.read()
            if reply.status == 200:
                break
            if reply.status not in (429, 503):
                raise SystemExit(f"HTTP {reply.status}")
            time.sleep(float(reply.getheader("Retry-After") or 1))
    conn.close()


def send_grpc(endpoint: str, payloads: list[bytes]) -> None:
    with grpc.insecure_channel(endpoint) as channel:
        export = channel.unary_unary(TRACE_METHOD)
        for body in payloads:
            while True:
                try:
                    export(body, timeout=60)
                    break
                except grpc.RpcError as err:
                    if err.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                        raise
                    time.sleep(1)


def run_transport(name: str, payloads: list[bytes], n_spans: int, clients: int, fsync: bool,
                  processors: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(Path(tmp), fsync, processors)
        try:
            endpoint = collector.http if name == "http" else collector.grpc
            sender = send_http if name == "http" else send_grpc
            shares = [payloads[i::clients] for i in range(clients)]
            cpu0 = collector.cpu_s()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=sender, args=(endpoint, share)) for share in shares]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            acked = time.perf_counter() - t0
            collector.wait_committed()
            wall = time.perf_counter() - t0
            cpu = collector.cpu_s() - cpu0
        finally:
            collector.stop()
    return {"wall": n_spans / wall, "acked": n_spans / acked, "per_cpu_s": n_spans / cpu, "cpu_s": cpu}


def request_rate(n_requests: int = 2000) -> dict[str, float]:
    """Requests/s of tiny (1-span) requests, one connection, against the embedded pipeline."""
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans()])
    span = request.resource_spans[0].scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"\x01" * 16, b"\x02" * 8, "tiny"
    payloads = [request.SerializeToString()] * n_requests
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(Path(tmp), False, PIPELINES["no-correlation"])
        try:
            for name, sender, endpoint in (("http", send_http, collector.http),
                                           ("grpc", send_grpc, collector.grpc)):
                t0 = time.perf_counter()
                sender(endpoint, payloads)
                rates[name] = n_requests / (time.perf_counter() - t0)
        finally:
            collector.stop()
    return rates


def in_process(payloads: list[bytes], n_spans: int, processors: list[str]) -> float:
    """Spans per CPU-second through a Collector in this process, without a transport."""
    from flare.collector.receiver import TRACES
    from flare.collector.service import Collector as InProcessCollector

    with tempfile.TemporaryDirectory() as tmp:
        config = collector_config(Path(tmp) / "bench.duckdb", False, processors)
        config["extensions"].pop("flare_metrics")
        config["service"]["extensions"].remove("flare_metrics")
        collector = InProcessCollector(config)
        collector.start()
        try:
            cpu0 = time.process_time()
            for payload in payloads:
                collector.acceptor.accept(TRACES, payload, "bench")
            collector.flush(timeout_s=600)
            return n_spans / (time.process_time() - cpu0)
        finally:
            collector.stop()


def front_door(payloads: list[bytes], n_spans: int) -> float:
    """Spans/s through Acceptor.accept with a real WAL; the queue is drained inline."""
    from flare.collector.ingest import Ingest, ItemQueue
    from flare.collector.receiver import TRACES, Acceptor
    from flare.collector.telemetry import Counters
    from flare.collector.wal import WriteAheadLog

    with tempfile.TemporaryDirectory() as tmp:
        wal = WriteAheadLog(tmp)
        wal.open(0)
        queue = ItemQueue(1 << 40)
        counters = Counters()
        acceptor = Acceptor(Ingest(queue, wal, {}, counters), counters)
        t0 = time.perf_counter()
        for payload in payloads:
            acceptor.accept(TRACES, payload, "bench")
            queue.get(0)
        elapsed = time.perf_counter() - t0
        wal.close()
    return n_spans / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--clients", type=int, default=2, help="concurrent client connections")
    parser.add_argument("--fsync", action="store_true", help="fdatasync the WAL on every request")
    parser.add_argument("--collectives", type=int, default=4,
                        help="collective spans per rank-step (0: the always-on mix)")
    parser.add_argument("--pipeline", action="append", choices=sorted(PIPELINES),
                        help="processor chain(s) to measure (default: embedded and no-correlation)")
    args = parser.parse_args()
    payloads = build_payloads(args.spans, collectives=args.collectives)
    n_spans = sum(len(ss.spans) for p in payloads
                  for rs in ExportTraceServiceRequest.FromString(p).resource_spans for ss in rs.scope_spans)
    size = sum(map(len, payloads))
    print(f"{n_spans} spans in {len(payloads)} requests ({size / n_spans:.0f} B/span), "
          f"{args.clients} client connection(s), WAL fsync {'on' if args.fsync else 'off'}, "
          f"{os.cpu_count()} CPUs")
    t0 = time.perf_counter()
    for payload in payloads:
        ExportTraceServiceRequest.FromString(payload)
    parse = n_spans / (time.perf_counter() - t0)
    print(f"{'parse ceiling (1 thread)':<28}{parse:>12,.0f} spans/s")
    door = front_door(payloads, n_spans)
    print(f"{'front door (1 thread)':<28}{door:>12,.0f} spans/s ({door / parse:.2f}x of parse ceiling)")
    rates = request_rate()
    print(f"{'request rate, 1-span':<28}{rates['http']:>12,.0f} req/s OTLP/HTTP, "
          f"{rates['grpc']:,.0f} req/s OTLP/gRPC (one connection)")
    pipelines = args.pipeline or ["embedded", "no-correlation"]
    for pipeline in pipelines:
        rate = in_process(payloads, n_spans, PIPELINES[pipeline])
        print(f"{pipeline + ' no transport':<28}{'':>12} {rate:,.0f} spans per CPU-second (in process)")
    runs = [(pipeline, name) for pipeline in pipelines
            for name in ("http", "grpc")]
    for pipeline, name in runs:
        result = run_transport(name, payloads, n_spans, args.clients, args.fsync, PIPELINES[pipeline])
        label = f"{pipeline} OTLP/{name}"
        print(f"{label:<28}{result['wall']:>12,.0f} spans/s wall "
              f"({result['acked']:,.0f} acknowledged/s); "
              f"{result['per_cpu_s']:,.0f} spans per collector CPU-second "
              f"({result['cpu_s']:.2f} CPU-s, {result['per_cpu_s'] / parse:.2f}x of parse ceiling)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
