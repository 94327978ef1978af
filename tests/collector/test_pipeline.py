"""The commit position with a buffering processor: never past what the store holds.

Real parts: the `batch` processor, the `flare_store` exporter, a write-ahead log; the
pipeline worker thread drives them as in the collector.
"""

from __future__ import annotations

import time

import pytest

from flare.collector.ingest import Item, ItemQueue
from flare.collector.pipeline import Pipeline, Stage
from flare.collector.telemetry import Counters
from flare.collector.wal import SIGNAL_TRACES, WriteAheadLog
from flare.collector.worker import Worker
from flare.exporters import store
from flare.exporters.flare_store import FlareStoreExporter
from flare.processors.batch import BatchProcessor

KEY = "collector.wal.test.committed_lsn"


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def _setup(tmp_path, batch: BatchProcessor):
    counters = Counters()
    exporter = FlareStoreExporter(path=str(tmp_path / "s.duckdb"))
    pipeline = Pipeline("traces", "traces", [Stage("batch", "batch", batch)],
                        [("flare_store", exporter)], counters)
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open(0)
    queue = ItemQueue(1 << 30)
    worker = Worker(queue, [pipeline], {"flare_store": exporter}, wal, KEY, counters, flush_interval_s=3600)
    worker.load_markers()
    worker.start()
    return worker, queue, wal, exporter


def _send(helpers, queue, wal, n_spans, first_index):
    request = helpers.make_request(n_spans, first_index=first_index)
    lsn = wal.append(SIGNAL_TRACES, request.SerializeToString())
    queue.put(Item(lsn, SIGNAL_TRACES, request, 0))
    return lsn


def _stored(tmp_path):
    con = store.open_reader(tmp_path / "s.duckdb")
    try:
        return con.execute("SELECT count(*) FROM spans").fetchone()[0]
    finally:
        con.close()


def test_commit_waits_for_what_the_batch_processor_holds(tmp_path, helpers):
    clock = Clock()
    worker, queue, wal, exporter = _setup(tmp_path, BatchProcessor(send_batch_size=100, timeout="5s", clock=clock))
    try:
        for i in range(3):
            _send(helpers, queue, wal, 30, i * 30)  # 90 spans: below the batch size
        assert worker.flush()
        assert exporter.read_meta(KEY) in (None, "0")  # nothing durable yet, nothing claimed
        assert wal.committed_lsn == 0 and wal.segment_count == 1

        last = _send(helpers, queue, wal, 30, 90)  # 120 spans: the batch goes out
        assert worker.flush()
        assert exporter.read_meta(KEY) == str(last) and _stored(tmp_path) == 120
        assert wal.segment_count == 0

        _send(helpers, queue, wal, 10, 1000)
        assert worker.flush() and exporter.read_meta(KEY) == str(last)
        clock.now += 6 * 10**9  # past the batch timeout: the next tick sends it
        assert worker.flush()
        assert exporter.read_meta(KEY) == str(last + 1) and _stored(tmp_path) == 130
    finally:
        worker.stop(5)


def test_split_batches_are_all_stored_before_the_commit(tmp_path, helpers):
    batch = BatchProcessor(send_batch_size=100, send_batch_max_size=100, timeout="1h", clock=Clock())
    worker, queue, wal, exporter = _setup(tmp_path, batch)
    try:
        last = 0
        for i in range(5):
            last = _send(helpers, queue, wal, 30, i * 30)  # 150 spans: 100 now, 50 held
        assert worker.flush()
        assert _stored(tmp_path) == 120  # a batch of 100, and the 20 split off it at the tick
        assert exporter.read_meta(KEY) == str(last - 1)  # the 5th request is not all in
    finally:
        assert worker.stop(5)
    assert _stored(tmp_path) == 150  # shutdown drains the rest
    assert exporter.read_meta(KEY) == str(last)


