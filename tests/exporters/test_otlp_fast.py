"""The C decoder (flare.processors._otlp_read's SpanBuilder) gives exactly what the Python reference gives."""

from __future__ import annotations

import importlib.util
import math
import random
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from flare.exporters import otlp_columns
from flare.exporters.otlp_columns import SpanColumns
from flare.wire import semconv as sc

SOURCE = Path(__file__).resolve().parents[2] / "processors/csrc/otlp_read"


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """The installed C module, or one compiled here from the same source."""
    if otlp_columns._otlp_read is not None:
        return otlp_columns._otlp_read
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler: the Python reference is what runs here")
    out = tmp_path_factory.mktemp("fast") / ("_otlp_read" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    f"-I{SOURCE}", *map(str, sorted(SOURCE.glob("*.c"))), "-o", str(out)], check=True)
    spec = importlib.util.spec_from_file_location("_otlp_read", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def val(v: object) -> AnyValue:
    if v is None:
        return AnyValue()
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, dict):
        return AnyValue(kvlist_value=KeyValueList(values=kvs(v)))
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[val(x) for x in v]))
    return AnyValue(string_value=str(v))


def kvs(attrs: dict[str, object]) -> list[KeyValue]:
    return [KeyValue(key=k, value=val(v)) for k, v in attrs.items()]


HOSTILE_VALUES = {
    "quote\"back\\slash": "tab\there\nnew\rline\x01\x1f\b\f",
    "unicode": "παράδειγμα ✓ \u2028 😀",
    "doubles": [0.1, 1e16, -0.0, 1e-7, 123456789.123, 2.5e-320, 1.7976931348623157e308, 3.0],
    "nonfinite": [math.nan, math.inf, -math.inf],
    "ints": [0, -1, 2**63 - 1, -(2**63)],
    "bools": [True, False],
    "bytes": [b"", b"\x00", b"\x00\xff", b"abc", b"abcd"],
    "nested": {"a": {"b": [1, {"c": None}]}, "empty": {}, "list": []},
    "none": None,
    "": "empty key",
}


def hostile_request() -> ExportTraceServiceRequest:
    spans = [
        Span(trace_id=b"\xab" * 16, span_id=b"\x01" * 8, parent_span_id=b"\x02" * 8,
             name="hostile \"name\" ✓", kind=Span.SPAN_KIND_CLIENT,
             start_time_unix_nano=2**63 - 10, end_time_unix_nano=2**63 - 1,
             attributes=kvs({**HOSTILE_VALUES, sc.STEP: "12", sc.RANK: "5"}),
             status=Status(code=Status.STATUS_CODE_ERROR, message="bad ✗"),
             events=[Span.Event(name="e1", time_unix_nano=5, attributes=kvs({"x": 1.5})),
                     Span.Event(name="e2")],
             links=[Span.Link(trace_id=b"\x03" * 16, span_id=b"\x04" * 8, attributes=kvs({"k": "v"})),
                    Span.Link()]),
        Span(name="", attributes=[]),  # all defaults, no ids, no status
        Span(name="float step", attributes=kvs({sc.STEP: 7.9, sc.RANK: True})),
        Span(name="bad step", attributes=kvs({sc.STEP: "abc", sc.RANK: None})),
        Span(name="negative step", attributes=kvs({sc.STEP: " -3 ", sc.RANK: math.inf})),
        Span(name="key without value", attributes=[KeyValue(key=sc.STEP)]),
    ]
    return ExportTraceServiceRequest(resource_spans=[
        ResourceSpans(resource={"attributes": kvs({sc.SERVICE_NAME: "svc", sc.RANK: 2,
                                                   sc.HOST_NAME: 17, "r.bytes": b"\x01"})},
                      scope_spans=[ScopeSpans(spans=spans[:3]), ScopeSpans(spans=spans[3:])]),
        ResourceSpans(resource={"attributes": kvs({sc.JOB_ID: "j", sc.RANK: "3", sc.PROCESS_PID: 9})},
                      scope_spans=[ScopeSpans(spans=[Span(name="r3", attributes=kvs({"a": 1}))])]),
        ResourceSpans(scope_spans=[ScopeSpans(spans=[Span(name="no resource")])]),
    ])


def realistic_request(seed: int) -> ExportTraceServiceRequest:
    rng = random.Random(seed)
    spans = []
    for i in range(50):
        attrs = {
            sc.STEP: i, sc.STEP_COLLECTIVE_WAIT_MS: round(rng.uniform(0, 300), 3),
            sc.STEP_PG_NAMES: ["0", "1"], sc.STEP_PG_WAIT_MS: [rng.random(), rng.random()],
            sc.STEP_PG_LAST_SEQ: [i * 4, i * 2], sc.STEP_DETAIL: i % 10 == 0,
            sc.COLL_BYTES: rng.getrandbits(40),
        }
        spans.append(Span(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), name=sc.SPAN_STEP,
                          start_time_unix_nano=rng.getrandbits(62), end_time_unix_nano=rng.getrandbits(62),
                          attributes=kvs(attrs)))
    resource = {sc.SERVICE_NAME: "train", sc.JOB_ID: "job", sc.RANK: seed, sc.WORLD_SIZE: 8,
                sc.HOST_NAME: "node0", sc.PROCESS_PID: 100 + seed}
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": kvs(resource)}, scope_spans=[ScopeSpans(spans=spans)])])


