"""TLS, mutual TLS and bearer tokens on the collector's OTLP receivers and read endpoint.

A real collector; real OTLP over gRPC and HTTP; a request without valid credentials
is rejected, counted, and nothing of it reaches the store.
"""

from __future__ import annotations

import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from flare.collector import security
from flare.diagnostics.backends import BackendError
from flare.diagnostics.backends.jaeger import JaegerBackend
from flare.exporters import store

TOKEN = "t0ken-for-tests"


# ---------------------------------------------------------------- the module alone


def test_bearer_auth_checks_and_counts():
    auth = security.BearerAuth(TOKEN)
    assert auth.check(f"Bearer {TOKEN}")
    assert auth.check(f"bearer {TOKEN}")  # the scheme is case-insensitive
    assert not auth.check(None)
    assert not auth.check("Bearer wrong")
    assert not auth.check(TOKEN)
    assert (auth.accepted, auth.rejected) == (2, 3)
    # every Authorization header is passed; more than one is refused, even if all match
    assert auth.check(f"Bearer {TOKEN}", None)
    assert not auth.check(f"Bearer {TOKEN}", f"Bearer {TOKEN}")
    assert not auth.check("Bearer wrong", f"Bearer {TOKEN}")
    assert auth.check_metadata([("x-other", "1"), ("authorization", f"Bearer {TOKEN}")])
    assert not auth.check_metadata([("authorization", f"Bearer {TOKEN}")] * 2)
    assert (auth.accepted, auth.rejected) == (4, 6)
    with pytest.raises(security.SecurityConfigError, match="empty"):
        security.BearerAuth("")


def test_bad_tls_settings_are_one_sentence(certs, tmp_path):
    with pytest.raises(security.SecurityConfigError, match=r"cannot read tls\.cert_file"):
        security.ssl_context({"cert_file": str(tmp_path / "nope.pem"), "key_file": "x"})
    with pytest.raises(security.SecurityConfigError, match="do not form a certificate chain"):
        security.ssl_context({"cert_file": certs["server"] + ".pem",
                              "key_file": certs["client"] + ".key"})
    with pytest.raises(security.SecurityConfigError, match="unknown key 'certfile'"):
        security.server_credentials({"certfile": "x"})
    assert security.exposure_problem("0.0.0.0:4317", None, None)
    assert security.exposure_problem("127.0.0.1:4317", None, None) is None
    assert security.exposure_problem("0.0.0.0:4317", {"cert_file": "x"}, None) is None


# ---------------------------------------------------------------- a secured collector


def _request(service: str) -> trace_service_pb2.ExportTraceServiceRequest:
    span = trace_pb2.Span(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)),
                          name="train.step", start_time_unix_nano=time.time_ns(),
                          end_time_unix_nano=time.time_ns() + 1000)
    resource = resource_pb2.Resource(attributes=[common_pb2.KeyValue(
        key="service.name", value=common_pb2.AnyValue(string_value=service))])
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=resource, scope_spans=[trace_pb2.ScopeSpans(spans=[span])])])


@pytest.fixture
def secured_collector(certs, tmp_path):
    from flare.collector.config import embedded_config
    from flare.collector.service import Collector

    path = str(tmp_path / "store.duckdb")
    tls = {"cert_file": certs["server"] + ".pem", "key_file": certs["server"] + ".key",
           "client_ca_file": certs["ca"] + ".pem"}
    auth = {"bearer_token": TOKEN}
    config = embedded_config(path)
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        protocol.update({"tls": tls, "auth": auth})
    config["extensions"]["flare_query"] = {"endpoint": "127.0.0.1:0", "tls": tls, "auth": auth}
    config["service"]["extensions"].append("flare_query")
    collector = Collector(config)
    collector.start()
    yield collector, path
    collector.stop()


def _grpc_channel(collector, certs, client: str | None):
    kwargs = {}
    if client:
        kwargs = {"private_key": Path(certs[client] + ".key").read_bytes(),
                  "certificate_chain": Path(certs[client] + ".pem").read_bytes()}
    creds = grpc.ssl_channel_credentials(Path(certs["ca"] + ".pem").read_bytes(), **kwargs)
    return grpc.secure_channel(collector.grpc_endpoint, creds)


def _stored_services(collector, path) -> list[str]:
    collector.flush()
    con = store.open_reader(path)
    try:
        return sorted(r[0] for r in con.execute("SELECT service FROM spans").fetchall())
    finally:
        con.close()


