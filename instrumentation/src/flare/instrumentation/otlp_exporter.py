"""`flare_otlp`: the SDK's OTLP span exporter with Flare's direct protobuf writer, over
gRPC or, when `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`)
is `http/protobuf`, over HTTP (`otlp_http.FlareOTLPHttpSpanExporter`, which `flare run`
uses: no gRPC threads in the rank). Like the SDK's `otlp`, the protocol defaults to gRPC.

Everything but the encoding is the SDK's `OTLPSpanExporter` (endpoint and TLS
settings, headers, compression, retries, timeouts, the environment variables it
reads): only the request differs, written as bytes by
`flare.instrumentation.otlp_encoding` (~8x less CPU per span, its attribute writer in C
when built) instead of one protobuf object per attribute, and handed to gRPC as bytes. Select it with `OTEL_TRACES_EXPORTER=flare_otlp` (`flare run`
does); `otlp` keeps working, at the SDK encoder's cost.

At construction the exporter checks that the installed SDK encodes a probe set of
spans exactly as the writer does; if not (an SDK that changed its encoding), it logs
it once and uses the SDK's encoder.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.instrumentation import otlp_encoding

_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def writer_matches_sdk() -> bool:
    from flare.instrumentation.sdk_gate import internals_ok

    if not internals_ok():  # the probe reads the SDK's internal encoder
        return False
    try:
        same = otlp_encoding.matches_sdk(otlp_encoding.probe_spans())
    except Exception as error:  # an SDK whose internals moved: use it as it is
        _log.info("flare: the OTLP writer cannot check itself against this SDK (%r); "
                  "spans are encoded by the SDK", error)
        return False
    if not same:
        _log.info("flare: this SDK encodes spans differently from Flare's OTLP writer; "
                  "spans are encoded by the SDK")
    return same


def _protocol() -> str:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()


@functools.cache
def _warn_once(message: str) -> None:
    _log.warning(message)


class FlareOTLPSpanExporter(OTLPSpanExporter):
    """OTLP/gRPC span exporter; same settings and behaviour, cheaper encoding. Built
    with the HTTP protocol configured, it is a `FlareOTLPHttpSpanExporter` instead."""

    def __new__(cls, *args, **kwargs):
        protocol = _protocol()
        if cls is FlareOTLPSpanExporter and protocol != "grpc":
            if protocol not in ("http/protobuf", "http/json"):
                _warn_once(f"flare: unknown OTLP protocol {protocol!r} (grpc, "
                           "http/protobuf); spans are sent over gRPC")
                return super().__new__(cls)
            if protocol == "http/json":  # every OTLP/HTTP receiver takes protobuf too
                _warn_once("flare: flare_otlp sends OTLP/HTTP as protobuf, not JSON")
            try:
                from flare.instrumentation.otlp_http import FlareOTLPHttpSpanExporter
            except ImportError as error:
                _warn_once(f"flare: OTLP/HTTP needs opentelemetry-exporter-otlp-proto-http "
                           f"({error}); spans are sent over gRPC")
                return super().__new__(cls)
            kwargs.pop("insecure", None)  # gRPC's; over HTTP the URL scheme decides
            return FlareOTLPHttpSpanExporter(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fast = writer_matches_sdk()
        # The written request goes to gRPC as it is (a stub without a serializer), not
        # parsed into the protobuf object the SDK's stub would serialize again. Where
        # the SDK keeps its channel and stub under other names, the request is parsed.
        self._sends_bytes = False
        if (self._fast and getattr(self, "_channel", None) is not None
                and hasattr(self, "_stub") and hasattr(self, "_client")):
            self._stub = _BytesTraceStub  # what a reconnection builds its client from
            self._client = _BytesTraceStub(self._channel)
            self._sends_bytes = True

    @property
    def writes_otlp_encoding(self) -> bool:
        """Whether requests are written by otlp_encoding, which also takes the spans
        Flare hands over already written (`otlp_encoding.EncodedSpan`)."""
        return self._fast

    def _translate_data(self, data: Sequence) -> ExportTraceServiceRequest | bytes:
        if not self._fast:
            return encode_spans(data)
        request = otlp_encoding.encode_request(data)
        if self._sends_bytes:
            return request
        return ExportTraceServiceRequest.FromString(request)


class _BytesTraceStub:
    """TraceService.Export taking the serialized request (bytes) as it is."""

    def __init__(self, channel):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        self.Export = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None,  # bytes already
            response_deserializer=ExportTraceServiceResponse.FromString)
