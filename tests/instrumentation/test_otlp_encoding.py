"""Flare's direct OTLP writer (flare.instrumentation.otlp_encoding) and the `flare_otlp`
exporter: every request must parse to exactly what the SDK's `encode_spans` builds."""

from __future__ import annotations

import logging
import math
import random

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode
from otlp_sink import OtlpSink
from test_instrumentor import rank_env, train  # noqa: F401  (fixture)

from flare.instrumentation import otlp_encoding, otlp_exporter
from flare.instrumentation.torch_training import TorchTrainingInstrumentor
from flare.wire import otlp_values


@pytest.fixture(autouse=True, params=["c", "python"])
def writer(request, monkeypatch):
    """Every test runs with the C attribute writer (when built) and the Python one."""
    if request.param == "python":
        monkeypatch.setattr(otlp_encoding, "write_attributes", otlp_values.py_attributes)
    elif otlp_values._otlp_write is None:
        pytest.skip("the C attribute writer is not built (no compiler at install)")
    return request.param


def test_c_and_python_attribute_writers_agree_byte_for_byte(writer):
    if writer == "python" or otlp_values._otlp_write is None:
        pytest.skip("compares the C writer with the Python reference")
    import types

    c, python = otlp_values._otlp_write.attributes, otlp_values.py_attributes
    rng = random.Random(7)
    cases = [{}, {"": 1}, {"k": None}, {"k": []}, {"k": [None, [1, [2.5, "é"]], b"\x00"]},
             {"a": -1, "b": -(1 << 63), "c": (1 << 63) - 1, "d": 0x7F, "e": 0x80},
             {"f": -0.0, "g": math.inf, "h": math.nan, "t": True, "u": False},
             {"s" * 300: "v" * 70_000}]
    cases += [{f"k{i}": _random_value(rng) for i in range(rng.randrange(0, 30))}
              for _ in range(300)]
    def outcome(write, mapping):
        try:
            return write(mapping, 0x4A)
        except (otlp_encoding.Unsupported, UnicodeEncodeError) as error:
            return type(error)

    written = 0
    for case in cases:
        for mapping in (case, types.MappingProxyType(case)):
            result = outcome(c, mapping)
            assert result == outcome(python, mapping), case
            written += isinstance(result, bytes)
    assert written > 200  # most cases are written, the rest refused alike
    class Flag(int):
        pass

    for bad, error in (({"k": 1 << 63}, otlp_encoding.Unsupported),
                       ({"k": -(1 << 63) - 1}, otlp_encoding.Unsupported),
                       ({"k": Flag(1)}, otlp_encoding.Unsupported),
                       ({"k": {"nested": 1}}, otlp_encoding.Unsupported),
                       ({1: "key"}, otlp_encoding.Unsupported),
                       ({"k": "\ud800"}, UnicodeEncodeError),
                       ({"\ud800": 1}, UnicodeEncodeError)):
        for write in (c, python):
            with pytest.raises(error):
                write(bad, 0x4A)


def same_as_sdk(spans) -> None:
    ours = ExportTraceServiceRequest.FromString(otlp_encoding.encode_request(spans))
    theirs = encode_spans(spans)
    assert ours == theirs
    # and the same size on the wire (field order aside, the same bytes)
    assert ours.ByteSize() == theirs.ByteSize()


def test_probe_spans_match_the_sdk():
    same_as_sdk(otlp_encoding.probe_spans())
    assert otlp_encoding.matches_sdk(otlp_encoding.probe_spans())


