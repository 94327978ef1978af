"""Configuration: the otelcol shape, ${env:…} substitution, one clear error at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flare.collector import config, shipped
from flare.collector.__main__ import main
from flare.collector.errors import ConfigError
from flare.collector.service import Collector

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = shipped.resolve("embedded")


def test_env_substitution_types_whole_values_and_keeps_text():
    env = {"PORT": "4999", "HOST": "10.0.0.1", "EMPTY": ""}
    doc = {
        "port": "${env:PORT}",
        "endpoint": "${env:HOST}:${env:PORT}",
        "fallback": "${env:MISSING:-7}",
        "empty_default": "${env:EMPTY:-x}",
        "dollar": "$$HOME",
        "nested": [{"v": "${env:PORT:-1}"}],
    }
    out = config.substitute_env(doc, env)
    assert out == {"port": 4999, "endpoint": "10.0.0.1:4999", "fallback": 7, "empty_default": "x",
                   "dollar": "$HOME", "nested": [{"v": 4999}]}


def test_embedded_yaml_takes_ports_and_store_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLARE_OTLP_GRPC_PORT", "14317")
    monkeypatch.setenv("FLARE_OTLP_HTTP_PORT", "14318")
    monkeypatch.setenv("FLARE_STORE", str(tmp_path / "s.duckdb"))
    cfg = config.parse(config.load_file(EMBEDDED))
    otlp = cfg.receivers["otlp"]
    assert str(otlp.grpc.endpoint) == "127.0.0.1:14317" and str(otlp.http.endpoint) == "127.0.0.1:14318"
    assert cfg.exporters["flare_store"] == ("flare_store", {"path": str(tmp_path / "s.duckdb")})
    assert cfg.wal.directory == Path(str(tmp_path / "s.duckdb") + ".ingest-wal")
    for name in ("FLARE_OTLP_GRPC_PORT", "FLARE_OTLP_HTTP_PORT", "FLARE_STORE"):
        monkeypatch.delenv(name)
    cfg = config.parse(config.load_file(EMBEDDED))
    assert cfg.receivers["otlp"].grpc.endpoint.port == 4317 and cfg.receivers["otlp"].http.endpoint.port == 4318
    assert cfg.receivers["otlp"].grpc.endpoint.host == "127.0.0.1"  # loopback by default
    assert cfg.exporters["flare_store"][1]["path"] == ".flare/store.duckdb"
    monkeypatch.setenv("FLARE_OTLP_HOST", "0.0.0.0")  # ranks on other hosts
    cfg = config.parse(config.load_file(EMBEDDED))
    assert cfg.receivers["otlp"].grpc.endpoint.host == "0.0.0.0"
    assert cfg.receivers["otlp"].http.endpoint.host == "0.0.0.0"


def _embedded(tmp_path):
    return config.embedded_config(tmp_path / "s.duckdb")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["receivers"].update({"zipkin": {}}), "unknown receiver type 'zipkin'"),
        (lambda c: c["processors"].update({"tail_sampling": {}}), "unknown processor type 'tail_sampling'"),
        (lambda c: c["exporters"].update({"kafka": {}}), "unknown exporter type 'kafka'"),
        (lambda c: c["extensions"].update({"pprof": {}}), "extensions.pprof: unknown extension"),
        (lambda c: c["receivers"]["otlp"]["protocols"]["grpc"].update({"endpoint": "127.0.0.1:99999"}), "out of range"),
        (lambda c: c["receivers"]["otlp"]["protocols"]["http"].update({"endpoint": "http://x:1"}), "without a scheme"),
        (lambda c: c["receivers"]["otlp"]["protocols"]["http"].update({"bogus": 1}), "unknown option 'bogus'"),
        (lambda c: c["service"]["pipelines"]["traces"].update({"exporters": ["nope"]}), "exporter 'nope'"),
        (lambda c: c["service"]["pipelines"].update({"logs": {"receivers": ["otlp"], "exporters": ["flare_store"]}}), "unsupported signal 'logs'"),
        (lambda c: c["service"].update({"flush_interval": "soon"}), "expected a duration"),
        (lambda c: c["extensions"]["flare_wal"].update({"max_size": "lots"}), "expected a size"),
        (lambda c: c["exporters"]["flare_store"].update({"colour": "red"}), "exporters.flare_store: unknown option 'colour'"),
        (lambda c: c["exporters"]["flare_store"].update({"large_flush_rows": 0}), "flare_store.large_flush_rows: must be at least 1"),
        (lambda c: c["processors"]["memory_limiter"].update({"limit_mib": -1}), "processors.memory_limiter"),
    ],
)
def test_bad_configuration_is_one_clear_error(tmp_path, mutate, message):
    doc = _embedded(tmp_path)
    mutate(doc)
    with pytest.raises(ConfigError) as err:
        Collector(doc)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_cli_exit_codes_and_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    doc = _embedded(tmp_path)
    doc["exporters"]["nosuch"] = {}
    bad.write_text(yaml.safe_dump(doc))
    assert main(["--config", str(bad)]) == 2
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    (tmp_path / "broken.yaml").write_text("receivers: [\n")
    assert main(["--config", str(tmp_path / "broken.yaml")]) == 2
    assert main(["--config"]) == 2
    assert main(["--config", str(bad), "--frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("flare collector: error: ") for line in err)
    assert "unknown exporter type 'nosuch'" in err[0]
    assert "does not exist" in err[1]
    assert "not valid YAML" in err[2]


def test_cli_port_in_use_is_exit_1_without_traceback(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        doc = _embedded(tmp_path)
        doc["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"127.0.0.1:{taken.getsockname()[1]}"
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(doc))
        result = subprocess.run([sys.executable, "-m", "flare.collector", "--config", str(path)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "cannot listen for OTLP/HTTP" in result.stderr.strip().splitlines()[-1]


def test_cli_unreadable_certificate_or_token_is_a_configuration_error(tmp_path, capsys):
    """docs/collector.md: a certificate, key or token file that cannot be read is exit 2
    (it said 1, with a taken port's)."""
    for section in ({"tls": {"cert_file": str(tmp_path / "no.pem"), "key_file": str(tmp_path / "no.key")}},
                    {"auth": {"bearer_token_file": str(tmp_path / "no-token")}}):
        doc = _embedded(tmp_path)
        doc["receivers"]["otlp"]["protocols"]["http"].update(section)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(doc))
        assert main(["--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("flare collector: error: cannot read ")


def test_bearer_token_file_guards_the_http_receiver(tmp_path):
    """`auth.bearer_token_file` (the token is the file's text, trailing newline dropped)."""
    import urllib.error
    import urllib.request

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    cfg = config.embedded_config(str(tmp_path / "s.duckdb"))
    cfg["receivers"]["otlp"]["protocols"]["http"]["auth"] = {"bearer_token_file": str(token_file)}
    collector = Collector(cfg)
    collector.start()
    body = ExportTraceServiceRequest().SerializeToString()

    def post(token: str | None) -> int:
        headers = {"Content-Type": "application/x-protobuf"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"http://{collector.http_endpoint}/v1/traces", data=body,
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert post(None) == 401
        assert post("wrong") == 401
        assert post("s3cret") == 200
    finally:
        collector.stop()
    missing = config.embedded_config(str(tmp_path / "t.duckdb"))
    missing["receivers"]["otlp"]["protocols"]["http"]["auth"] = {"bearer_token_file": str(tmp_path / "nope")}
    with pytest.raises(ConfigError, match=r"cannot read auth\.bearer_token_file"):
        Collector(missing).start()


def test_a_default_may_be_a_reference_so_one_host_setting_moves_every_endpoint():
    value = "${env:FLARE_METRICS_HOST:-${env:FLARE_HOST:-127.0.0.1}}:${env:FLARE_METRICS_PORT:-8888}"
    assert config.substitute_env(value, {}) == "127.0.0.1:8888"
    assert config.substitute_env(value, {"FLARE_HOST": "0.0.0.0"}) == "0.0.0.0:8888"
    assert config.substitute_env(value, {"FLARE_HOST": "0.0.0.0",
                                         "FLARE_METRICS_HOST": "10.1.2.3"}) == "10.1.2.3:8888"


@pytest.mark.parametrize("name", ["embedded", "jaeger", "tempo"])
def test_every_listening_endpoint_of_a_shipped_config_follows_flare_host(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_HOST", "0.0.0.0")
    monkeypatch.setenv("FLARE_STORE", str(tmp_path / "s.duckdb"))
    doc = config.load_file(shipped.resolve(name))
    endpoints = [doc["receivers"]["otlp"]["protocols"][p]["endpoint"] for p in ("grpc", "http")]
    endpoints += [options["endpoint"] for ext, options in doc["extensions"].items()
                  if ext.startswith(("flare_metrics", "flare_query"))]
    assert len(endpoints) >= 3 and all(e.startswith("0.0.0.0:") for e in endpoints), endpoints


def test_shipped_configs_are_found_by_name_and_a_wrong_name_is_one_line(capsys):
    assert main(["--config", "tempo", "--print-config"]) == 0
    assert "otlp/tempo" in capsys.readouterr().out
    assert main(["--config", "loadbalancing", "--print-config"]) == 0
    assert "loadbalancing" in capsys.readouterr().out
    assert main(["--config", "loadbalancing"]) == 2
    assert "otelcol-contrib" in capsys.readouterr().err
    assert main(["--config", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert shipped.dashboard().exists()
