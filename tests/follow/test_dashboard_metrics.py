"""The per-rank gauges the Grafana dashboard reads, scraped from a real collector that
received a 4-rank job (rank 2 slow from step 10) over OTLP; and the dashboard's
queries name only metrics that exist."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from flare.collector.config import embedded_config
from flare.collector.query_api import RankGauges
from flare.collector.service import Collector
from flare.diagnostics import writeback
from flare.diagnostics.model import Anomaly
from flare.diagnostics.synthetic import Fault, job_spans

DASHBOARD = Path(__file__).resolve().parents[2] / "otel-collector" / "src" / "flare" / "collector" / "configs" / "flare-dashboard.json"


def scrape(endpoint: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        match = re.match(r"^(flare_[a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            out[(match.group(1), labels)] = float(match.group(3))
    return out


def test_rank_gauges_from_a_live_collector(tmp_path, otlp_request):
    path = str(tmp_path / "store.duckdb")
    config = embedded_config(path, metrics_port=0)
    collector = Collector(config)
    collector.start()
    collector.register_gauge_source(RankGauges(path))
    try:
        table = job_spans("jobM", world=4, steps=40, start_ns=time.time_ns() - 30 * 10**9,
                          faults=(Fault("compute", rank=2, from_step=10),))
        with grpc.insecure_channel(collector.grpc_endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            rows = table.to_pylist()
            for step in range(40):
                stub.Export(otlp_request([r for r in rows if r["step"] == step], job="jobM"),
                            timeout=10)
        anomaly = Anomaly(kind="straggler", ranks=[2], cause="compute", first_step=10,
                          last_step=39, impact=0.3, confidence=0.9, summary="rank 2")
        writeback.send_otlp(collector.grpc_endpoint, writeback.anomaly_spans("jobM", [anomaly]))
        deadline = time.monotonic() + 30
        while True:
            collector.flush()
            metrics = scrape(collector.metrics_endpoint)
            culprit = {dict(k[1])["rank"]: v for k, v in metrics.items()
                       if k[0] == "flare_rank_culprit_ratio"}
            if culprit or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        collector.stop()
    step_s = {dict(k[1])["rank"]: v for k, v in metrics.items() if k[0] == "flare_rank_step_seconds"}
    wait_s = {dict(k[1])["rank"]: v for k, v in metrics.items() if k[0] == "flare_rank_wait_seconds"}
    assert set(step_s) == {"0", "1", "2", "3"}
    # Collectives equalise step times; the wait tells the culprit (least wait: rank 2).
    assert min(wait_s, key=wait_s.get) == "2"
    assert max(culprit, key=culprit.get) == "2" and culprit["2"] > 0.5
    assert metrics[("flare_anomalies", frozenset(
        {("flare_job", "jobM"), ("kind", "straggler"), ("rank", "2")}))] == 1


def test_dashboard_queries_name_existing_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    known = {"flare_rank_step_seconds", "flare_rank_wait_seconds", "flare_rank_culprit_ratio",
             "flare_anomalies", "flare_collector_accepted_spans_total",
             "flare_collector_refused_spans_total", "flare_collector_queue_bytes",
             "flare_collector_unauthenticated_requests_total", "flare_follow_backend_up",
             "flare_follow_anomalies_total"}
    for expr in exprs:
        names = set(re.findall(r"\b(flare_[a-z_]+)\b(?!=)", expr)) - {"flare_job"}
        assert names and names <= known, expr
    kinds = {p["type"] for p in dashboard["panels"]}
    assert {"heatmap", "table", "timeseries"} <= kinds
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "job"}