def test_real_training_spans_match_the_sdk(rank_env):  # noqa: F811
    """Step spans (deferred and detail), their children and an error span with an
    exception event (which the SDK encoder writes) from a real instrumented run."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "enc"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    try:
        train(5)
        tracer = provider.get_tracer("enc.test")
        with pytest.raises(ValueError), tracer.start_as_current_span("failing"):
            raise ValueError("boom")
    finally:
        instrumentor.uninstrument()
    spans = exporter.get_finished_spans()
    names = {s.name for s in spans}
    assert {"train.step", "dataloader.next", "failing"} <= names
    assert any(s.events for s in spans)  # the exception event: the SDK encoder's part
    same_as_sdk(spans)
    for span in spans:
        same_as_sdk([span])


def _random_value(rng: random.Random, depth: int = 0):
    choice = rng.randrange(16 if depth == 0 else 12)
    if 8 <= choice <= 11 and rng.random() < 0.9:
        choice = rng.choice([0, 3, 5])  # what the SDK decides: one value in ~60
    if choice == 0:
        return rng.uniform(-1e9, 1e9)
    if choice == 1:
        return rng.choice([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1e308])
    if choice == 2:
        return rng.randrange(-(1 << 63), 1 << 63)
    if choice == 3:
        return rng.randrange(0, 300)
    if choice == 4:
        return rng.choice([True, False])
    if choice == 5:
        return "".join(rng.choice("aé中\x00 z") for _ in range(rng.randrange(0, 200)))
    if choice == 6:
        return None
    if choice == 7:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 5)))
    if choice == 8:
        return rng.choice([1 << 63, -(1 << 63) - 1, 1 << 70])  # out of int64: SDK's call
    if choice == 9:
        return "\ud800 lone surrogate"  # not UTF-8: SDK's call
    if choice == 10:
        import numpy as np

        return rng.choice([np.float64(1.5), np.int64(3), np.bool_(True)])  # subclasses
    if choice == 11:
        return {"k": 1}  # a mapping: SDK's call
    kind = rng.randrange(5)
    if kind == 4:  # mixed, with None inside
        return tuple(rng.choice([1, "x", None, 2.5]) for _ in range(rng.randrange(0, 4)))
    return tuple(_random_value(rng, 1) if kind == 3 else
                 [rng.uniform(-5, 5), rng.randrange(-9, 9), rng.random() < 0.5][kind]
                 for _ in range(rng.randrange(0, 6)))


def test_random_spans_match_the_sdk():
    rng = random.Random(20261130)
    resources = [Resource({"r": i}) for i in range(3)] + [Resource({"r": 0})]  # equal to [0]
    scopes = [InstrumentationScope("a"), InstrumentationScope("b", "2", "https://s"), None,
              InstrumentationScope("a")]
    spans = []
    for _ in range(600):
        parent = None if rng.random() < 0.2 else SpanContext(
            rng.getrandbits(128) or 1, rng.getrandbits(64) or 1, is_remote=rng.random() < 0.5)
        attributes = {f"key.{rng.randrange(40)}" if rng.random() < 0.9 else "": _random_value(rng)
                      for _ in range(rng.randrange(0, 25))}
        events = ([Event("e", {"a": 1}, timestamp=5)] if rng.random() < 0.05 else [])
        links = ([Link(SpanContext(7, 8, False, TraceFlags(1)), {"l": True})]
                 if rng.random() < 0.05 else [])
        status = rng.choice([Status(StatusCode.UNSET), Status(StatusCode.OK),
                             Status(StatusCode.ERROR), Status(StatusCode.ERROR, "why é")])
        spans.append(ReadableSpan(
            rng.choice(["train.step", "", "x" * 200]),
            context=SpanContext(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1, False,
                                TraceFlags(rng.choice([0, 1]))),
            parent=parent, resource=rng.choice(resources), attributes=attributes,
            events=events, links=links, kind=rng.choice(list(SpanKind)),
            start_time=rng.choice([None, 0, rng.getrandbits(63)]),
            end_time=rng.choice([None, rng.getrandbits(64)]),
            instrumentation_scope=rng.choice(scopes), status=status))
    same_as_sdk(spans)
    written = 0
    for span in spans:  # most spans are the writer's own; the rest the SDK's
        try:
            otlp_encoding.encode_span(span)
            written += 1
        except (otlp_encoding.Unsupported, UnicodeEncodeError):
            pass
    assert 150 < written < 550
    for start in range(0, 600, 37):
        same_as_sdk(spans[start:start + 37])
    assert otlp_encoding.encode_request([]) == encode_spans([]).SerializeToString()


def test_the_exporter_sends_what_the_sdk_would_over_grpc(monkeypatch):
    spans = otlp_encoding.probe_spans()
    with OtlpSink() as sink:
        exporter = otlp_exporter.FlareOTLPSpanExporter(endpoint=sink.endpoint, insecure=True)
        try:
            assert exporter._fast and exporter._sends_bytes
            assert exporter.export(spans).name == "SUCCESS"
            exporter._initialize_channel_and_stub()  # the SDK's reconnection
            assert exporter.export(spans).name == "SUCCESS"
        finally:
            exporter.shutdown()
        received = [request for _, request, _ in sink.trace_requests]
    assert received == [encode_spans(spans)] * 2


def test_the_exporter_uses_the_sdk_encoder_when_the_check_fails(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=otlp_encoding.__name__)
    otlp_encoding.writer_matches_sdk.cache_clear()
    monkeypatch.setattr(otlp_encoding, "matches_sdk", lambda spans: False)
    try:
        exporter = otlp_exporter.FlareOTLPSpanExporter(endpoint="http://127.0.0.1:9",
                                                       insecure=True)
        assert not exporter._fast
        monkeypatch.setattr(otlp_encoding, "encode_request",
                            lambda spans: pytest.fail("the writer must not run"))
        spans = otlp_encoding.probe_spans()
        assert exporter._translate_data(spans) == encode_spans(spans)
        exporter.shutdown()
    finally:
        otlp_encoding.writer_matches_sdk.cache_clear()
    assert "encodes spans differently" in caplog.text


def _finished_pair(rng: random.Random, resource, scope):
    """One span as FinishedSpans builds it: a ReadableSpan, and the same values
    written at once (otlp_encoding.EncodedSpan); None for the second when the writer
    leaves the span to the SDK."""
    from opentelemetry.trace import TraceState

    trace_id = rng.getrandbits(128) or 1
    state = TraceState([("k", "v"), ("flare", "1")]) if rng.random() < 0.1 else TraceState()
    context = SpanContext(trace_id, rng.getrandbits(64) or 1, False, TraceFlags(1), state)
    parent = SpanContext(trace_id, rng.getrandbits(64) or 1, is_remote=rng.random() < 0.5,
                         trace_flags=TraceFlags(1))
    name = rng.choice(["train.step", "dataloader.next", "", "é" * 3])
    attributes = {f"key.{rng.randrange(40)}": _random_value(rng)
                  for _ in range(rng.randrange(0, 25))}
    start, end = rng.choice([0, rng.getrandbits(63)]), rng.choice([0, rng.getrandbits(64)])
    readable = ReadableSpan(name, context=context, parent=parent, resource=resource,
                            attributes=attributes, kind=SpanKind.INTERNAL, start_time=start,
                            end_time=end, instrumentation_scope=scope)
    try:
        otlp = otlp_encoding.encode_finished(name, context, parent, attributes, start, end)
    except (otlp_encoding.Unsupported, UnicodeEncodeError, OverflowError):
        return readable, None
    return readable, otlp_encoding.EncodedSpan(name, context, parent, resource, scope,
                                               attributes, start, end, otlp)


def test_spans_written_at_once_are_the_bytes_of_the_sdk_span():
    """encode_finished writes, byte for byte, what encode_span writes for the
    ReadableSpan FinishedSpans would have built; a request mixing such spans with
    ordinary ones parses to the SDK's request for the ordinary spans alone."""
    rng = random.Random(20261201)
    resources = [Resource({"r": i}) for i in range(2)]
    scopes = [InstrumentationScope("flare"), None]
    readables, mixed, written = [], [], 0
    for i in range(500):
        readable, encoded = _finished_pair(rng, resources[i % 2], scopes[i // 3 % 2])
        readables.append(readable)
        if encoded is None:
            mixed.append(readable)
            continue
        written += 1
        assert encoded.otlp == otlp_encoding.encode_span(readable)
        mixed.append(encoded if i % 4 else readable)
    assert written > 300
    for start in range(0, 500, 45):
        expected = encode_spans(readables[start:start + 45])
        assert ExportTraceServiceRequest.FromString(
            otlp_encoding.encode_request(mixed[start:start + 45])) == expected