def test_background_flush_never_claims_what_it_did_not_write(tmp_path, helpers):
    """Requests keep arriving while a flush waits on the store; the position stays exact."""
    counters = Counters()
    exporter = FlareStoreExporter(path=str(tmp_path / "s.duckdb"), timeout_s=30)
    pipeline = Pipeline("traces", "traces", [], [("flare_store", exporter)], counters)
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open(0)
    queue = ItemQueue(1 << 30)
    worker = Worker(queue, [pipeline], {"flare_store": exporter}, wal, KEY, counters, flush_interval_s=0.1)
    worker.load_markers()
    worker.start()

    def snapshot():
        con = store.open_reader(tmp_path / "s.duckdb", timeout_s=30)
        try:
            marker = con.execute("SELECT value FROM flare_meta WHERE key = ?", [KEY]).fetchone()
            return int(marker[0]) if marker else 0, con.execute("SELECT count(*) FROM spans").fetchone()[0]
        finally:
            con.close()

    try:
        for i in range(5):
            _send(helpers, queue, wal, 10, i * 10)
        assert worker.flush()
        reader = store.open_reader(tmp_path / "s.duckdb")  # the next flushes must wait
        try:
            for i in range(5, 20):
                _send(helpers, queue, wal, 10, i * 10)
                time.sleep(0.03)  # spread over several flush intervals
            assert reader.execute("SELECT count(*) FROM spans").fetchone() == (50,)
        finally:
            reader.close()
        seen = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            marker, rows = snapshot()
            assert rows == 10 * marker  # every span up to the marker, and nothing more
            seen.add(marker)
            if marker == 20:
                break
            time.sleep(0.05)  # let the collector's writer in between our reads
        assert marker == 20 and len(seen) >= 1
    finally:
        worker.stop(5)


def test_restart_with_an_empty_log_keeps_the_committed_position(tmp_path, helpers):
    FlareStoreExporter(path=str(tmp_path / "s.duckdb")).flush(commit_marker=(KEY, "1000"))
    counters = Counters()
    exporter = FlareStoreExporter(path=str(tmp_path / "s.duckdb"))
    pipeline = Pipeline("traces", "traces", [], [("flare_store", exporter)], counters)
    wal = WriteAheadLog(tmp_path / "wal")
    queue = ItemQueue(1 << 30)
    worker = Worker(queue, [pipeline], {"flare_store": exporter}, wal, KEY, counters, flush_interval_s=0.05)
    start = worker.load_markers()
    wal.open(start)
    assert worker.replay(lambda: wal.replay(start), lambda signal, payload: None) == 0
    worker.start()
    try:
        time.sleep(0.3)  # a few idle flush intervals
        assert worker.flush() and exporter.read_meta(KEY) == "1000"
        assert _send(helpers, queue, wal, 5, 0) == 1001  # numbering continues after the store's
        assert worker.flush() and exporter.read_meta(KEY) == "1001"
    finally:
        worker.stop(5)


