"""What the always-on OpAMP poll costs: a rank's CPU per poll and the collector's, side
by side for the agent's transport on Flare's HTTP client and the OpAMP client's own
(requests), and what that makes per rank-step.

A real `flare collector` process serves the endpoint; this process is the agent (the
contrib `OpAMPClient`, heartbeats as the rank's agent sends them between captures). The
rank's side is this thread's CPU per poll; the collector's is its process CPU per poll
(/proc), less its idle CPU over the same time.

    .venv/bin/python benchmarks/opamp_poll_cost.py [--polls 2000] [--interval 5] [--step-ms 38]
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _collector(workdir: str) -> tuple[subprocess.Popen, str]:
    config = {"receivers": {"otlp": {"protocols": {"http": {"endpoint": "127.0.0.1:0"}}}},
              "exporters": {"flare_store": {"path": f"{workdir}/store.duckdb"}},
              "service": {"pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["flare_store"]}}}}
    path = Path(workdir, "collector.yaml")
    path.write_text(yaml.safe_dump(config))
    log = Path(workdir, "collector.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "flare"), "collector", "--config", str(path)], stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"OTLP/HTTP ([\d.:]+)", log.read_text())
        if match:
            return proc, f"http://{match.group(1)}/v1/opamp"
        time.sleep(0.1)
    raise SystemExit(f"the collector did not start:\n{log.read_text()}")


def _measure(endpoint: str, pid: int, transport, polls: int) -> tuple[float, float]:
    from opentelemetry._opamp.client import OpAMPClient

    client = OpAMPClient(endpoint=endpoint, transport=transport,
                         headers={"X-Flare-Agent-Key": secrets.token_urlsafe(24)},
                         agent_identifying_attributes={"flare.job.id": "bench", "flare.rank": 0})
    client.send(client.build_full_state_message())
    for _ in range(50):  # warm
        client.send(client.build_heartbeat_message())
    server_before, thread_before = _process_cpu_s(pid), time.thread_time()
    started = time.monotonic()
    for _ in range(polls):
        client.send(client.build_heartbeat_message())
    thread_s, server_s = time.thread_time() - thread_before, _process_cpu_s(pid) - server_before
    wall = time.monotonic() - started
    client.send(client.build_agent_disconnect_message())  # (the next measure registers rank 0 anew)
    idle_before = _process_cpu_s(pid)
    time.sleep(min(wall, 5.0))
    idle_rate = (_process_cpu_s(pid) - idle_before) / min(wall, 5.0)
    return thread_s / polls * 1e6, max(server_s - idle_rate * wall, 0.0) / polls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--interval", type=float, default=5.0, help="the agent's poll interval (s)")
    parser.add_argument("--step-ms", type=float, default=38.0,
                        help="a rank-step's CPU, for the per-step share (the accounting job's)")
    args = parser.parse_args()
    from opentelemetry._opamp.transport.requests import RequestsTransport

    from flare.instrumentation.opamp_agent import _transport

    with tempfile.TemporaryDirectory() as workdir:
        proc, endpoint = _collector(workdir)
        try:
            rows = [("Flare's HTTP client (urllib3)", *_measure(endpoint, proc.pid, _transport(), args.polls)),
                    ("OpAMP client's own (requests)",
                     *_measure(endpoint, proc.pid, RequestsTransport(), args.polls))]
        finally:
            proc.terminate()
            proc.wait(30)
    steps_per_poll = args.interval * 1e3 / args.step_ms
    print(f"{args.polls} heartbeats per transport; per rank-step at one poll every {args.interval:g} s "
          f"and {args.step_ms:g} ms of CPU per step ({steps_per_poll:.0f} steps per poll)")
    print(f"{'transport':<32} {'rank µs/poll':>13} {'collector µs/poll':>18} {'rank µs/step':>13} {'share':>7}")
    for name, rank_us, server_us in rows:
        per_step = rank_us / steps_per_poll
        print(f"{name:<32} {rank_us:>13.0f} {server_us:>18.0f} {per_step:>13.2f} "
              f"{per_step / (args.step_ms * 1e3):>7.3%}")
    print(f"ratio (requests / Flare's): rank {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
