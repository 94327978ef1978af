"""The programmatic API `flare run` uses: Collector(embedded_config(...))."""

from __future__ import annotations

import urllib.request

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from flare.collector.config import embedded_config
from flare.collector.service import Collector
from flare.exporters import store


def _emit(endpoint: str, job: str, steps: range) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "api", "flare.job.id": job, "flare.rank": 0}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    tracer = provider.get_tracer("api-test")
    for step in steps:
        with tracer.start_as_current_span("train.step", attributes={"flare.step": step}):
            pass
    provider.shutdown()


def _steps(store_path, job):
    con = store.open_reader(store_path)
    try:
        rows = con.execute("SELECT step FROM spans WHERE job = ? AND name = 'train.step' ORDER BY step", [job])
        return [r[0] for r in rows.fetchall()]
    finally:
        con.close()


def test_embedded_collector_lifecycle_restart_and_gauges(tmp_path):
    store_path = tmp_path / ".flare" / "store.duckdb"
    collector = Collector(embedded_config(store_path, metrics_port=0))
    collector.start()
    try:
        host, port = collector.grpc_endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert int(collector.http_endpoint.rsplit(":", 1)[1]) > 0
        assert collector.store_path == str(store_path)
        collector.register_gauge_source(lambda: [("rank_step_seconds", {"rank": "2"}, 0.25)])
        collector.register_gauge_source(lambda: {"anomalies_open": 3})

        _emit(collector.grpc_endpoint, "api-job", range(0, 10))
        assert collector.flush()
        assert _steps(store_path, "api-job") == list(range(10))  # readable while running

        with urllib.request.urlopen(f"http://{collector.metrics_endpoint}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'flare_collector_rank_step_seconds{rank="2"} 0.25' in text
        assert "flare_collector_anomalies_open 3" in text
        assert 'flare_collector_accepted_spans_total{transport="grpc"} 10' in text
        with urllib.request.urlopen(f"http://{collector.metrics_endpoint}/health", timeout=10) as reply:
            assert reply.status == 200 and reply.read() == b"ok\n"
    finally:
        assert collector.stop(deadline_s=10)

    again = Collector(embedded_config(store_path))
    again.start()
    try:
        _emit(again.grpc_endpoint, "api-job", range(10, 15))
    finally:
        assert again.stop(deadline_s=10)
    assert _steps(store_path, "api-job") == list(range(15))  # appended to the same store


def test_metrics_endpoint_serves_the_stores_rank_gauges(tmp_path):
    """With a store and flare_metrics, the dashboard's per-rank gauges are served
    without the caller registering anything."""
    collector = Collector(embedded_config(str(tmp_path / "s.duckdb"), metrics_port=0))
    collector.start()
    try:
        _emit(collector.grpc_endpoint, "gauged", range(5))
        assert collector.flush()
        with urllib.request.urlopen(f"http://{collector.metrics_endpoint}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        collector.stop()
    lines = [line for line in text.splitlines() if line.startswith("flare_rank_step_seconds{")]
    assert len(lines) == 1 and 'job="gauged"' in lines[0] and 'rank="0"' in lines[0]
