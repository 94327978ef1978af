"""The C span picker (flare.processors._otlp_read's select_spans) returns exactly what the Python
reference returns; the correlator's wire writing gives what protobuf gives."""

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
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.instrumentation import otlp_encoding
from flare.processors import correlation_output, rank_correlation, span_select
from flare.wire import semconv as sc

SOURCE = Path(__file__).resolve().parents[2] / "processors/csrc/otlp_read"
SELECTION = rank_correlation._SELECTION


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """The installed C module, or one compiled here from the same source."""
    if span_select._otlp_read is not None:
        return span_select._otlp_read
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
        return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=val(x)) for k, x in v.items()]))
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[val(x) for x in v]))
    return AnyValue(string_value=str(v))


def kvs(attrs: dict[str, object]) -> list[KeyValue]:
    return [KeyValue(key=k, value=val(v)) for k, v in attrs.items()]


def request() -> ExportTraceServiceRequest:
    rng = random.Random(5)
    spans = []
    for name in (sc.SPAN_STEP, "collective.all_reduce", sc.SPAN_HANG, sc.SPAN_HEARTBEAT,
                 sc.SPAN_COLLECTIVE_RANKS, sc.SPAN_DATALOADER, "kernel", "collective.", "collectiv"):
        spans.append(Span(
            name=name, trace_id=rng.randbytes(16), span_id=rng.randbytes(8),
            start_time_unix_nano=rng.getrandbits(63), end_time_unix_nano=rng.getrandbits(63),
            attributes=kvs({
                sc.STEP: rng.randrange(100), sc.STEP_COLLECTIVE_WAIT_MS: math.inf,  # (NaN never compares equal)
                sc.STEP_PG_NAMES: ["0", "tp1"], sc.STEP_PG_WAIT_MS: [1.5, -0.0],
                sc.STEP_PG_LAST_SEQ: [3, -1], "unwanted": "x" * 50, sc.COLL_PG: {"nested": [1]},
                sc.COLL_SEQ: b"\x00\x01", sc.RANK: None, sc.HANG_OPERATION: "παράδειγμα",
            }),
        ))
    spans.append(Span(name=sc.SPAN_STEP))  # no ids, no attributes
    dup = Span(name=sc.SPAN_STEP, attributes=kvs({sc.STEP: 1}) + kvs({sc.STEP: 2}))  # last wins
    return ExportTraceServiceRequest(resource_spans=[
        ResourceSpans(resource={"attributes": kvs({sc.SERVICE_NAME: "s", sc.JOB_ID: "j", sc.RANK: 3,
                                                   sc.WORLD_SIZE: 8, "host.name": "h"})},
                      scope_spans=[ScopeSpans(spans=spans),
                                   ScopeSpans(scope={"name": correlation_output.SCOPE_NAME}, spans=spans),
                                   ScopeSpans(spans=[dup])]),
        ResourceSpans(scope_spans=[ScopeSpans(spans=spans[:2])]),
        ResourceSpans(),
    ])


def test_c_and_python_select_the_same(fast, monkeypatch):
    monkeypatch.setattr(span_select, "_otlp_read", fast)
    req = request()
    c_out = SELECTION.select(req)
    py_out = SELECTION.select_python(req)
    assert c_out == py_out
    names = [record[0] for record in c_out[0][1]]
    assert names == [sc.SPAN_STEP, "collective.all_reduce", sc.SPAN_HANG, sc.SPAN_HEARTBEAT,
                     "collective.", sc.SPAN_STEP, sc.SPAN_STEP]
    assert c_out[0][0] == {sc.SERVICE_NAME: "s", sc.JOB_ID: "j", sc.RANK: 3, sc.WORLD_SIZE: 8}
    assert c_out[0][1][-1][5] == {sc.STEP: 2}
    assert c_out[2] == ({}, [])


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_malformed_bytes_raise_value_error(fast, monkeypatch, cut):
    monkeypatch.setattr(span_select, "_otlp_read", fast)
    payload = request().SerializeToString()
    with pytest.raises(ValueError):
        SELECTION.select_payload(payload[:-cut])


def test_random_corruption_never_crashes(fast, monkeypatch):
    monkeypatch.setattr(span_select, "_otlp_read", fast)
    rng = random.Random(9)
    good = bytearray(request().SerializeToString())
    for _ in range(300):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            SELECTION.select_payload(bytes(bad))
        except ValueError:
            pass


class RefusingScanner:
    @staticmethod
    def select_spans(*args):
        raise ValueError("malformed OTLP span")


def test_a_refusing_c_scanner_never_loses_the_request(monkeypatch):
    from flare.processors.rank_correlation import RankCorrelation

    monkeypatch.setattr(span_select, "_otlp_read", RefusingScanner)
    before = SELECTION.fallbacks
    proc = RankCorrelation()
    proc.process_traces(request())
    assert proc.metrics()["step_spans"] == 4  # 2 + the no-attribute one + the duplicate-key one
    assert proc.metrics()["picker_fallbacks"] == before + 1


