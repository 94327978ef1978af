"""Anomalies written back as `flare.anomaly` spans, next to the spans they explain.

Each anomaly becomes one span in the trace of its first step (so Jaeger/Tempo show it
inside that step's trace), carrying the `flare.anomaly.*` attributes and one link per
evidence span. The span id is derived from the anomaly's key, so writing the same
diagnosis twice replaces rather than duplicates it in the store.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from flare.diagnostics.model import Anomaly
from flare.exporters import store as flare_store
from flare.wire import semconv as sc

SERVICE = sc.DIAGNOSTICS_SERVICE
EvidenceLinks = Mapping[str, Sequence[tuple[str, str]]]  # anomaly key → (trace_id, span_id) hex


class WritebackError(Exception):
    """Writing anomalies back failed; the message is one sentence."""


def anomaly_trace_id(job: str, anomaly: Anomaly) -> str:
    if anomaly.trace_ids:
        return anomaly.trace_ids[0]
    return f"{sc.step_trace_id(job, anomaly.first_step or 0):032x}"


def anomaly_span_id(job: str, anomaly: Anomaly) -> str:
    digest = hashlib.blake2b(f"{job}\x00{anomaly.key}".encode(), digest_size=8).digest()
    return digest.hex() if any(digest) else "0000000000000001"


def anomaly_attributes(anomaly: Anomaly) -> dict[str, object]:
    data = anomaly.to_json()
    attrs: dict[str, object] = {
        sc.ANOMALY_ID: anomaly.key,
        sc.ANOMALY_KIND: data["kind"],
        sc.ANOMALY_RANKS: data["ranks"],
        sc.ANOMALY_CAUSE: data["cause"],
        sc.ANOMALY_IMPACT: data["impact"],
        sc.ANOMALY_CONFIDENCE: data["confidence"],
        sc.ANOMALY_SUMMARY: data["summary"],
        sc.ANOMALY_EVIDENCE: json.dumps(data["evidence"], sort_keys=True),
    }
    if data["first_step"] is not None:
        attrs[sc.ANOMALY_FIRST_STEP] = int(data["first_step"])
    if data["last_step"] is not None:
        attrs[sc.ANOMALY_LAST_STEP] = int(data["last_step"])
    if data["callsite"]:
        attrs[sc.ANOMALY_CALLSITE] = data["callsite"]
    return attrs


def _any_value(value: object) -> common_pb2.AnyValue:
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return common_pb2.AnyValue(
            array_value=common_pb2.ArrayValue(values=[_any_value(v) for v in value])
        )
    return common_pb2.AnyValue(string_value=str(value))


def _key_values(attrs: Mapping[str, object]) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=_any_value(v)) for k, v in attrs.items()]


def anomaly_spans(
    job: str,
    anomalies: Sequence[Anomaly],
    evidence_links: EvidenceLinks | None = None,
    time_ns: int | None = None,
) -> trace_service_pb2.ExportTraceServiceRequest:
    now = time_ns if time_ns is not None else time.time_ns()
    links = evidence_links or {}
    spans = []
    for anomaly in anomalies:
        spans.append(trace_pb2.Span(
            trace_id=bytes.fromhex(anomaly_trace_id(job, anomaly)),
            span_id=bytes.fromhex(anomaly_span_id(job, anomaly)),
            name=sc.SPAN_ANOMALY,
            kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=now,
            end_time_unix_nano=now,
            attributes=_key_values(anomaly_attributes(anomaly)),
            links=[
                trace_pb2.Span.Link(trace_id=bytes.fromhex(t), span_id=bytes.fromhex(s))
                for t, s in links.get(anomaly.key, ())
            ],
        ))
    return _request(job, spans)


def stop_span(job: str, signal_name: str, time_ns: int) -> trace_service_pb2.ExportTraceServiceRequest:
    """The record that `flare run` stopped `job` at its user's signal (`signal_name`, at
    `time_ns`): a later `flare diagnose` reads the job as the run's own report did
    (DiagnosisConfig.stopped_by_user), not its stop's echoes as failures."""
    span = trace_pb2.Span(
        trace_id=sc.step_trace_id(job, 0).to_bytes(16, "big"),
        span_id=sc.step_trace_id(job + "/stop", 0).to_bytes(16, "big")[8:],
        name=sc.SPAN_RUN_STOP, kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=time_ns, end_time_unix_nano=time_ns,
        attributes=_key_values({sc.RUN_STOP_SIGNAL: signal_name}))
    return _request(job, [span])


