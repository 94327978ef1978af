"""Seeded mutations of valid OTLP trace requests, and the "acknowledged ⇒ stored" oracle.

Used by the CI run (`tests/fuzz/test_fuzz_otlp.py`, a few thousand mutations) and the
long run (`benchmarks/fuzz_otlp.py`). Everything is driven by one `random.Random(seed)`,
so a failing case is reproduced by its seed and index.

The mutator reads the wire format without a schema: a length-delimited field whose
bytes read as fields is treated as a message (a guess, right for every OTLP message),
so mutations reach any depth. They are the ways real senders and attackers differ from
the plain case: unknown fields of every wire type (groups included), known fields sent
with another wire type, duplicated and dropped fields, AnyValue nested past the C
readers' old limit, many events and links, out-of-range numbers, invalid UTF-8, and
plain byte damage (flips, truncation, insertion).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

# ---------------------------------------------------------------- wire helpers


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


@dataclass
class Field:
    number: int
    wire_type: int
    value: object  # int (0, 1, 5), bytes, or list[Field] for a message guessed in a 2


def parse(data: bytes, depth: int = 0) -> list[Field]:
    """Fields of `data`; ValueError when the bytes are not a message."""
    fields: list[Field] = []
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError("field 0")
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
        elif wire_type == 1:
            if pos + 8 > len(data):
                raise ValueError("short fixed64")
            value, pos = int.from_bytes(data[pos:pos + 8], "little"), pos + 8
        elif wire_type == 5:
            if pos + 4 > len(data):
                raise ValueError("short fixed32")
            value, pos = int.from_bytes(data[pos:pos + 4], "little"), pos + 4
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            if pos + length > len(data):
                raise ValueError("short bytes")
            raw = data[pos:pos + length]
            pos += length
            value = raw
            if raw and depth < 40:
                try:
                    value = parse(raw, depth + 1)
                except ValueError:
                    value = raw
        else:
            raise ValueError("groups are not guessed")
        fields.append(Field(number, wire_type, value))
    return fields


def encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for f in fields:
        if f.wire_type == 3:  # a group: value is its fields
            out += tag(f.number, 3) + encode(f.value) + tag(f.number, 4)
            continue
        out += tag(f.number, f.wire_type)
        if f.wire_type == 0:
            out += varint(f.value)
        elif f.wire_type == 1:
            out += (f.value & ((1 << 64) - 1)).to_bytes(8, "little")
        elif f.wire_type == 5:
            out += (f.value & 0xFFFFFFFF).to_bytes(4, "little")
        else:
            body = encode(f.value) if isinstance(f.value, list) else f.value
            out += varint(len(body)) + body
    return bytes(out)


def _messages(fields: list[Field], out: list[list[Field]]) -> list[list[Field]]:
    out.append(fields)
    for f in fields:
        if isinstance(f.value, list) and f.wire_type == 2:
            _messages(f.value, out)
    return out


# ---------------------------------------------------------------- valid requests


def base_request(rng: random.Random, serial: int) -> ExportTraceServiceRequest:
    """A realistic request: spans with unique ids (serial in the span id), rank and step
    attributes, nested values, an event, a link, a status."""
    request = ExportTraceServiceRequest()
    for r in range(rng.randint(1, 2)):
        rs = request.resource_spans.add()
        for key, value in (("service.name", AnyValue(string_value="fuzz")),
                           ("flare.job.id", AnyValue(string_value=f"fuzz-{serial % 3}")),
                           ("flare.rank", AnyValue(int_value=r)),
                           ("host.name", AnyValue(string_value="h0"))):
            rs.resource.attributes.append(KeyValue(key=key, value=value))
        ss = rs.scope_spans.add()
        ss.scope.name = "fuzz"
        for i in range(rng.randint(1, 4)):
            span: Span = ss.spans.add()
            span.trace_id = rng.randbytes(15) + b"\x01"
            span.span_id = ((serial << 12) | (r << 8) | i | 1 << 62).to_bytes(8, "big")
            if rng.random() < 0.5:
                span.parent_span_id = rng.randbytes(7) + b"\x01"
            span.name = rng.choice(["train.step", "collective.all_reduce", "dataloader.next", "x"])
            span.kind = rng.randint(0, 5)
            span.start_time_unix_nano = 1_700_000_000_000_000_000 + serial * 1000
            span.end_time_unix_nano = span.start_time_unix_nano + rng.randint(0, 10**9)
            span.attributes.append(KeyValue(key="flare.step", value=AnyValue(int_value=serial)))
            span.attributes.append(KeyValue(key="flare.rank", value=AnyValue(int_value=r)))
            kv = span.attributes.add(key="flare.step.pg.names")
            for name in ("dp", "tp"):
                kv.value.array_value.values.add(string_value=name)
            span.attributes.append(KeyValue(key="ms", value=AnyValue(double_value=rng.random())))
            if rng.random() < 0.3:
                event = span.events.add(name="exception", time_unix_nano=span.start_time_unix_nano)
                event.attributes.append(KeyValue(key="exception.type", value=AnyValue(string_value="E")))
            if rng.random() < 0.3:
                span.links.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8))
            if rng.random() < 0.3:
                span.status.CopyFrom(Status(code=2, message="boom"))
    return request


# ---------------------------------------------------------------- mutations


def _deep_value(depth: int) -> bytes:
    """A KeyValue whose value is an array in an array … `depth` deep (written as bytes:
    protobuf's own API refuses to build past its recursion limit)."""
    value = tag(3, 0) + varint(7)  # AnyValue{int_value: 7}
    for _ in range(depth):
        array = tag(1, 2) + varint(len(value)) + value  # ArrayValue{values: [value]}
        value = tag(5, 2) + varint(len(array)) + array  # AnyValue{array_value: array}
    key = b"deep"
    return tag(1, 2) + varint(len(key)) + key + tag(2, 2) + varint(len(value)) + value


def _random_field(rng: random.Random) -> Field:
    number = rng.choice([rng.randint(1, 20), rng.randint(16, 2**29 - 1)])
    wire_type = rng.choice([0, 1, 2, 3, 5])
    if wire_type == 3:
        inner = [_random_field(rng) for _ in range(rng.randint(0, 2))]
        return Field(number, 3, [f for f in inner if f.wire_type != 3])
    if wire_type == 2:
        return Field(number, 2, rng.randbytes(rng.randint(0, 12)))
    return Field(number, wire_type, rng.getrandbits(64 if wire_type != 5 else 32))


def mutate(rng: random.Random, payload: bytes) -> bytes:
    """One to three mutations of `payload`."""
    for _ in range(rng.randint(1, 3)):
        payload = _mutate_once(rng, payload)
    return payload


def _mutate_once(rng: random.Random, payload: bytes) -> bytes:
    kind = rng.random()
    if kind < 0.15 and payload:  # byte damage
        data = bytearray(payload)
        op = rng.randint(0, 3)
        position = rng.randrange(len(data))
        if op == 0:
            data[position] ^= 1 << rng.randint(0, 7)
        elif op == 1:
            del data[position:position + rng.randint(1, 8)]
        elif op == 2:
            data[position:position] = rng.randbytes(rng.randint(1, 8))
        else:
            data = data[:position]
        return bytes(data)
    try:
        fields = parse(payload)
    except ValueError:
        return payload + encode([_random_field(rng)])
    messages = _messages(fields, [])
    target = rng.choice(messages)
    op = rng.randint(0, 9)
    if op == 0:  # an unknown field (any wire type, groups too)
        target.insert(rng.randint(0, len(target)), _random_field(rng))
    elif op == 1 and target:  # a known field number with another wire type
        f = rng.choice(target)
        wire_type = rng.choice([w for w in (0, 1, 2, 5) if w != f.wire_type])
        value = rng.randbytes(rng.randint(0, 9)) if wire_type == 2 else rng.getrandbits(32)
        target.insert(rng.randint(0, len(target)), Field(f.number, wire_type, value))
    elif op == 2 and target:  # a field twice (the last one wins, or repeats)
        f = rng.choice(target)
        target.append(Field(f.number, f.wire_type, f.value))
    elif op == 3 and target:  # a field dropped
        del target[rng.randrange(len(target))]
    elif op == 4:  # an attribute nested deeply (C readers stopped at 32)
        spans = [m for m in messages if any(f.number == 9 and f.wire_type == 2 for f in m)]
        into = rng.choice(spans) if spans else target
        into.append(Field(9, 2, _deep_value(rng.randint(20, 60))))
    elif op == 5:  # many events or links (the stores keep 4,096)
        spans = [m for m in messages if any(f.number == 5 and f.wire_type == 2 for f in m)]
        if spans:
            into = rng.choice(spans)
            number = rng.choice([11, 13])
            item = Span.Event(name="e").SerializeToString() if number == 11 else \
                Span.Link(trace_id=b"\x01" * 16, span_id=b"\x02" * 8).SerializeToString()
            into.extend(Field(number, 2, item) for _ in range(rng.choice([10, 4097, 4200])))
    elif op == 6 and target:  # out-of-range numbers
        ints = [f for f in target if f.wire_type in (0, 1)]
        if ints:
            rng.choice(ints).value = rng.choice([2**63, 2**64 - 1, 2**31, -1 & (2**64 - 1), 255])
    elif op == 7 and target:  # text that is not UTF-8 (protobuf refuses it in strings)
        texts = [f for f in target if f.wire_type == 2 and isinstance(f.value, bytes)]
        if texts:
            rng.choice(texts).value = b"\xff\xfe" + rng.randbytes(3)
    elif op == 8 and target:  # a nested message's bytes damaged
        nested = [f for f in target if isinstance(f.value, list)]
        if nested:
            f = rng.choice(nested)
            body = bytearray(encode(f.value))
            if body:
                body[rng.randrange(len(body))] = rng.randrange(256)
            f.value = bytes(body)
    else:  # non-finite doubles and odd scalar kinds in attributes
        spans = [m for m in messages if any(f.number == 9 and f.wire_type == 2 for f in m)]
        if spans:
            value = rng.choice([AnyValue(double_value=float("nan")),
                                AnyValue(double_value=float("inf")),
                                AnyValue(bytes_value=rng.randbytes(5)),
                                AnyValue(string_value="12"), AnyValue()])
            key = rng.choice(["flare.step", "flare.rank", "x"])
            rng.choice(spans).append(Field(9, 2, KeyValue(key=key, value=value).SerializeToString()))
    return encode(fields)


def cases(seed: int, count: int, first_serial: int = 0):
    """`count` (serial, payload) pairs: mutated requests, every 10th left valid."""
    rng = random.Random(seed)
    for index in range(count):
        serial = first_serial + index
        payload = base_request(rng, serial).SerializeToString()
        if index % 10:
            payload = mutate(rng, payload)
        yield serial, payload


def acknowledged_span_ids(payload: bytes) -> set[str]:
    """The ids of the spans a collector that answered OK to `payload` keeps: the ones
    with usable ids (the rest are rejected as partial success)."""
    request = ExportTraceServiceRequest.FromString(payload)
    out = set()
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                if (len(span.trace_id) == 16 and any(span.trace_id) and len(span.span_id) == 8
                        and any(span.span_id) and len(span.parent_span_id) in (0, 8)):
                    out.add(span.span_id.hex())
    return out


# ---------------------------------------------------------------- the in-process oracle


def _normal(table) -> list[dict]:
    import json

    rows = table.to_pylist()
    for row in rows:
        for column in ("attributes", "events", "links", "resource"):
            row[column] = json.loads(row[column])
    return rows


def check_in_process(seed: int, count: int, wal_dir) -> dict[str, int]:
    """Every mutation through the real receiver path (Acceptor → check → WAL → queue),
    then what was acknowledged through the store's decoder: it must take every
    acknowledged span, and give what the reference decoder gives. Every C reader also
    sees every mutation (acknowledged or not), for the sanitizers. Returns counts;
    raises AssertionError naming the seed and index of the first broken case."""
    from flare.collector.errors import MalformedPayload
    from flare.collector.ingest import Ingest, Item, ItemQueue
    from flare.collector.receiver import TRACES, Acceptor
    from flare.collector.telemetry import Counters
    from flare.collector.wal import WriteAheadLog
    from flare.exporters.otlp_columns import SpanColumns
    from flare.processors.rank_correlation import _SELECTION

    wal = WriteAheadLog(wal_dir)
    wal.load_identity()
    wal.open(committed_lsn=0)
    counters = Counters()
    queue = ItemQueue(1 << 30)
    acceptor = Acceptor(Ingest(queue, wal, {}, counters), counters)
    stats = {"mutations": 0, "acknowledged": 0, "refused": 0, "acknowledged_spans": 0,
             "stored_spans": 0, "lost_spans": 0, "decoder_fallbacks": 0}
    fallbacks_before = SpanColumns.decoder_fallbacks
    try:
        for index, (_, payload) in enumerate(cases(seed, count)):
            stats["mutations"] += 1
            where = f"seed {seed} case {index}"
            try:
                _SELECTION.select_payload(payload, compact=True)  # the correlator's C reader
            except ValueError:
                pass
            before = counters.get("accepted_spans", transport="fuzz")
            try:
                acceptor.accept(TRACES, payload, "fuzz")
            except MalformedPayload:
                stats["refused"] += 1
                try:
                    SpanColumns().add_payload(payload)
                except ValueError:
                    pass
                continue
            accepted = counters.get("accepted_spans", transport="fuzz") - before
            stats["acknowledged"] += 1
            item = queue.get(0)
            if accepted == 0:
                assert item is None, where
                continue
            assert isinstance(item, Item), where
            stats["acknowledged_spans"] += int(accepted)
            columns = SpanColumns()
            try:
                stored = columns.add_payload(item.payload)
            except Exception as exc:  # the store refused what was acknowledged
                stats["lost_spans"] += int(accepted)
                raise AssertionError(f"{where}: acknowledged, not storable: {exc}") from None
            stats["stored_spans"] += stored
            assert stored == accepted, f"{where}: {accepted} acknowledged, {stored} stored"
            reference = SpanColumns()
            reference.add_request_python(ExportTraceServiceRequest.FromString(item.payload))
            assert _normal(columns.table()) == _normal(reference.table()), f"{where}: C != reference"
            wal.commit(item.lsn)
    finally:
        wal.close()
    stats["decoder_fallbacks"] = SpanColumns.decoder_fallbacks - fallbacks_before
    return stats


# ---------------------------------------------------------------- against a collector

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _send_http(connection, payload: bytes) -> bool:
    """POST one body on a keep-alive connection; True when answered 200."""
    connection.request("POST", "/v1/traces", body=payload,
                       headers={"Content-Type": "application/x-protobuf"})
    response = connection.getresponse()
    response.read()
    return response.status == 200


def check_collector(start, seed: int, count: int, kills: int, first_serial: int = 0) -> dict:
    """Send `count` mutations to a real collector, alternately over OTLP/HTTP and
    OTLP/gRPC, killing it with SIGKILL `kills` times on the way (and starting it again
    on the same store and log); then stop it and check that every span it acknowledged
    is in the store. `start()` starts a collector and returns its `CollectorProcess`
    (tests/collector/conftest.py)."""
    import http.client

    import grpc

    from flare.exporters import store

    proc = start()
    acknowledged: set[str] = set()
    stats = {"mutations": 0, "acknowledged_requests": 0, "refused_requests": 0, "kills": 0,
             "unanswered": 0}
    kill_at = {round(count * (k + 1) / (kills + 1)) for k in range(kills)}
    connection = channel = call = None
    try:
        for index, (_, payload) in enumerate(cases(seed, count, first_serial)):
            if index in kill_at:
                proc.kill9()
                stats["kills"] += 1
                proc = start()
                connection = channel = None
            if connection is None:
                host, port = proc.http.rsplit(":", 1)
                connection = http.client.HTTPConnection(host, int(port), timeout=30)
                channel = grpc.insecure_channel(proc.grpc)
                call = channel.unary_unary(TRACE_METHOD)
            stats["mutations"] += 1
            try:
                if index % 2:
                    call(payload, timeout=30)
                    ok = True
                else:
                    ok = _send_http(connection, payload)
            except grpc.RpcError as err:
                ok = False
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    stats["unanswered"] += 1
            except (OSError, http.client.HTTPException):
                ok = False
                stats["unanswered"] += 1
                connection = http.client.HTTPConnection(*proc.http.rsplit(":", 1), timeout=30)
            if ok:
                stats["acknowledged_requests"] += 1
                acknowledged |= acknowledged_span_ids(payload)
            else:
                stats["refused_requests"] += 1
        if channel is not None:
            channel.close()
        assert proc.terminate() == 0, proc.log()[-3000:]
    finally:
        proc.stop_if_running()
    con = store.open_reader(proc.store_path, timeout_s=60)
    try:
        stored = {r[0] for r in con.execute("SELECT DISTINCT span_id FROM spans").fetchall()}
    finally:
        con.close()
    stats["acknowledged_spans"] = len(acknowledged)
    stats["lost_spans"] = len(acknowledged - stored)
    stats["dead_letter_files"] = len(list((proc.wal_dir / "dead-letter").glob("*.pb"))) \
        if (proc.wal_dir / "dead-letter").exists() else 0
    return stats
