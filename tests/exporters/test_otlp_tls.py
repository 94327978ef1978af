"""The otlp exporter's client TLS (`tls: {ca_file, cert_file, key_file, insecure}`)
against a real Flare collector whose receivers require a client certificate."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.collector.config import embedded_config
from flare.collector.service import Collector
from flare.exporters import store
from flare.exporters.otlp import OtlpExporter


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to generate test certificates")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "ca.key",
             "-out", "ca.pem", "-subj", "/CN=ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)
    return d


@pytest.fixture
def mtls_collector(certs, tmp_path):
    config = embedded_config(str(tmp_path / "store.duckdb"))
    tls = {"cert_file": str(certs / "server.pem"), "key_file": str(certs / "server.key"),
           "client_ca_file": str(certs / "ca.pem")}
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        protocol["tls"] = dict(tls)
    collector = Collector(config)
    collector.start()
    yield collector
    collector.stop()


def _request(tag: str) -> tsvc.ExportTraceServiceRequest:
    spans = [Span(trace_id=b"\x01" * 16, span_id=i.to_bytes(8, "big"), name=f"{tag}{i}")
             for i in range(1, 4)]
    return tsvc.ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": [KeyValue(key="service.name", value=AnyValue(string_value="tls"))]},
        scope_spans=[ScopeSpans(spans=spans)],
    )])


def _stored(collector: Collector, tag: str) -> int:
    assert collector.flush()
    if not Path(collector.store_path).exists():
        return 0  # nothing was ever written
    con = store.open_reader(collector.store_path)
    try:
        return con.execute("SELECT count(*) FROM spans WHERE name LIKE ?", [tag + "%"]).fetchone()[0]
    finally:
        con.close()


def _send(exporter: OtlpExporter, tag: str) -> dict[str, float]:
    exporter.export_traces(_request(tag))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = exporter.metrics()
        if metrics["sent_requests"] or metrics["failed_requests"] or metrics["retries"]:
            break
        time.sleep(0.05)
    exporter.shutdown()
    return exporter.metrics()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_client_certificate_reaches_a_mutual_tls_collector(mtls_collector, certs, protocol):
    endpoint = (mtls_collector.grpc_endpoint if protocol == "grpc"
                else "https://" + mtls_collector.http_endpoint)
    tls = {"ca_file": str(certs / "ca.pem"), "cert_file": str(certs / "client.pem"),
           "key_file": str(certs / "client.key")}
    tag = "ok" + protocol[:4]
    metrics = _send(OtlpExporter(endpoint, protocol=protocol, tls=tls, shutdown_timeout="5s"), tag)
    assert metrics["sent_requests"] == 1
    assert _stored(mtls_collector, tag) == 3


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_without_a_client_certificate_nothing_is_stored(mtls_collector, certs, protocol):
    endpoint = (mtls_collector.grpc_endpoint if protocol == "grpc"
                else "https://" + mtls_collector.http_endpoint)
    tag = "no" + protocol[:4]
    exporter = OtlpExporter(endpoint, protocol=protocol, tls={"ca_file": str(certs / "ca.pem")},
                            retry_on_failure={"enabled": False}, shutdown_timeout="2s")
    metrics = _send(exporter, tag)
    assert metrics["sent_requests"] == 0
    assert _stored(mtls_collector, tag) == 0


def test_tls_options_are_checked_at_start(certs, tmp_path):
    with pytest.raises(ValueError, match="unknown option 'ca'"):
        OtlpExporter("localhost:4317", tls={"ca": "x"})
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        OtlpExporter("localhost:4317", tls={"cert_file": str(certs / "client.pem")})
    with pytest.raises(ValueError, match=r"cannot read otlp\.tls\.ca_file"):
        OtlpExporter("localhost:4317", tls={"ca_file": str(tmp_path / "missing.pem")})
    with pytest.raises(ValueError, match="not https"):
        OtlpExporter("http://localhost:4318", tls={"ca_file": str(certs / "ca.pem")})