def both(fast, monkeypatch, payloads: list[bytes]) -> tuple[list[dict], list[dict]]:
    monkeypatch.setattr(otlp_columns, "_otlp_read", fast)
    c_columns = SpanColumns()
    for payload in payloads:
        c_columns.add_payload(payload)
    py_columns = SpanColumns()
    for payload in payloads:
        py_columns.add_request_python(ExportTraceServiceRequest.FromString(payload))
    return c_columns.table().to_pylist(), py_columns.table().to_pylist()


def test_realistic_spans_identical(fast, monkeypatch):
    payloads = [realistic_request(seed).SerializeToString() for seed in range(8)]
    c_rows, py_rows = both(fast, monkeypatch, payloads)
    assert len(c_rows) == 400
    assert c_rows == py_rows


def test_hostile_values_identical(fast, monkeypatch):
    c_rows, py_rows = both(fast, monkeypatch, [hostile_request().SerializeToString()])
    for c_row, py_row in zip(c_rows, py_rows, strict=True):
        assert c_row == py_row
    first = c_rows[0]
    assert first["step"] == 12 and first["rank"] == 5 and first["host"] == "17"
    assert [r["step"] for r in c_rows[2:6]] == [7, None, -3, None]
    assert [r["rank"] for r in c_rows[2:6]] == [1, 2, None, 2]


def test_resource_after_spans_on_the_wire(fast, monkeypatch):
    """Field order is not guaranteed by protobuf: a resource written last still applies."""
    rs = ResourceSpans(resource={"attributes": kvs({sc.SERVICE_NAME: "late", sc.RANK: 4})},
                       scope_spans=[ScopeSpans(spans=[Span(name="s", span_id=b"\x01" * 8)])])
    resource_field = ResourceSpans(resource=rs.resource).SerializeToString()
    spans_field = ResourceSpans(scope_spans=rs.scope_spans).SerializeToString()
    inner = spans_field + resource_field
    payload = b"\x0a" + _varint(len(inner)) + inner
    assert ExportTraceServiceRequest.FromString(payload).resource_spans[0].resource.attributes
    c_rows, py_rows = both(fast, monkeypatch, [payload])
    assert c_rows == py_rows and c_rows[0]["rank"] == 4 and c_rows[0]["job"] == "late"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize("cut", [1, 5, 17, 100])
def test_malformed_input_raises_and_appends_nothing(fast, monkeypatch, cut):
    monkeypatch.setattr(otlp_columns, "_otlp_read", fast)
    good = realistic_request(1).SerializeToString()
    columns = SpanColumns()
    columns.add_payload(good)
    before = columns.table().to_pylist()
    with pytest.raises(ValueError):
        columns.add_payload(good[:-cut])
    assert columns.table().to_pylist() == before
    with pytest.raises(ValueError):
        columns.add_payload(b"\x0f\xff\xff\xff garbage")


def test_random_garbage_never_crashes(fast, monkeypatch):
    monkeypatch.setattr(otlp_columns, "_otlp_read", fast)
    rng = random.Random(3)
    good = bytearray(hostile_request().SerializeToString())
    for _ in range(300):
        mutated = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        columns = SpanColumns()
        try:
            columns.add_payload(bytes(mutated))
        except ValueError:
            assert len(columns) == 0
            continue
        columns.table()  # whatever decoded must still build a valid table


class RefusingDecoder:
    class SpanBuilder:
        def __len__(self) -> int:
            return 0

        def nbytes(self) -> int:
            return 0

        def decode(self, payload):
            raise ValueError("malformed OTLP ExportTraceServiceRequest")


def test_a_refusing_c_decoder_never_loses_the_request(monkeypatch):
    monkeypatch.setattr(otlp_columns, "_otlp_read", RefusingDecoder)
    before = SpanColumns.decoder_fallbacks
    columns = SpanColumns()
    assert columns.add_request(realistic_request(2)) == 50
    assert SpanColumns.decoder_fallbacks == before + 1
    with pytest.raises(ValueError):  # raw bytes have no reference to fall back on
        columns.add_payload(b"\x0a\x05abc")


