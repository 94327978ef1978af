"""The collector's start line gives each HTTP endpoint's URL with the scheme it serves:
the `secure` configuration's metrics endpoint is TLS-only, and the line said http://."""

from __future__ import annotations

import shutil
import subprocess

import pytest


@pytest.fixture
def server_cert(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to generate a test certificate")
    key, pem = tmp_path / "server.key", tmp_path / "server.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(pem), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return {"cert_file": str(pem), "key_file": str(key)}


def test_a_tls_endpoint_is_announced_as_https(tmp_path, server_cert, helpers, collector_process):
    config = helpers.base_config(tmp_path / "s.duckdb")
    config["extensions"]["flare_metrics"]["tls"] = server_cert
    config["extensions"]["flare_query"] = {"endpoint": "127.0.0.1:0", "tls": server_cert}
    config["service"]["extensions"].append("flare_query")
    collector = collector_process(config).start()
    try:
        ready = next(line for line in collector.log().splitlines() if "ready: " in line)
        assert collector.metrics.startswith("https://127.0.0.1:") and collector.metrics.endswith("/metrics")
        assert " query https://127.0.0.1:" in ready
    finally:
        assert collector.terminate() == 0


def test_a_plain_endpoint_is_announced_as_http(collector_process):
    collector = collector_process().start()
    try:
        assert collector.metrics.startswith("http://127.0.0.1:") and collector.metrics.endswith("/metrics")
        assert collector.scrape()  # the URL the line gives is the one that answers
    finally:
        assert collector.terminate() == 0