def test_rank_links_give_the_message_the_protobuf_calls_give(fast, monkeypatch):
    from flare.processors.correlation_windows import RankArrival, RankStep

    rng = random.Random(9)
    ranks = {r: RankStep(rng.randbytes(8), rng.randbytes(16), 1, 2, 0.5) for r in rng.sample(range(5000), 300)}
    ranks[0] = RankStep(b"", b"", 0, 0, None)  # empty ids are left out, rank 0 is still set
    ranks[-3] = RankArrival(b"\x01" * 8, b"\x02" * 16, 0, 0)
    ranks[2**62] = RankArrival(b"\x03" * 8, b"\x04" * 16, 0, 0)
    monkeypatch.setattr(correlation_output, "_otlp_read", fast)
    merged = Span(name="x")
    correlation_output._add_rank_links(merged, ranks)
    monkeypatch.setattr(correlation_output, "_otlp_read", None)
    called = Span(name="x")
    correlation_output._add_rank_links(called, ranks)
    assert merged.SerializeToString() == called.SerializeToString()
    assert [link.attributes[0].value.int_value for link in merged.links] == sorted(ranks)
    # An id that is not bytes is refused by both, as protobuf refuses it.
    odd = {1: RankArrival(bytearray(b"\x05" * 8), b"\x06" * 16, 0, 0)}
    with pytest.raises(TypeError):
        fast.rank_links(odd, sc.RANK)
    with pytest.raises(TypeError):
        correlation_output._add_rank_links(Span(name="y"), odd)


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 7)
    if kind == 0:
        return rng.random() < 0.5
    if kind == 1:
        return rng.choice([0, -1, 1, 2**63 - 1, -(2**63), rng.randrange(-(2**40), 2**40)])
    if kind == 2:
        return rng.choice([0.0, -0.0, 1.5, rng.random() * 1e6, math.inf, math.nan, 1e-300])
    if kind == 3:
        return rng.choice(["", "a", "ü€", f"s{rng.randrange(1000):x}"])
    if kind == 4:
        return 3 + 4j if rng.random() < 0.2 else "x"  # a kind only protobuf's path writes (str())
    if kind == 5:
        return None  # dropped at the top level, an empty AnyValue inside an array
    if kind == 6:
        return b"xy"
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return tuple(_random_value(rng, depth + 1) for _ in range(rng.randrange(3)))


def test_the_correlators_attribute_bytes_give_the_message_key_values_gives(fast, monkeypatch):
    """The correlator writes its spans' attributes with Flare's one attribute writer
    (otlp_encoding.write_attributes): the message key_values gives, or None, and then
    the correlator takes protobuf's path, where the writer leaves a value to protobuf."""
    from flare.processors.otlp_values import key_values

    monkeypatch.setattr(correlation_output, "_otlp_read", fast)
    rng = random.Random(5)
    written = refused = 0
    for _ in range(3000):
        attrs = {rng.choice(["", "k", "flare.x"]) + str(i): _random_value(rng) for i in range(rng.randrange(7))}
        wire = correlation_output._wire(attrs)
        if wire is None:
            refused += 1
            continue
        merged = Span()
        merged.MergeFromString(wire)
        assert merged.SerializeToString() == Span(attributes=key_values(attrs)).SerializeToString(), attrs
        written += 1
    assert written > 2000 and refused > 50
    # What protobuf refuses, the writer refuses (the correlator then takes protobuf's path).
    for bad in ({"x": 2**64}, {"x": "\ud800"}, {"\ud800": 1}, {1: 2}):
        assert correlation_output._wire(bad) is None
        with pytest.raises((OverflowError, ValueError, TypeError)):
            Span(attributes=key_values(bad)).SerializeToString()
    assert correlation_output._wire({"x": 1, "n": None}) == otlp_encoding.write_attributes({"x": 1}, 0x4A)


# ------------------------------------------------------------------ compact step records
def _random_step_value(rng: random.Random, kind: str) -> object:
    """A value for a step key: usually of the type Flare sends, often not."""
    roll = rng.random()
    if kind == "array":
        if roll < 0.1:
            return rng.choice([None, "0", 3, 1.5, {"a": 1}, b"x", True])
        n = rng.choice([0, 1, 2, 3, 3, 3, 4, 64, 65])
        item = rng.choice(["str", "float", "int", "mixed"])
        pool = {"str": lambda: rng.choice(["0", "tp", "dp1", "é"]), "float": lambda: rng.choice([0.5, -0.0, math.inf, 3.25]),
                "int": lambda: rng.choice([0, -1, 7, 2**62])}
        if item == "mixed":
            return [rng.choice([None, "a", 1, 2.5, True, [1]]) for _ in range(n)]
        return [pool[item]() for _ in range(n)]
    if roll < 0.7:
        return {"int": rng.choice([0, 5, -3, 2**63 - 1]), "float": rng.choice([0.0, 12.5, -math.inf])}[kind]
    return rng.choice([None, "5", 5.0, 5, True, [1], {"k": 2}, b"\x01"])


