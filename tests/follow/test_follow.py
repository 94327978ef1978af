"""`flare diagnose --follow`: incremental polling, labels written once, outages survived.

The end-to-end test runs a real collector with its read endpoint, a sender streaming a
4-rank job's steps over OTLP/gRPC in real time (one rank's compute slows down from a
known step), and the follow service reading the read endpoint as a Jaeger backend.
"""

from __future__ import annotations

import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pyarrow as pa
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from flare.diagnostics.follow import FollowService, main
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store
from flare.wire import semconv as sc

ONSET = 40


def write_steps(path, table: pa.Table, first: int, last: int) -> None:
    rows = table.filter(pa.compute.and_(
        pa.compute.greater_equal(table["step"], first), pa.compute.less_equal(table["step"], last)))
    with store.writer(path) as con:
        store.insert_spans(con, rows)


def anomaly_rows(path):
    con = store.open_reader(path)
    try:
        return con.execute(
            "SELECT span_id, attributes FROM spans WHERE name = ?", [sc.SPAN_ANOMALY]
        ).fetchall()
    finally:
        con.close()


def test_polls_are_incremental_and_labels_are_written_once(tmp_path):
    path = str(tmp_path / "store.duckdb")
    table = job_spans("jobF", world=4, steps=90, faults=(Fault("compute", rank=2, from_step=ONSET),))
    write_steps(path, table, 0, 29)
    out = io.StringIO()
    service = FollowService(f"store:{path}", "jobF", out=out)
    assert service.poll_once() == []
    first_fetch = service.data.fetched_rows
    assert first_fetch == 4 * 30
    write_steps(path, table, 30, 59)
    labels = service.poll_once()
    # Only the open step (29) and the new ones were fetched again, not the whole job.
    assert service.data.fetched_rows - first_fetch == 4 * 31
    assert {(a.kind, tuple(a.ranks), a.first_step) for a in labels} == {("straggler", (2,), ONSET)}
    # the job's slowdown is the straggler's doing: one label, the change point inside it
    slowdown = labels[0].evidence["job_slowdown"]
    assert slowdown["ranks"] == [2] and slowdown["first_step"] == ONSET and slowdown["shift"] > 0.1
    write_steps(path, table, 60, 89)
    assert service.poll_once() == []  # the same anomalies, grown longer: not new
    written = anomaly_rows(path)
    assert len(written) == len(labels)
    # The dashboard's per-rank gauges, from the window: rank 2 is the culprit.
    metrics = service.metrics.prometheus()
    culprit = dict(re.findall(r'flare_rank_culprit_ratio\{flare_job="jobF",rank="(\d)"\} (\S+)', metrics))
    assert max(culprit, key=lambda r: float(culprit[r])) == "2" and float(culprit["2"]) > 0.5
    assert len(re.findall(r"^flare_rank_step_seconds\{", metrics, re.M)) == 4
    assert 'flare_anomalies{flare_job="jobF",kind="straggler",rank="2"} 1' in metrics
    assert out.getvalue().count("flare: [straggler] ranks 2 cause compute from step 40") == 1
    assert "[fail_slow]" not in out.getvalue()
    # A restarted service reads the labels back and does not repeat them.
    again = FollowService(f"store:{path}", "jobF", out=io.StringIO())
    assert again.poll_once() == []
    assert len(anomaly_rows(path)) == len(labels)


def test_unknown_backend_is_one_line_and_exit_2(capsys):
    assert main("nope+ftp://x", "j", None, 1.0, None, io.StringIO(), health_endpoint=None) == 2
    err = capsys.readouterr().err
    assert err.startswith("flare: ") and err.count("\n") == 1


def test_several_jobs_and_no_job_is_a_usage_error_not_an_outage(tmp_path, capsys):
    # (it was reported as "backend unavailable ... retrying", every poll, for ever)
    path = tmp_path / "two.duckdb"
    for job in ("a", "b"):
        write_steps(path, job_spans(job, 2, 8), 0, 7)
    assert main(f"store:{path}", None, None, 0.05, None, io.StringIO(),
                health_endpoint=None) == 2
    err = capsys.readouterr().err
    assert err == (f"flare: error: store:{path} holds 2 jobs (a, b); choose one with --job\n")


