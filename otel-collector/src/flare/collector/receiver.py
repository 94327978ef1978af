"""What the gRPC and HTTP receivers share: decode, check, submit, answer.

Both transports end in `accept()`, which returns the OTLP response message (with a
partial-success note when items were rejected) or raises MalformedPayload / Refused
for the transport to map onto its status codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from flare.collector import otlp_json, validate
from flare.collector.errors import MalformedPayload, Refused
from flare.collector.ingest import Ingest
from flare.collector.telemetry import Counters
from flare.collector.wal import SIGNAL_METRICS, SIGNAL_TRACES


@dataclass(frozen=True)
class SignalKind:
    name: str  # "traces" | "metrics"
    code: int  # wal signal code
    request: type
    response: type
    item_unit: str  # what counters count: "spans" | "metric_points"


TRACES = SignalKind("traces", SIGNAL_TRACES, ExportTraceServiceRequest, ExportTraceServiceResponse, "spans")
METRICS = SignalKind("metrics", SIGNAL_METRICS, ExportMetricsServiceRequest, ExportMetricsServiceResponse, "metric_points")


class Acceptor:
    """Turns request bytes into an accepted, logged request and its OTLP response."""

    def __init__(self, ingest: Ingest, counters: Counters) -> None:
        self.ingest = ingest
        self.counters = counters

    def accept(self, kind: SignalKind, body: bytes, transport: str, is_json: bool = False) -> Any:
        if kind is TRACES and not is_json:
            # The common case is told from the bytes alone (what protobuf would accept,
            # every span usable): the request is not parsed here, the pipeline reads the
            # bytes. Anything else is parsed and checked below, as before.
            checked = validate.check_traces_wire(body)
            if checked is not None:
                return self._submit(kind, None, body, checked, transport)
        try:
            if is_json:
                request = otlp_json.parse(body, kind.request)
            else:
                request = kind.request.FromString(body)
        except MalformedPayload:
            self.counters.add("malformed_requests", transport=transport)
            raise
        except (DecodeError, ValueError, RuntimeError) as exc:
            self.counters.add("malformed_requests", transport=transport)
            raise MalformedPayload(f"not an OTLP {kind.request.__name__}: {exc}") from None
        if kind is TRACES:
            checked = validate.check_traces(request, None if is_json else body)
        else:
            checked = validate.check_metrics(request)
        # The log keeps the canonical binary form: the original bytes when nothing was
        # removed from a protobuf body, else a fresh encoding of what was kept.
        payload = body if not (is_json or checked.rejected) else None
        return self._submit(kind, request, payload, checked, transport)

    def _submit(
        self, kind: SignalKind, request: Any, payload: bytes | None, checked: validate.Checked,
        transport: str,
    ) -> Any:
        """Log and enqueue what `checked` kept; `request` may be None when `payload`
        (its encoding) is given, and is parsed from it only where something needs it."""
        response = kind.response()
        if checked.rejected:
            self.counters.add("rejected_" + kind.item_unit, checked.rejected, transport=transport)
            partial = response.partial_success
            if kind is TRACES:
                partial.rejected_spans = checked.rejected
            else:
                partial.rejected_data_points = checked.rejected
            partial.error_message = checked.message
        if checked.accepted == 0:
            return response  # nothing to keep: no log record, still a valid reply
        if payload is None:
            payload = request.SerializeToString()
        try:
            self.ingest.submit(kind.code, request, payload)
        except Refused as refused:
            self.counters.add("refused_requests", transport=transport, reason=refused.code)
            self.counters.add("refused_" + kind.item_unit, checked.accepted, transport=transport)
            raise
        self.counters.add("accepted_requests", transport=transport, signal=kind.name)
        self.counters.add("accepted_" + kind.item_unit, checked.accepted, transport=transport)
        self.counters.add("accepted_bytes", len(payload), transport=transport)
        return response