def _step_span(rng: random.Random) -> Span:
    keys = [(sc.RANK, "int"), (sc.STEP, "int"), (sc.STEP_COLLECTIVE_WAIT_MS, "float"),
            (sc.STEP_PG_NAMES, "array"), (sc.STEP_PG_WAIT_MS, "array"), (sc.STEP_PG_LAST_SEQ, "array")]
    attrs: list[KeyValue] = []
    n_pgs = rng.choice([0, 2, 3])
    for key, kind in keys:
        if rng.random() < 0.15:
            continue  # absent
        if kind == "array" and rng.random() < 0.6:  # consistent arrays, as Flare sends them
            value = {sc.STEP_PG_NAMES: [f"pg{i}" for i in range(n_pgs)],
                     sc.STEP_PG_WAIT_MS: [float(i) / 3 for i in range(n_pgs)],
                     sc.STEP_PG_LAST_SEQ: [i * 11 for i in range(n_pgs)]}[key]
        else:
            value = _random_step_value(rng, kind)
        attrs.extend(kvs({key: value}))
        if rng.random() < 0.05:
            attrs.extend(kvs({key: _random_step_value(rng, kind)}))  # a repeated key: the last counts
    if rng.random() < 0.05:
        attrs.append(KeyValue(key=sc.STEP))  # a key without a value
    if rng.random() < 0.05:
        attrs.extend(kvs({sc.COLL_OP: "all_reduce"}))  # another wanted key
    if rng.random() < 0.5:
        attrs.extend(kvs({"flare.step.compute_ms": 1.5, "unwanted": [1, 2]}))
    rng.shuffle(attrs)
    return Span(name=sc.SPAN_STEP, trace_id=rng.randbytes(16), span_id=rng.randbytes(8),
                start_time_unix_nano=rng.getrandbits(63), end_time_unix_nano=rng.getrandbits(63),
                attributes=attrs)


def _compacted(selected: list) -> list:
    return [(resource, [span_select.compact_step(r, SELECTION.step, SELECTION._span_keys)
                        if r[0] == sc.SPAN_STEP else r for r in records])
            for resource, records in selected]


def test_compact_step_records_match_the_reference(fast, monkeypatch):
    monkeypatch.setattr(span_select, "_otlp_read", fast)
    rng = random.Random(11)
    kinds = {"compact": 0, "dict": 0}
    for _ in range(300):
        spans = [_step_span(rng) for _ in range(rng.randint(1, 6))]
        spans.insert(rng.randrange(len(spans) + 1), Span(name=sc.SPAN_HEARTBEAT, attributes=kvs({sc.RANK: 1})))
        req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource={"attributes": kvs({sc.JOB_ID: "j", sc.RANK: 2})}, scope_spans=[ScopeSpans(spans=spans)])])
        payload = req.SerializeToString()
        compact = SELECTION.select_payload(payload, compact=True)
        assert compact == _compacted(SELECTION.select_python(req))
        assert SELECTION.select_payload(payload) == SELECTION.select_python(req)  # unchanged without it
        for record in compact[0][1]:
            if record[0] == sc.SPAN_STEP:
                kinds["compact" if len(record) == 11 else "dict"] += 1
    assert kinds["compact"] >= 100 and kinds["dict"] >= 100  # both forms were exercised


def test_compact_step_records_on_damaged_bytes(fast, monkeypatch):
    """Damaged requests: the compact pick refuses exactly what the dict pick refuses,
    and otherwise gives the dict pick's records, compacted."""
    monkeypatch.setattr(span_select, "_otlp_read", fast)
    rng = random.Random(12)
    good = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": kvs({sc.JOB_ID: "j"})},
        scope_spans=[ScopeSpans(spans=[_step_span(rng) for _ in range(8)])])]).SerializeToString()
    for _ in range(2000):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            plain = SELECTION.select_payload(bytes(bad))
        except ValueError:
            with pytest.raises(ValueError):
                SELECTION.select_payload(bytes(bad), compact=True)
            continue
        # (repr: damage can make a NaN, which never compares equal)
        assert repr(SELECTION.select_payload(bytes(bad), compact=True)) == repr(_compacted(plain))


def test_step_keys_must_be_picked():
    with pytest.raises(ValueError):
        span_select.Selection(names=("a",), prefix="x.", excluded=(), skip_scope="s",
                              span_keys=("k",), resource_keys=(), step=("a", "k", "k", "k", "k", "k", "z"))
