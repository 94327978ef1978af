"""`flare_otlp` over gRPC: the SDK's OTLP/gRPC span exporter with Flare's protobuf
writer, the request handed to gRPC as bytes. `otlp_exporter.FlareOTLPSpanExporter` builds
it when the protocol is gRPC (the SDK's default); only then is gRPC imported: its C core
costs each process ~0.3 s of CPU to load, which a rank exporting over HTTP (`flare run`)
does not pay.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.instrumentation import otlp_encoding
from flare.wire import sdk_adapter as sdk


class FlareOTLPGrpcSpanExporter(OTLPSpanExporter):
    """OTLP/gRPC span exporter; the SDK's settings and behaviour, cheaper encoding."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fast = otlp_encoding.writer_matches_sdk()
        # The written request goes to gRPC as it is (a stub without a serializer), not
        # parsed into the protobuf object the SDK's stub would serialize again. Where
        # the SDK keeps its channel and stub under other names, the request is parsed.
        self._sends_bytes = self._fast and sdk.send_grpc_bytes(self, _BytesTraceStub)

    @property
    def writes_otlp_encoding(self) -> bool:
        """Whether requests are written by otlp_encoding, which also takes the spans
        Flare hands over already written (`otlp_encoding.EncodedSpan`)."""
        return self._fast

    def translate(self, data: Sequence) -> ExportTraceServiceRequest | bytes:
        """The request for `data`, as the SDK exporter's request hook returns it (routed
        here by `sdk_adapter.route_grpc_encoding`): Flare's bytes, or the SDK's
        encoding where the writer does not match the SDK."""
        if not self._fast:
            return encode_spans(data)
        request = otlp_encoding.encode_request(data)
        if self._sends_bytes:
            return request
        return ExportTraceServiceRequest.FromString(request)


sdk.route_grpc_encoding(FlareOTLPGrpcSpanExporter, "translate")


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