def _request(job: str, spans: list) -> trace_service_pb2.ExportTraceServiceRequest:
    resource = resource_pb2.Resource(attributes=_key_values({
        sc.SERVICE_NAME: SERVICE, sc.JOB_ID: job,
    }))
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=resource,
        scope_spans=[trace_pb2.ScopeSpans(
            scope=common_pb2.InstrumentationScope(name="flare.diagnostics"), spans=spans,
        )],
    )])


def write_to_store(
    store_path: str,
    job: str,
    anomalies: Sequence[Anomaly],
    evidence_links: EvidenceLinks | None = None,
    time_ns: int | None = None,
) -> int:
    """Insert the anomaly spans into the store, replacing earlier copies of them."""
    now = time_ns if time_ns is not None else time.time_ns()
    links = evidence_links or {}
    rows: dict[str, list[object]] = {name: [] for name, _, _ in flare_store.SPAN_COLUMNS}
    for anomaly in anomalies:
        row = {
            "job": job, "service": SERVICE,
            "trace_id": anomaly_trace_id(job, anomaly),
            "span_id": anomaly_span_id(job, anomaly), "parent_span_id": "",
            "name": sc.SPAN_ANOMALY, "kind": 1, "start_ns": now, "end_ns": now,
            "duration_ns": 0, "status_code": 0, "status_message": "",
            "rank": None, "step": anomaly.first_step, "host": None, "pid": None,
            "attributes": json.dumps(anomaly_attributes(anomaly)),
            "resource": json.dumps({sc.SERVICE_NAME: SERVICE, sc.JOB_ID: job}),
            "events": "[]",
            "links": json.dumps([{"trace_id": t, "span_id": s, "attributes": {}}
                                 for t, s in links.get(anomaly.key, ())]),
        }
        for name, values in rows.items():
            values.append(row[name])
    table = flare_store.spans_table(rows)
    try:
        with flare_store.writer(store_path) as con:
            con.execute("BEGIN")
            ids = table.column("span_id").to_pylist()
            if ids:
                con.execute(
                    "DELETE FROM spans WHERE job = ? AND name = ? AND span_id IN ("
                    + ", ".join("?" for _ in ids) + ")",
                    [job, sc.SPAN_ANOMALY, *ids],
                )
            flare_store.insert_spans(con, table)
            con.execute("COMMIT")
    except flare_store.StoreError as exc:
        raise WritebackError(str(exc)) from None
    return table.num_rows


def send_otlp(
    endpoint: str,
    request: trace_service_pb2.ExportTraceServiceRequest,
    timeout_s: float = 10.0,
) -> None:
    """Send to an OTLP endpoint: `http(s)://host:port/v1/traces` is OTLP/HTTP
    protobuf; any other `[http://]host:port` is OTLP/gRPC."""
    parsed = urlparse(endpoint if "://" in endpoint else f"grpc://{endpoint}")
    if parsed.path.rstrip("/").endswith("/v1/traces"):
        _send_http(endpoint, request, timeout_s)
    else:
        _send_grpc(parsed, request, timeout_s)


def _send_http(url: str, request: trace_service_pb2.ExportTraceServiceRequest, timeout_s: float) -> None:
    from flare.wire import http_client

    context = http_client.tls_context() if url.startswith("https:") else None
    client = http_client.HttpClient(url, timeout_s, context)
    try:
        reply = client.request("POST", client.prefix, body=request.SerializeToString(),
                               headers={"Content-Type": "application/x-protobuf"})
    except http_client.TransportError as exc:
        raise WritebackError(f"cannot send anomalies to {url}: {exc.reason}") from None
    finally:
        client.close()
    if not 200 <= reply.status < 300:
        raise WritebackError(f"cannot send anomalies to {url}: HTTP {reply.status} {reply.reason}")


def _send_grpc(parsed, request: trace_service_pb2.ExportTraceServiceRequest, timeout_s: float) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    target = parsed.netloc
    channel = grpc.secure_channel(target, grpc.ssl_channel_credentials()) if parsed.scheme == "https" \
        else grpc.insecure_channel(target)
    try:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        # (seen: `--otlp-endpoint http://collector:4318`, the OTLP/HTTP port, read
        # "cannot send anomalies to collector:4318: unavailable", which named neither
        # the protocol tried nor the URL that speaks OTLP/HTTP)
        raise WritebackError(
            f"cannot send anomalies over OTLP/gRPC to {target}: "
            f"{exc.code().name.lower()}"  # type: ignore[attr-defined]
            f" (for an OTLP/HTTP receiver give its …/v1/traces URL, e.g. "
            f"{'https' if parsed.scheme == 'https' else 'http'}://{target}/v1/traces)"
        ) from None
    finally:
        channel.close()