# ---------------------------------------------------------------- end to end


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CollectorProcess:
    """A real `python -m flare.collector` process with the flare_query read endpoint."""

    def __init__(self, path: str, grpc_port: int, query_port: int) -> None:
        from flare.collector.config import embedded_config

        config = embedded_config(path, grpc_port=grpc_port, http_port=0)
        config["extensions"]["flare_query"] = {"endpoint": f"127.0.0.1:{query_port}"}
        config["service"]["extensions"].append("flare_query")
        self.config_path = f"{path}.collector.yaml"
        with open(self.config_path, "w") as fh:
            yaml.safe_dump(config, fh)
        self.ports = (grpc_port, query_port)
        self.proc: subprocess.Popen | None = None

    def start(self) -> CollectorProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flare.collector", "--config", self.config_path],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"collector exited: {self.proc.stderr.read().decode()}")
            try:
                for port in self.ports:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError("collector did not start listening within 60 s")

    def kill(self) -> None:
        """An outage: the process dies without draining (the WAL keeps what it took)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.e2e
def _slowdown_said(text: str) -> bool:
    """The job's slowdown from step 40 has been said live: as a fail-slow of rank 2, or
    as rank 2's straggler (one finding, one label) — with the job's slowdown inside it,
    or, from a pass that saw the straggler persist before the job's slower steps had
    lasted `min_persist_s` (steps 50-53 here, ~1.5 s between passes), without it."""
    return any("ranks 2 cause compute from step 40" in line
               and ("[fail_slow]" in line or "[straggler]" in line)
               for line in text.splitlines())


def test_fail_slow_labelled_within_30s_of_onset_through_the_read_endpoint(tmp_path, otlp_request):
    path = str(tmp_path / "store.duckdb")
    grpc_port, query_port, health_port = free_port(), free_port(), free_port()
    collector = CollectorProcess(path, grpc_port, query_port).start()
    table = job_spans("jobE", world=4, steps=160, start_ns=time.time_ns(),
                      faults=(Fault("compute", rank=2, from_step=ONSET),))
    rows = table.to_pylist()
    sent_at: dict[int, float] = {}
    stop_sending = threading.Event()
    paused = threading.Event()

    def send() -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        for step in range(160):
            if stop_sending.is_set():
                break
            while paused.is_set():
                time.sleep(0.05)
            request = otlp_request([r for r in rows if r["step"] == step])
            for _ in range(100):  # the collector may be restarting: retry like an SDK
                try:
                    stub.Export(request, timeout=5)
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
            sent_at[step] = time.monotonic()
            time.sleep(0.1)
        channel.close()

    out = io.StringIO()
    stop_following = threading.Event()
    follow_status: list[int] = []
    follow = threading.Thread(target=lambda: follow_status.append(main(
        f"jaeger+http://127.0.0.1:{query_port}", "jobE", None, 1.0, f"127.0.0.1:{grpc_port}",
        out, health_endpoint=f"127.0.0.1:{health_port}", stop=stop_following)))
    sender = threading.Thread(target=send)
    try:
        sender.start()
        follow.start()
        deadline = time.monotonic() + 90
        while not _slowdown_said(out.getvalue()) and time.monotonic() < deadline:
            time.sleep(0.1)
        labelled_at = time.monotonic()
        assert _slowdown_said(out.getvalue()), out.getvalue()
        assert labelled_at - sent_at[ONSET] <= 30.0
        print(f"the job's slowdown labelled {labelled_at - sent_at[ONSET]:.1f} s after onset")

        # Outage: the collector (and its read endpoint) goes away and comes back.
        paused.set()
        collector.kill()
        health_during_outage = []
        for _ in range(30):
            health_during_outage.append(health(health_port)[0])
            if health_during_outage[-1] == 503:
                break
            time.sleep(0.2)
        collector.start()
        paused.clear()
        sender.join(timeout=120)
        time.sleep(3)  # a few more polls after the catch-up
        assert 503 in health_during_outage
        status, doc = health(health_port)
        assert status == 200 and doc["status"] == "ok"
        metrics = metrics_text(health_port)
        assert re.search(r'flare_follow_anomalies_total\{kind="(fail_slow|straggler)"\} 1', metrics), metrics
        errors = next(line for line in metrics.splitlines()
                      if line.startswith("flare_follow_poll_errors_total"))
        assert int(errors.split()[1]) >= 1
        # A restarted service reads back the labels already written (on Jaeger they
        # are the diagnostics service's spans) and does not repeat them.
        stop_following.set()
        follow.join(timeout=30)
        again, stop_again = io.StringIO(), threading.Event()
        threading.Timer(4.0, stop_again.set).start()
        assert main(f"jaeger+http://127.0.0.1:{query_port}", "jobE", None, 1.0,
                    f"127.0.0.1:{grpc_port}", again, health_endpoint=None, stop=stop_again) == 0
        assert "following job jobE" in again.getvalue()
        assert "ranks 2 cause" not in again.getvalue(), again.getvalue()
    finally:
        stop_sending.set()
        paused.clear()
        stop_following.set()
        follow.join(timeout=30)
        sender.join(timeout=30)
        collector.stop()
    assert follow_status == [0]
    text = out.getvalue()
    # a pass that saw the change point before the straggler persisted says fail_slow
    # first; one that saw both says the straggler, the slowdown inside it: each once
    assert text.count("flare: [fail_slow] ranks 2 ") <= 1
    assert text.count("flare: [straggler] ranks 2 ") == 1
    written = [json.loads(a)[sc.ANOMALY_KIND] for _, a in anomaly_rows(path)]
    assert sorted(written) == sorted(set(written))  # each label stored exactly once
    assert "straggler" in written


def test_window_memory_is_bounded_by_rows(tmp_path):
    from flare.diagnostics.backends import open_backend
    from flare.diagnostics.follow import IncrementalJobData

    path = str(tmp_path / "store.duckdb")
    write_steps(path, job_spans("jobW", world=4, steps=300), 0, 299)
    data = IncrementalJobData(open_backend(f"store:{path}").job_data("jobW"), max_rows=400)
    data.refresh()
    assert data.window_rows <= 4 * 101  # 100 steps kept (the floor), not 300
    assert data.steps_range() == (199, 299)


def test_new_labels_have_their_ranks_and_a_peer_captured_through_the_collector(tmp_path):
    """--follow --collector URL: each new label asks a real collector's OpAMP server for a
    capture of its ranks and one healthy peer, whose agents the collector knows."""
    from opentelemetry._opamp.client import OpAMPClient

    from flare.collector.config import embedded_config
    from flare.collector.service import Collector
    from flare.diagnostics.follow import _collector_capture

    collector = Collector(embedded_config(tmp_path / "collector.duckdb"))
    collector.start()
    try:
        url = f"http://{collector.http_endpoint}"
        agents = {rank: OpAMPClient(endpoint=f"{url}/v1/opamp", agent_identifying_attributes={
            "flare.job.id": "jobC", "flare.rank": rank}, headers={"X-Flare-Agent-Key": f"agent-key-{rank:016d}"})
            for rank in range(4)}
        for agent in agents.values():
            agent.send(agent.build_full_state_message())
        path = str(tmp_path / "store.duckdb")
        write_steps(path, job_spans("jobC", world=4, steps=70,
                                    faults=(Fault("compute", rank=2, from_step=ONSET),)), 0, 69)
        service = FollowService(f"store:{path}", "jobC", out=io.StringIO(),
                                capture=_collector_capture(url, "jobC"))
        assert service.poll_once()
        pending = {a["rank"] for a in collector.opamp.agents("jobC") if a["pending"]}
        assert pending == {0, 2}  # the culprit and the lowest unlabelled rank
        reply = agents[2].send(agents[2].build_heartbeat_message())
        assert dict(agents[2].decode_remote_config(reply.remote_config))["flare"]["capture"]["steps"] == 20
    finally:
        collector.stop(10)
