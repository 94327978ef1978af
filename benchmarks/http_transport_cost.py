"""CPU per OTLP/HTTP export request of each transport a rank could send with, side by side.

A rank's span exporter (`flare_otlp` over `http/protobuf`) sends one POST per export
from the finisher's thread. Timed here through the SDK's transport interface
(`request("POST", url, headers=..., timeout=..., data=...)`, what its exporter calls),
the calling thread's CPU clock, against a keep-alive HTTP/1.1 server in another process
on loopback that answers 200 with an empty body, as the collector does:

- `raw socket`: the hand-written HTTP/1.1 transport Flare had until it moved to one
  client (`otlp_http.py` at commit 78b4731, loaded from git history);
- `http_client`: Flare's one HTTP client on urllib3 (`otlp_http.HttpClientTransport`);
- `SDK urllib3`: the SDK's own urllib3 transport;
- `SDK requests`: the SDK's default transport (requests).

Warm: blocks of `--requests` back to back per path and body size, the paths alternated
block by block; the median over `--blocks` blocks. Cold: one 64 kB request after the
thread has copied `--evict-mb` of memory (a rank exports once per 5 s, and its training
has pushed the transport's code and data out of the caches by then; an idle sleep
instead would also measure this VM reclaiming the idle process's pages, which swung the
figure tenfold from run to run). Then the cold figure per rank-step: a rank exports every `--period-s` (the
finisher's period, `flare run`'s 5 s batch delay), so a step of `--step-ms` of wall time
carries step/period of one request (the accounting's job, `--hidden 1024 --batch-size
128`, 4 ranks on 2 cores: ~90 ms; ~3 spans of ~350 B per step, so ~55 kB per request).

    .venv/bin/python benchmarks/http_transport_cost.py
"""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW_SOCKET_COMMIT = "78b4731"  # the last otlp_http.py with the raw-socket transport
HEADERS = {"Content-Type": "application/x-protobuf",
           "User-Agent": "OTel-OTLP-Exporter-Python/1.45.2"}
SIZES = (16 * 1024, 64 * 1024, 256 * 1024)
COLD_SIZE = 64 * 1024


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def _raw_socket_transport():
    source = subprocess.run(
        ["git", "show", f"{RAW_SOCKET_COMMIT}:instrumentation/src/flare/instrumentation/otlp_http.py"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folder = tempfile.mkdtemp(prefix="flare-raw-socket-")
    path = Path(folder) / "raw_socket_otlp_http.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("raw_socket_otlp_http", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.HttpClientTransport()


def _transports() -> dict:
    from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
    from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport

    from flare.instrumentation import otlp_http

    return {"raw socket": _raw_socket_transport(),
            "http_client": otlp_http.HttpClientTransport(),
            "SDK urllib3": Urllib3HTTPTransport(),
            "SDK requests": RequestsHTTPTransport()}


def _cpu_per_request_us(transport, url: str, body: bytes, count: int) -> float:
    started = time.thread_time()
    for _ in range(count):
        result = transport.request("POST", url, headers=HEADERS, timeout=10, data=body)
        if result.status_code != 200:
            raise SystemExit(f"request failed: {result.error or result.status_code}")
    return (time.thread_time() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--requests", type=int, default=100, help="per block")
    parser.add_argument("--cold", type=int, default=200, help="requests after a pause, per path")
    parser.add_argument("--evict-mb", type=int, default=64, help="copied before a cold request")
    parser.add_argument("--step-ms", type=float, default=90.0)
    parser.add_argument("--period-s", type=float, default=5.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve()

    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE,
                              text=True)
    try:
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}/v1/traces"
        transports = _transports()
        bodies = {size: os.urandom(size) for size in SIZES}
        for transport in transports.values():  # connect, import lazily, warm up
            _cpu_per_request_us(transport, url, bodies[SIZES[0]], 20)
        warm = {(name, size): [] for name in transports for size in SIZES}
        for _ in range(args.blocks):
            for size, body in bodies.items():
                for name, transport in transports.items():
                    warm[name, size].append(
                        _cpu_per_request_us(transport, url, body, args.requests))
        cold = {name: [] for name in transports}
        source = bytearray(os.urandom(1024)) * (args.evict_mb * 1024)
        target = bytearray(len(source))
        for _ in range(args.cold):
            for name, transport in transports.items():
                target[:] = source  # the caches now hold this, not the transport
                cold[name].append(_cpu_per_request_us(transport, url, bodies[COLD_SIZE], 1))
        for transport in transports.values():
            transport.close()
    finally:
        server.kill()
        server.wait()

    names = list(transports)
    base = names[0]
    print(f"µs of CPU per request (calling thread), median; ratio to {base}")
    header = "".join(f"{name:>22s}" for name in names)
    print(f"{'':24s}{header}")
    rows = [(f"warm {size // 1024} kB", {name: statistics.median(warm[name, size])
                                        for name in names}) for size in SIZES]
    rows.append((f"cold {COLD_SIZE // 1024} kB",
                 {name: statistics.median(cold[name]) for name in names}))
    for label, figures in rows:
        cells = "".join(f"{figures[name]:>12.1f} ({figures[name] / figures[base]:4.2f}x)"
                        for name in names)
        print(f"{label:24s}{cells}")
    share = args.step_ms / 1e3 / args.period_s
    cold_figures = rows[-1][1]
    print(f"per rank-step at one request per {args.period_s:g} s and {args.step_ms:g} ms "
          f"steps (cold): " + ", ".join(f"{name} {cold_figures[name] * share:.1f} µs"
                                         for name in names))


if __name__ == "__main__":
    main()
