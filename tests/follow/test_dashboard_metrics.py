"""The per-rank gauges the Grafana dashboard reads, scraped from a real collector that
received a 4-rank job (rank 2 slow from step 10) over OTLP; the same samples from the
store and from the follow window for the same spans (`flare.collector.rank_gauges`);
and the dashboard's queries name only metrics that exist."""

from __future__ import annotations

import io
import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pyarrow.compute as pc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from flare.collector import rank_gauges
from flare.collector.config import embedded_config
from flare.collector.query_api import RankGauges
from flare.collector.service import Collector
from flare.diagnostics import writeback
from flare.diagnostics.follow import FollowService
from flare.diagnostics.model import Anomaly
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store

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


def _by_series(samples) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for name, labels, value in samples:
        key = (name, frozenset(labels.items()))
        assert key not in out, key  # one sample per series
        out[key] = value
    return out


def test_store_and_follow_window_give_the_same_samples(tmp_path, otlp_request):
    """The collector's store source (SQL, the correlator's culprits) and the follow
    service's window source (recomputed culprits) hand their rows to the one
    `rank_gauges.samples`: for the same spans, the same samples."""
    path = str(tmp_path / "store.duckdb")
    table = job_spans("jobS", world=4, steps=41, start_ns=time.time_ns() - 30 * 10**9,
                      faults=(Fault("compute", rank=2, from_step=10),))
    rows = table.to_pylist()
    collector = Collector(embedded_config(path))
    collector.start()
    try:
        with grpc.insecure_channel(collector.grpc_endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            for step in range(40):
                stub.Export(otlp_request([r for r in rows if r["step"] == step], job="jobS"),
                            timeout=10)
    finally:
        assert collector.stop(deadline_s=10)
    # The newest step straight into the store, past the correlator: the store's last
    # complete step (the one before its newest) and the window's (every rank reported a
    # later one) are then both 39, and the correlator named the culprits of the same
    # steps (0-39) the window recomputes them for.
    with store.writer(path) as con:
        store.insert_spans(con, table.filter(pc.equal(table["step"], 40)))
    follow = FollowService(f"store:{path}", "jobS", out=io.StringIO())
    written = follow.poll_once()  # the window's gauges, and its anomalies into the store
    assert follow.data.complete_step == 39
    assert [(a.kind, a.ranks) for a in written] == [("straggler", [2])]

    from_store = _by_series(RankGauges(path)())
    from_window = _by_series(follow.metrics.dashboard_samples())
    assert from_store.keys() == from_window.keys()
    for key, value in from_store.items():
        assert from_window[key] == pytest.approx(value, rel=1e-6), key  # (float32 waits)
    names = {name for name, _ in from_store}
    assert names == set(rank_gauges.NAMES)
    culprit = {dict(labels)["rank"]: v for (name, labels), v in from_store.items()
               if name == rank_gauges.CULPRIT_RATIO}
    # steps 0-9 have no straggler: the least wait falls on other ranks too; the ratios
    # are over the 40 steps 0-39 in both
    assert len(culprit) > 1 and max(culprit, key=culprit.get) == "2"
    assert all(round(v * 40, 9).is_integer() for v in culprit.values())
    assert sum(culprit.values()) == pytest.approx(1.0)


def test_samples_add_up_partial_rows():
    """A source may sum in SQL (one row per rank) or hand one row per step: the same
    gauges; steps without a culprit count in the ratio's denominator, an anomaly that
    names no rank is labelled rank="none"."""
    per_step = [rank_gauges.RankSteps("j", 1, 1, 100.0, 1, 10.0),
                rank_gauges.RankSteps("j", 1, 1, 300.0, 0, 0.0),
                rank_gauges.RankSteps("j", 0, 1, 200.0)]
    summed = [rank_gauges.RankSteps("j", 1, 2, 400.0, 1, 10.0),
              rank_gauges.RankSteps("j", 0, 1, 200.0)]
    culprits = [rank_gauges.StepCulprits("j", 1), rank_gauges.StepCulprits("j", 1),
                rank_gauges.StepCulprits("j", 0), rank_gauges.StepCulprits("j", None)]
    counted = [rank_gauges.StepCulprits("j", 1, 2), rank_gauges.StepCulprits("j", 0, 1),
               rank_gauges.StepCulprits("j", None, 1)]
    anomalies = [rank_gauges.AnomalyCount("j", "straggler", [1, 2]),
                 rank_gauges.AnomalyCount("j", "straggler", [2]),
                 rank_gauges.AnomalyCount("j", "hang", [])]
    expected = [
        ("flare_rank_step_seconds", {"flare_job": "j", "rank": "0"}, 0.2),
        ("flare_rank_step_seconds", {"flare_job": "j", "rank": "1"}, 0.2),
        ("flare_rank_wait_seconds", {"flare_job": "j", "rank": "1"}, 0.01),
        ("flare_rank_culprit_ratio", {"flare_job": "j", "rank": "0"}, 0.25),
        ("flare_rank_culprit_ratio", {"flare_job": "j", "rank": "1"}, 0.5),
        ("flare_anomalies", {"flare_job": "j", "kind": "hang", "rank": "none"}, 1.0),
        ("flare_anomalies", {"flare_job": "j", "kind": "straggler", "rank": "1"}, 1.0),
        ("flare_anomalies", {"flare_job": "j", "kind": "straggler", "rank": "2"}, 2.0),
    ]
    assert rank_gauges.samples(per_step, culprits, anomalies) == expected
    assert rank_gauges.samples(summed, counted, anomalies) == expected
    assert rank_gauges.samples() == []


def test_dashboard_queries_name_existing_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    known = {"flare_rank_step_seconds", "flare_rank_wait_seconds", "flare_rank_culprit_ratio",
             "flare_anomalies", "flare_collector_accepted_spans_total",
             "flare_collector_refused_spans_total", "flare_collector_queue_bytes",
             "flare_collector_unauthenticated_requests_total", "flare_follow_backend_up",
             "flare_follow_anomalies_total"}
    assert set(rank_gauges.NAMES) <= known
    for expr in exprs:
        names = set(re.findall(r"\b(flare_[a-z_]+)\b(?!=)", expr)) - {"flare_job"}
        assert names and names <= known, expr
    kinds = {p["type"] for p in dashboard["panels"]}
    assert {"heatmap", "table", "timeseries"} <= kinds
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "job"}