def out_of_range_request() -> ExportTraceServiceRequest:
    """Values a broken sender can put on the wire that the store's columns cannot hold."""
    spans = [
        Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="kind 200", kind=200,
             status=Status(code=300), start_time_unix_nano=2**64 - 1, end_time_unix_nano=5,
             attributes=kvs({sc.RANK: 2**40, sc.STEP: 2**62})),
        Span(name="fine", kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=2**63,
             end_time_unix_nano=2**63 + 7, attributes=kvs({sc.RANK: -(2**31)})),
    ]
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": kvs({sc.SERVICE_NAME: "s", sc.RANK: 2**33, sc.PROCESS_PID: 2**40})},
        scope_spans=[ScopeSpans(spans=spans)])])


def test_values_out_of_column_range_are_null_or_wrap_alike(fast, monkeypatch):
    c_rows, py_rows = both(fast, monkeypatch, [out_of_range_request().SerializeToString()])
    assert c_rows == py_rows
    first, second = c_rows
    assert (first["kind"], first["status_code"], first["rank"], first["pid"]) == (None, None, None, None)
    assert first["step"] == 2**62
    assert first["start_ns"] == -1 and first["end_ns"] == 5 and first["duration_ns"] == 6
    assert second["start_ns"] == -(2**63) and second["duration_ns"] == 7
    assert second["kind"] == 2 and second["rank"] == -(2**31)


def test_runs_of_c_and_reference_decoding_keep_arrival_order(fast, monkeypatch):
    monkeypatch.setattr(otlp_columns, "_otlp_read", fast)
    requests = [realistic_request(seed) for seed in range(5)] + [hostile_request()]
    mixed = SpanColumns()
    reference = SpanColumns()
    for i, request in enumerate(requests):
        if i % 3 == 1:
            mixed.add_request_python(request)
        else:
            mixed.add_payload(request.SerializeToString())
        reference.add_request_python(request)
        assert len(mixed) == len(reference)
    first = mixed.table()
    assert first.to_pylist() == reference.table().to_pylist()
    assert mixed.table().to_pylist() == first.to_pylist()  # table() does not consume
    mixed.add_payload(requests[0].SerializeToString())
    reference.add_request_python(requests[0])
    assert mixed.table().to_pylist() == reference.table().to_pylist()


def test_a_full_builder_starts_a_new_chunk(fast, monkeypatch):
    monkeypatch.setattr(otlp_columns, "_otlp_read", fast)
    monkeypatch.setattr(otlp_columns, "_SEAL_BYTES", 1000)
    payloads = [realistic_request(seed).SerializeToString() for seed in range(4)]
    chunked = SpanColumns()
    for payload in payloads:
        chunked.add_payload(payload)
    table = chunked.table()
    assert table.column("attributes").num_chunks == 4
    c_rows, py_rows = both(fast, monkeypatch, payloads)
    assert table.to_pylist() == c_rows == py_rows


def test_doubles_are_written_as_python_repr(fast):
    """The decoder's short path for doubles (a few decimals) must give repr's digits."""
    import json
    import struct

    encode = json.JSONEncoder(allow_nan=False).encode
    rng = random.Random(11)
    values = [0.0, -0.0, 1e-4, 9.999e-5, 1e15, 1e15 - 1, 999999999999999.9, 0.1, 0.3, 1 / 3,
              -7.125, 1e-7, 123456.7891234, 5e-324, 1.7976931348623157e308, 2.0**53, 1e16]
    for _ in range(50_000):
        values.append(round(rng.uniform(-1e6, 1e6), rng.randrange(0, 9)))
        values.append(struct.unpack("<d", rng.randbytes(8))[0])
        values.append(rng.randrange(1, 10 ** rng.randrange(1, 16)) / 10 ** rng.randrange(0, 9))
        values.append(round(rng.random() * 10 ** rng.randrange(-5, 16), rng.randrange(0, 12)))
    for value in values:
        if math.isfinite(value):
            assert fast.double_json(value) == encode(value), value


def test_recycled_column_buffers_hold_only_the_new_batch(fast, monkeypatch):
    """Column buffers Arrow lets go of are reused by the next batches (a pool in C):
    each batch's table still holds exactly its own rows, whatever the previous batch
    left in the memory, and a table still alive keeps its own buffers."""
    monkeypatch.setattr(otlp_columns, "_otlp_read", fast)
    batches = [[realistic_request(seed).SerializeToString() for seed in range(start, start + 40)]
               for start in (0, 40, 80, 120)]
    kept = None
    for index, payloads in enumerate(batches):
        columns = SpanColumns()
        for payload in payloads:  # 2,000 spans: buffers well past the pool's 64 KiB floor
            columns.add_payload(payload)
        table = columns.table()
        reference = SpanColumns()
        for payload in payloads:
            reference.add_request_python(ExportTraceServiceRequest.FromString(payload))
        assert table.to_pylist() == reference.table().to_pylist()
        if index == 1:
            kept, kept_rows = table, table.to_pylist()
        del table, columns  # its buffers go back to the pool for the next batch
    assert kept.to_pylist() == kept_rows
