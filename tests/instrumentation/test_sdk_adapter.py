"""An SDK outside the tested versions: one warning, the public API everywhere, the same
step spans. Torch older than the floor: one warning where the instrumentor cannot say it."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from test_instrumentor import finished, make_provider, rank_env, train  # noqa: F401

from flare.instrumentation import finished_span, flush_deadline
from flare.instrumentation.torch_training import TorchTrainingInstrumentor
from flare.wire import sdk_adapter, semconv


@pytest.fixture
def untested_sdk(monkeypatch):
    sdk_adapter.internals_ok.cache_clear()
    sdk_adapter.sdk_span_encoders.cache_clear()
    monkeypatch.setattr(sdk_adapter, "sdk_version", lambda: (1, 99))
    yield
    sdk_adapter.internals_ok.cache_clear()
    sdk_adapter.sdk_span_encoders.cache_clear()


def test_the_tested_range_is_the_compat_checks():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "compat" / "check_versions.py"
    spec = importlib.util.spec_from_file_location("check_versions", path)
    check_versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_versions)
    floor = tuple(int(p) for p in check_versions.FLOORS["opentelemetry-sdk"].split(".")[:2])
    assert sdk_adapter.TESTED[0] == floor
    # The dev set-up takes the newest SDK: a newer one than the gate knows wants
    # `tests/compat/check_versions.py newest` run and sdk_adapter.TESTED raised.
    assert sdk_adapter.TESTED[0] <= sdk_adapter.sdk_version() <= sdk_adapter.TESTED[1]


def test_an_untested_sdk_takes_the_public_path_and_says_so_once(rank_env, untested_sdk, caplog):  # noqa: F811
    provider, exporter = make_provider()
    instrumentor = TorchTrainingInstrumentor()
    with caplog.at_level(logging.WARNING, logger="flare.wire.sdk_adapter"):
        instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
        try:
            assert finished_span.FinishedSpans.for_tracer(
                provider.get_tracer("x")) is None  # no hand-over of built spans
            assert flush_deadline._span_exporters(provider) == []
            train(4)
        finally:
            instrumentor.uninstrument()
    steps = finished(exporter, semconv.SPAN_STEP)
    assert len(steps) >= 3 and all(s.attributes[semconv.RANK] == 0 for s in steps)
    said = [r for r in caplog.records if "outside the versions" in r.getMessage()]
    assert len(said) == 1 and "1.99" in said[0].getMessage()


def test_torch_older_than_the_floor_is_said(monkeypatch, caplog):
    import importlib.metadata

    sdk_adapter.torch_supported.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0.1")
    with caplog.at_level(logging.WARNING, logger="flare.wire.sdk_adapter"):
        assert sdk_adapter.torch_supported() is False
    sdk_adapter.torch_supported.cache_clear()
    assert any("torch 2.0 is older than 2.1" in r.getMessage() for r in caplog.records)


# The SDK's (and its exporters') non-public names Flare uses: sdk_adapter.py is the one
# module that may spell them.
_PRIVATE = re.compile(
    r"""(\.|getattr\([^,]+,\s*["'])(_span_processors|_active_span_processor|_batch_processor"""
    r"""|_schedule_delay|_worker_awaken|_instrumentation_scope|_is_enabled|_on_ending"""
    r"""|_remote_parent_sampled|_sdk_config|_exporter|_resource|_transport"""
    r"""|_max_request_size|_translate_data)\b"""
    r"""|opentelemetry\._opamp|opentelemetry\.exporter\.\S*\._internal|transport\._base""")


# Names of the SDK's OTLP exporters too generic to look for elsewhere (Flare's own classes
# have a `_client` or a `_metrics`): looked for in the modules that use those exporters.
_EXPORTER_PRIVATE = re.compile(r"(\.|getattr\([^,]+,\s*[\"'])(_client|_metrics|_shutdown|_channel|_stub)\b")


def test_no_module_but_the_adapter_spells_an_sdk_private_name():
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted(root.glob("*/src/flare/**/*.py")):
        if path.name == "sdk_adapter.py":
            continue
        text = path.read_text()
        extends_exporter = "opentelemetry.exporter.otlp.proto" in text
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            private = _PRIVATE.search(code) or (extends_exporter and _EXPORTER_PRIVATE.search(code))
            if private and not code.lstrip().startswith("def "):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_an_untested_sdk_keeps_its_otlp_exporters_as_they_are(untested_sdk):
    """Outside the tested SDK versions the exporters' private parts are left alone: no
    request hook routed, no stub replaced, no export mirrored (the SDK's own paths)."""

    class Exporter:
        _client = object()
        _channel = object()
        _stub = None
        _max_request_size = 0
        _metrics = type("Metrics", (), {"export_operation": None})()

        def _translate_data(self, data):
            return "sdk"

        def flare(self, data):
            return "flare"

    sdk_adapter.route_grpc_encoding(Exporter, "flare")
    exporter = Exporter()
    assert exporter._translate_data([]) == "sdk"
    assert sdk_adapter.http_export_parts(exporter) is None
    assert sdk_adapter.send_grpc_bytes(exporter, lambda channel: "stub") is False
    assert exporter._stub is None


def test_the_public_span_encoders_write_what_the_internal_ones_write():
    """The fallback of an untested SDK (`public_span_encoders`, over `encode_spans`)
    against the SDK's internal encoders, on the writer's probe spans."""
    from flare.instrumentation import otlp_encoding

    internal = sdk_adapter.sdk_span_encoders()
    assert internal[2].__name__ == "_encode_span"  # (this SDK is a tested one)
    public = sdk_adapter.public_span_encoders()
    for span in otlp_encoding.probe_spans():
        for encode_private, encode_public, value in zip(
                internal, public, (span.resource, span.instrumentation_scope, span), strict=True):
            assert encode_public(value).SerializeToString() == encode_private(value).SerializeToString()


def test_an_untested_sdk_encodes_requests_through_the_public_encoders(untested_sdk):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from flare.instrumentation import otlp_encoding

    assert sdk_adapter.sdk_span_encoders()[2].__name__ == "encode_span"
    spans = otlp_encoding.probe_spans()
    written = ExportTraceServiceRequest.FromString(otlp_encoding.encode_request(spans, fast=False))
    assert written == encode_spans(spans)
