"""The shipped Grafana dashboard against a real Prometheus (Debian's `prometheus`) with
its default scrape settings (`honor_labels: false`), scraping a real collector and the
follow service while a job's spans arrive: every query of the dashboard, and its job
variable, must return the job's series. Labels named `job` came back as `exported_job`
there, so the dashboard's `{job="$job"}` matched nothing; the gauges say `flare_job`.

The scrape configuration written here is the one docs/deployment.md gives.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from flare.collector import shipped
from flare.collector.config import embedded_config
from flare.collector.query_api import RankGauges
from flare.collector.service import Collector
from flare.diagnostics import writeback
from flare.diagnostics.follow import FollowService, HealthServer
from flare.diagnostics.model import Anomaly
from flare.diagnostics.synthetic import Fault, job_spans

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus is not installed (apt-get install prometheus)")

JOB = "jobP"
SCRAPE_CONFIG = """\
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: flare-collector
    static_configs: [{{targets: ["{collector}"]}}]
  - job_name: flare-follow
    static_configs: [{{targets: ["{follow}"]}}]
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        doc = json.loads(response.read())
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@needs_prometheus
def test_every_dashboard_query_returns_the_jobs_series_from_a_real_prometheus(tmp_path, otlp_request):
    path = str(tmp_path / "store.duckdb")
    collector = Collector(embedded_config(path, metrics_port=0))
    collector.start()
    collector.register_gauge_source(RankGauges(path))
    prometheus = health = None
    try:
        table = job_spans(JOB, world=4, steps=40, start_ns=time.time_ns() - 30 * 10**9,
                          faults=(Fault("compute", rank=2, from_step=10),))
        rows = table.to_pylist()
        with grpc.insecure_channel(collector.grpc_endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            for step in range(40):
                stub.Export(otlp_request([r for r in rows if r["step"] == step], job=JOB), timeout=10)
        anomaly = Anomaly(kind="straggler", ranks=[2], cause="compute", first_step=10,
                          last_step=39, impact=0.3, confidence=0.9, summary="rank 2")
        writeback.send_otlp(collector.grpc_endpoint, writeback.anomaly_spans(JOB, [anomaly]))
        collector.flush()
        follow = FollowService(f"store:{path}", JOB, out=io.StringIO())
        follow.poll_once()
        health = HealthServer("127.0.0.1:0", follow.metrics)
        port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(SCRAPE_CONFIG.format(collector=collector.metrics_endpoint,
                                               follow=health.url.removeprefix("http://")))
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        dashboard = json.loads(shipped.dashboard().read_text())
        exprs = [t["expr"].replace("$job", JOB) for p in dashboard["panels"] for t in p.get("targets", [])]
        empty = exprs
        deadline = time.monotonic() + 60
        while empty and time.monotonic() < deadline:
            time.sleep(1)
            try:
                empty = [e for e in exprs if not _query(base, e)]
            except OSError:  # not listening yet
                continue
        assert not empty, f"queries with no series after 60 s: {empty}"
        with urllib.request.urlopen(f"{base}/api/v1/label/flare_job/values", timeout=5) as response:
            assert JOB in json.loads(response.read())["data"]  # the dashboard's job variable
        # both targets were scraped, under Prometheus's own job label
        scraped = {r["metric"]["job"] for r in _query(base, f'flare_rank_step_seconds{{flare_job="{JOB}"}}')}
        assert scraped == {"flare-collector", "flare-follow"}, scraped
        # one culprit gauge: the collector (from the correlator) and the follow service
        # (from its window) name the culprit by the same rule
        top = {}
        for series in _query(base, f'flare_rank_culprit_ratio{{flare_job="{JOB}"}}'):
            target, rank = series["metric"]["job"], series["metric"]["rank"]
            if float(series["value"][1]) > top.get(target, ("", -1.0))[1]:
                top[target] = (rank, float(series["value"][1]))
        assert {t: r for t, (r, _) in top.items()} == {"flare-collector": "2", "flare-follow": "2"}, top
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=10)
        if health is not None:
            health.stop()
        collector.stop()


def test_the_follow_service_listens_where_the_host_setting_says():
    from flare.diagnostics.follow import health_endpoint_from_env

    assert health_endpoint_from_env({}) == "127.0.0.1:0"
    assert health_endpoint_from_env({"FLARE_HOST": "0.0.0.0", "FLARE_FOLLOW_PORT": "9464"}) == "0.0.0.0:9464"
    assert health_endpoint_from_env({"FLARE_HOST": "0.0.0.0", "FLARE_FOLLOW_HOST": "10.0.0.5"}) == "10.0.0.5:0"