def test_grpc_requires_client_certificate_and_token(secured_collector, certs):
    collector, path = secured_collector
    with _grpc_channel(collector, certs, "client") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        stub.Export(_request("good-grpc"), metadata=[("authorization", f"Bearer {TOKEN}")],
                    timeout=10)
        for metadata in ([], [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as info:
                stub.Export(_request("no-token"), metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for client in (None, "rogue"):  # no client certificate / one from another CA
        with _grpc_channel(collector, certs, client) as channel:
            with pytest.raises(grpc.RpcError) as info:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(
                    _request("no-cert"), metadata=[("authorization", f"Bearer {TOKEN}")],
                    timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert collector.counters.total("unauthenticated_requests") == 2
    assert _stored_services(collector, path) == ["good-grpc"]


def _https_post(collector, certs, client: str | None, token: str | None):
    context = ssl.create_default_context(cafile=certs["ca"] + ".pem")
    if client:
        context.load_cert_chain(certs[client] + ".pem", certs[client] + ".key")
    headers = {"Content-Type": "application/x-protobuf"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        f"https://{collector.http_endpoint}/v1/traces",
        data=_request(f"http-{client}-{token is not None}").SerializeToString(),
        headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_http_requires_client_certificate_and_token(secured_collector, certs):
    collector, path = secured_collector
    assert _https_post(collector, certs, "client", TOKEN) == 200
    assert _https_post(collector, certs, "client", None) == 401
    assert _https_post(collector, certs, "client", "wrong") == 401
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _https_post(collector, certs, "rogue", TOKEN)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to TLS
        urllib.request.urlopen(f"http://{collector.http_endpoint}/v1/traces", timeout=10)
    assert collector.counters.total("unauthenticated_requests") == 2
    assert _stored_services(collector, path) == ["http-client-True"]


def test_read_endpoint_with_matching_backend_options(secured_collector, certs):
    collector, _ = secured_collector
    with _grpc_channel(collector, certs, "client") as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(
            _request("jobS"), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10)
    collector.flush()
    url = f"https://{collector.query_endpoint}"
    client = {"ca_file": certs["ca"] + ".pem", "cert_file": certs["client"] + ".pem",
              "key_file": certs["client"] + ".key"}
    assert JaegerBackend(url, bearer_token=TOKEN, **client).jobs() == ["jobS"]
    with pytest.raises(BackendError, match="refused the request \\(HTTP 401\\)"):
        JaegerBackend(url, **client).jobs()
    with pytest.raises(BackendError) as info:
        JaegerBackend(url, bearer_token=TOKEN, ca_file=certs["ca"] + ".pem").jobs()
    assert "\n" not in str(info.value)
    with pytest.raises(BackendError, match="TLS handshake"):
        JaegerBackend(url, bearer_token=TOKEN).jobs()  # server certificate not trusted
    with pytest.raises(BackendError, match="not https"):
        JaegerBackend(f"http://{collector.query_endpoint}", **client)


def test_cli_reads_client_credentials_from_the_environment(
    secured_collector, certs, monkeypatch, capsys
):
    """`flare diagnose --backend jaeger+https://…` with FLARE_BACKEND_* set: no secret
    on the command line, and without them one clear error line."""
    import json

    from flare.diagnostics.cli import main as flare_main

    collector, _ = secured_collector
    with _grpc_channel(collector, certs, "client") as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(
            _request("jobC"), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10)
    collector.flush()
    spec = f"jaeger+https://{collector.query_endpoint}"
    monkeypatch.setenv("FLARE_BACKEND_CA_FILE", certs["ca"] + ".pem")
    monkeypatch.setenv("FLARE_BACKEND_CERT_FILE", certs["client"] + ".pem")
    monkeypatch.setenv("FLARE_BACKEND_KEY_FILE", certs["client"] + ".key")
    monkeypatch.setenv("FLARE_BACKEND_TOKEN", TOKEN)
    assert flare_main(["diagnose", "--backend", spec, "--job", "jobC", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"] == "jobC" and report["anomalies"] == []
    monkeypatch.setenv("FLARE_BACKEND_TOKEN", "wrong")
    assert flare_main(["diagnose", "--backend", spec, "--job", "jobC"]) != 0
    err = capsys.readouterr().err
    assert "HTTP 401" in err and err.count("\n") == 1


def _raw_https(endpoint: str, certs, request: bytes) -> tuple[int, bytes]:
    """One raw request over mutual TLS; (status, the rest of the reply)."""
    import socket

    context = ssl.create_default_context(cafile=certs["ca"] + ".pem")
    context.load_cert_chain(certs["client"] + ".pem", certs["client"] + ".key")
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as sock:
        sock.sendall(request)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1]), reply


def test_duplicate_authorization_is_refused_over_https_and_grpc(secured_collector, certs):
    """Two Authorization headers (both with the right token) are one 401 / UNAUTHENTICATED
    on every transport: neither the first nor the last is trusted."""
    collector, _ = secured_collector
    body = _request("twice").SerializeToString()
    for endpoint, head in ((collector.http_endpoint, b"POST /v1/traces"),
                           (collector.query_endpoint, b"GET /api/v3/services")):
        for tokens in ([TOKEN, TOKEN], ["wrong", TOKEN], [TOKEN, "wrong"]):
            auth = b"".join(b"Authorization: Bearer %s\r\n" % t.encode() for t in tokens)
            request = (head + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n" + auth
                       + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert _raw_https(endpoint, certs, request)[0] == 401
    with _grpc_channel(collector, certs, "client") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        for tokens in ([TOKEN, TOKEN], ["wrong", TOKEN], [TOKEN, "wrong"]):
            with pytest.raises(grpc.RpcError) as info:
                stub.Export(_request("twice"), metadata=[("authorization", f"Bearer {t}") for t in tokens],
                            timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert collector.counters.total("unauthenticated_requests") == 3 + 3 + 3
    assert collector.counters.total("accepted_requests") == 0


def test_tls_endpoints_check_the_token_before_path_and_body(secured_collector, certs):
    """Unknown paths are 401 without the token; a hostile Content-Length is not read."""
    collector, _ = secured_collector
    for endpoint in (collector.http_endpoint, collector.query_endpoint):
        assert _raw_https(endpoint, certs, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 401
        status, reply = _raw_https(endpoint, certs, b"POST /nope HTTP/1.1\r\nHost: x\r\n"
                                   b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                                   b"Content-Length: -1\r\n\r\n")
        assert status == 400 and b"Connection: close" in reply


def test_a_rank_polls_the_control_channel_over_mutual_tls(secured_collector, certs, monkeypatch):
    """A rank's OpAMP agent to a collector that wants TLS, a client certificate and the
    ingest token: it takes them from the OTLP exporter's variables (one reading of them,
    http_client.otlp_tls_from_env, one client context, http_client.tls_context) and is
    seen alive; without the client certificate the collector never sees it."""
    from opentelemetry.sdk.trace import TracerProvider

    from flare.instrumentation import identity
    from flare.instrumentation.torch_training import TorchTrainingInstrumentor

    collector, _ = secured_collector
    for key in [k for k in os.environ if k.startswith(("FLARE_", "OTEL_EXPORTER_OTLP"))]:
        monkeypatch.delenv(key)
    job = "mtls-job"
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "FLARE_JOB_ID": job,
                       "FLARE_HEARTBEAT_S": "0", "FLARE_OPAMP_INTERVAL_S": "0.2",
                       "FLARE_OPAMP_ENDPOINT": f"https://{collector.http_endpoint}/v1/opamp",
                       "OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer {TOKEN}",
                       "OTEL_EXPORTER_OTLP_CERTIFICATE": certs["ca"] + ".pem"}.items():
        monkeypatch.setenv(key, value)

    def seen(client_certificate: bool) -> bool:
        if client_certificate:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", certs["client"] + ".pem")
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", certs["client"] + ".key")
        identity.current_identity.cache_clear()
        instrumentor = TorchTrainingInstrumentor()
        instrumentor.instrument(tracer_provider=TracerProvider(), skip_dep_check=True)
        try:
            # (5 polls a second: refused ones are over within 3 s)
            deadline = time.monotonic() + (10 if client_certificate else 3)
            while time.monotonic() < deadline:
                if any(a.get("state") == "alive" for a in collector.opamp.agents(job)):
                    return True
                time.sleep(0.1)
            return False
        finally:
            instrumentor.uninstrument()
            identity.current_identity.cache_clear()

    assert not seen(client_certificate=False)
    assert seen(client_certificate=True)
