"""`flare_otlp`: the SDK's OTLP span exporter with Flare's direct protobuf writer, over
gRPC (`otlp_grpc.FlareOTLPGrpcSpanExporter`) or, when `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`
(else `OTEL_EXPORTER_OTLP_PROTOCOL`) is `http/protobuf`, over HTTP
(`otlp_http.FlareOTLPHttpSpanExporter`, which `flare run` uses: no gRPC in the rank,
not even imported). Like the SDK's `otlp`, the protocol defaults to gRPC.

Everything but the encoding is the SDK's exporter of that protocol (endpoint and TLS
settings, headers, compression, retries, timeouts, the environment variables it
reads): only the request differs, written as bytes by
`flare.instrumentation.otlp_encoding` (~8x less CPU per span, its attribute writer in C
when built) instead of one protobuf object per attribute. Select it with
`OTEL_TRACES_EXPORTER=flare_otlp` (`flare run` does); `otlp` keeps working, at the SDK
encoder's cost.

At construction the exporter checks that the installed SDK encodes a probe set of
spans exactly as the writer does (`otlp_encoding.writer_matches_sdk`); if not (an SDK
that changed its encoding), it logs it once and uses the SDK's encoder.
"""

from __future__ import annotations

import functools
import logging
import os

from opentelemetry.sdk.trace.export import SpanExporter

_log = logging.getLogger(__name__)


def _protocol() -> str:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()


@functools.cache
def _warn_once(message: str) -> None:
    _log.warning(message)


class FlareOTLPSpanExporter(SpanExporter):
    """The `flare_otlp` entry point: building it builds the exporter of the configured
    protocol, a `FlareOTLPGrpcSpanExporter` or a `FlareOTLPHttpSpanExporter`, with the
    same arguments (the SDK's configurator passes none). The entry point must name a
    `SpanExporter` class; this one is never an instance itself, so that the module of
    the transport not used is never imported."""

    def __new__(cls, *args, **kwargs):
        protocol = _protocol()
        if protocol in ("http/protobuf", "http/json"):
            if protocol == "http/json":  # every OTLP/HTTP receiver takes protobuf too
                _warn_once("flare: flare_otlp sends OTLP/HTTP as protobuf, not JSON")
            try:
                from flare.instrumentation.otlp_http import FlareOTLPHttpSpanExporter
            except ImportError as error:
                _warn_once(f"flare: OTLP/HTTP needs opentelemetry-exporter-otlp-proto-http "
                           f"({error}); spans are sent over gRPC")
            else:
                kwargs.pop("insecure", None)  # gRPC's; over HTTP the URL scheme decides
                return FlareOTLPHttpSpanExporter(*args, **kwargs)
        elif protocol != "grpc":
            _warn_once(f"flare: unknown OTLP protocol {protocol!r} (grpc, "
                       "http/protobuf); spans are sent over gRPC")
        from flare.instrumentation.otlp_grpc import FlareOTLPGrpcSpanExporter

        return FlareOTLPGrpcSpanExporter(*args, **kwargs)