def test_store_gets_the_correlators_spans_appended_to_a_request(tmp_path, helpers):
    """Unchanged requests reach the store as their original bytes; changed ones must not."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    from flare.processors.rank_correlation import RankCorrelation
    from flare.wire import semconv as sc

    counters = Counters()
    exporter = FlareStoreExporter(path=str(tmp_path / "s.duckdb"))
    stage = Stage("rank_correlation", "rank_correlation", RankCorrelation())
    pipeline = Pipeline("traces", "traces", [stage], [("flare_store", exporter)], counters)
    for rank in range(2):  # the second rank's step completes the window
        request = helpers.make_request(1, job="corr-job", rank=rank, step=0, first_index=rank)
        request.resource_spans[0].resource.attributes.append(
            KeyValue(key=sc.WORLD_SIZE, value=AnyValue(int_value=2)))
        request.resource_spans[0].scope_spans[0].spans[0].name = sc.SPAN_STEP
        pipeline.push(request, [], request.SerializeToString())
    exporter.flush()
    con = store.open_reader(tmp_path / "s.duckdb")
    try:
        names = sorted(r[0] for r in con.execute("SELECT name FROM spans").fetchall())
    finally:
        con.close()
    assert names == [sc.SPAN_STEP, sc.SPAN_STEP, sc.SPAN_STEP_RANKS]


def test_an_unparsed_request_reaches_the_store_as_bytes_and_others_as_a_message(tmp_path, helpers):
    """A request the receiver did not parse (None, with its bytes) runs through the
    memory limiter and the correlator as bytes: the store gets the bytes with the
    correlator's spans appended, another exporter the same request parsed, and a
    buffering stage gets it parsed too."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    from flare.processors.memory_limiter import MemoryLimiter
    from flare.processors.rank_correlation import RankCorrelation
    from flare.wire import semconv as sc

    class Capture:
        def __init__(self) -> None:
            self.got: list = []

        def export_traces(self, request) -> None:
            self.got.append(request)

    class StoreCapture(FlareStoreExporter):
        def __init__(self) -> None:
            self.got: list = []

        def export_traces(self, request) -> None:
            self.got.append(request)

    store_side, other = StoreCapture(), Capture()
    stages = [Stage("memory_limiter", "memory_limiter", MemoryLimiter()),
              Stage("rank_correlation", "rank_correlation", RankCorrelation())]
    pipeline = Pipeline("traces", "traces", stages, [("flare_store", store_side), ("otlp", other)], Counters())
    payloads = []
    for rank in range(2):  # the second rank's step completes the window
        request = helpers.make_request(1, job="corr-job", rank=rank, step=0, first_index=rank)
        request.resource_spans[0].resource.attributes.append(
            KeyValue(key=sc.WORLD_SIZE, value=AnyValue(int_value=2)))
        request.resource_spans[0].scope_spans[0].spans[0].name = sc.SPAN_STEP
        payloads.append(request.SerializeToString())
        pipeline.push(None, [], payloads[-1])
    assert store_side.got[0] == payloads[0]
    assert store_side.got[1].startswith(payloads[1]) and len(store_side.got[1]) > len(payloads[1])
    assert [r.SerializeToString() for r in other.got] == store_side.got
    names = [s.name for rs in other.got[1].resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert names == [sc.SPAN_STEP, sc.SPAN_STEP_RANKS]

    batch = BatchProcessor(send_batch_size=1, timeout="1h")
    batched = Pipeline("traces", "traces", [Stage("batch", "batch", batch)], [("otlp", other)], Counters())
    batched.push(None, [], payloads[0])
    assert other.got[-1] == ExportTraceServiceRequest.FromString(payloads[0])
    with pytest.raises(ValueError):
        batched.push(None, [], None)


class _BufferedStore:
    """A durable exporter whose buffer size the test sets (the policy reads only that)."""

    def __init__(self) -> None:
        self.pending = 0

    def buffered(self) -> int:
        return self.pending

    def flush(self, commit_marker=None) -> None:
        self.pending = 0

    def read_meta(self, key):
        return None


def test_flush_waits_for_a_row_group_under_load_only():
    exporter = _BufferedStore()
    worker = Worker(ItemQueue(1 << 20), [], {"store": exporter}, None, "k", Counters(), 0.5)
    start = worker._last_flush_started
    exporter.pending = 2_000  # a light load: flush on the interval as always
    assert worker._flush_due(start + 0.5)
    exporter.pending = 40_000  # 80 k spans/s would fill a row group within 2 s: wait
    assert not worker._flush_due(start + 0.5)
    exporter.pending = 100_000  # still on course for a row group
    assert not worker._flush_due(start + 1.5)
    exporter.pending = 45_000  # the rate fell: no row group by the cap, so flush now
    assert worker._flush_due(start + 1.5)
    exporter.pending = store.ROW_GROUP_ROWS  # a whole row group: now
    assert worker._flush_due(start + 1.0)
    exporter.pending = 100_000  # never later than 4 intervals
    assert worker._flush_due(start + 2.0)
