"""The shipped collector configurations: Flare's load and run; the otelcol-contrib
front is checked for the structure the upstream loadbalancing exporter documents."""

from __future__ import annotations

import pytest
import yaml

from flare.collector import config as config_mod
from flare.collector import shipped
from flare.collector.errors import ConfigError
from flare.collector.service import Collector

CONFIG_DIR = shipped.folder()


@pytest.mark.parametrize(("name", "forward"), [("jaeger.yaml", "otlp/jaeger"), ("tempo.yaml", "otlp/tempo")])
def test_flare_configs_load_and_run(name, forward, tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_STORE", str(tmp_path / "store.duckdb"))
    for var in ("FLARE_OTLP_GRPC_PORT", "FLARE_OTLP_HTTP_PORT", "FLARE_METRICS_PORT",
                "FLARE_QUERY_PORT"):
        monkeypatch.setenv(var, "0")
    # Nothing listens here: forwarding must not keep the collector from running.
    monkeypatch.setenv("FLARE_JAEGER_OTLP", "127.0.0.1:9")
    monkeypatch.setenv("FLARE_TEMPO_OTLP", "127.0.0.1:9")
    doc = config_mod.load_file(CONFIG_DIR / name)
    parsed = config_mod.parse(doc)
    traces = next(p for p in parsed.pipelines if p.signal == "traces")
    assert traces.exporters == ["flare_store", forward]
    assert "rank_correlation" in traces.processors
    collector = Collector(doc)
    collector.start()
    try:
        assert collector.grpc_endpoint.startswith("127.0.0.1:")  # loopback by default
        assert collector.metrics_endpoint is not None
    finally:
        assert collector.stop()


def test_loadbalancing_front_has_the_upstream_shape():
    """otelcol-contrib cannot run here; check what its loadbalancing exporter's README
    (opentelemetry-collector-contrib exporter/loadbalancingexporter) requires."""
    doc = yaml.safe_load((CONFIG_DIR / "loadbalancing.yaml").read_text())
    lb = doc["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID"  # all ranks of a step meet in one collector
    assert set(lb["protocol"]) == {"otlp"}
    hostnames = lb["resolver"]["static"]["hostnames"]
    assert len(hostnames) >= 2
    assert all(h.rsplit(":", 1)[1].isdigit() for h in hostnames)
    for kind in ("receivers", "processors", "exporters"):
        for pipeline in doc["service"]["pipelines"].values():
            for component in pipeline.get(kind, []):
                assert component in doc[kind], f"{component} used but not defined"
    assert doc["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]
    # It is not a Flare configuration: the Flare loader says so in one line.
    with pytest.raises(ConfigError):
        config_mod.parse(doc)


def test_clickhouse_front_has_the_upstream_shape():
    """The otelcol-contrib front that writes ClickHouse's otel_traces and feeds the Flare
    collectors: the settings the clickhouse exporter's README requires, the Map layout
    Flare reads (no `json: true`), and the same loadbalancing routing as the plain front."""
    doc = yaml.safe_load((CONFIG_DIR / "clickhouse.yaml").read_text())
    ch = doc["exporters"]["clickhouse"]
    assert ch["endpoint"].startswith(("tcp://", "clickhouse://", "http://", "https://"))
    assert ch["traces_table_name"] == "otel_traces" and ch["database"]
    assert not ch.get("json", False)
    assert doc["exporters"]["loadbalancing"]["routing_key"] == "traceID"
    for kind in ("receivers", "processors", "exporters"):
        for pipeline in doc["service"]["pipelines"].values():
            for component in pipeline.get(kind, []):
                assert component in doc[kind], f"{component} used but not defined"
    assert doc["service"]["pipelines"]["traces"]["exporters"] == ["clickhouse", "loadbalancing"]
    with pytest.raises(ConfigError):
        config_mod.parse(doc)
    with pytest.raises(ConfigError, match="upstream otelcol-contrib"):
        shipped.resolve("clickhouse")
    assert shipped.resolve("clickhouse", printing=True).name == "clickhouse.yaml"
