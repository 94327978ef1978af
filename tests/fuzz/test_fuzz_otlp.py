"""An OK means stored: seeded hostile requests through the receiver path into the store.

The short CI run of the mutation fuzzer (`benchmarks/fuzz_otlp.py` is the long one):
every mutation goes through the real receiver path into a real write-ahead log, and
whatever was acknowledged must go into the store's columns, span for span, as the
reference decoder reads it (tests/collector/test_dead_letter.py: what happens when the
store refuses a batch after all).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).parent))
import otlp_mutations


@pytest.mark.parametrize("seed", [1, 2])
def test_every_acknowledged_mutation_is_stored_as_the_reference_reads_it(tmp_path, seed):
    stats = otlp_mutations.check_in_process(seed, 1500, tmp_path / "wal")
    assert stats["mutations"] == 1500
    # The mutations reach both verdicts, and the store's C reader disagreed with
    # protobuf on some acknowledged ones: those went through the reference, not lost.
    assert stats["acknowledged"] > 500 and stats["refused"] > 300
    assert stats["decoder_fallbacks"] > 0
    assert stats["lost_spans"] == 0
    assert stats["stored_spans"] == stats["acknowledged_spans"] > 2000


def test_the_correlators_picker_reads_what_protobuf_reads():
    """The C readers' other reader over the same mutations: where protobuf parses the
    bytes and the C picker takes them (it refuses what it reads differently, and the
    reference reads those), its records are the reference's, in both forms."""
    from flare.processors import span_select
    from flare.processors.rank_correlation import _SELECTION

    if span_select._otlp_read is None:
        pytest.skip("the C readers (flare.processors._otlp_read) are not built (no compiler at install)")
    compared = 0
    for _, payload in otlp_mutations.cases(3, 1500):
        try:
            request = ExportTraceServiceRequest.FromString(payload)
        except Exception:  # protobuf refuses it: so do the receivers
            continue
        try:
            picked = _SELECTION.select_payload(payload)
        except ValueError:
            continue
        reference = _SELECTION.select_python(request)
        assert repr(picked) == repr(reference)  # (repr: a mutation can make a NaN)
        compact = [(resource, [span_select.compact_step(r, _SELECTION.step, _SELECTION._span_keys)
                               if r[0] == _SELECTION.step[0] else r for r in records])
                   for resource, records in reference]
        assert repr(_SELECTION.select_payload(payload, compact=True)) == repr(compact)
        compared += 1
    assert compared > 500


def test_hostile_but_valid_shapes_are_stored_with_their_counts(tmp_path):
    """The shapes the C reader used to refuse after an OK: unknown groups, a known
    field with another wire type, attributes nested 33-47 deep; and more than 4,096
    events, which are cut and counted."""
    from flare.exporters.otlp_columns import SpanColumns

    request = otlp_mutations.base_request(__import__("random").Random(0), serial=1)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    for i in range(4100):
        span.events.add(name="e", time_unix_nano=i)
    span.dropped_links_count = 2
    tag, varint = otlp_mutations.tag, otlp_mutations.varint
    extra = (tag(7, 0) + varint(9)  # start_time_unix_nano as a varint: unknown to protobuf
             + tag(99, 3) + tag(1, 0) + varint(5) + tag(99, 4)  # an unknown group
             + tag(9, 2) + varint(len(deep := otlp_mutations._deep_value(45))) + deep)
    body = span.SerializeToString() + extra
    del request.resource_spans[0].scope_spans[0].spans[:]
    scope = request.resource_spans[0].scope_spans[0].SerializeToString()
    resource = request.resource_spans[0].resource.SerializeToString()
    scope += tag(2, 2) + varint(len(body)) + body
    rs = tag(1, 2) + varint(len(resource)) + resource + tag(2, 2) + varint(len(scope)) + scope
    payload = tag(1, 2) + varint(len(rs)) + rs
    parsed = ExportTraceServiceRequest.FromString(payload)  # protobuf accepts it
    assert parsed.resource_spans[0].scope_spans[0].spans[0].start_time_unix_nano == span.start_time_unix_nano

    columns = SpanColumns()
    assert columns.add_payload(payload) == 1
    row = otlp_mutations._normal(columns.table())[0]
    assert row["start_ns"] == span.start_time_unix_nano
    assert len(row["events"]) == 4096
    assert row["attributes"]["flare.dropped_events"] == 4100 - 4096
    assert row["attributes"]["flare.dropped_links"] == 2
    deep = row["attributes"]["deep"]
    for _ in range(45):
        deep = deep[0]
    assert deep == 7
