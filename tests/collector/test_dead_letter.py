"""A batch the store refuses after it was acknowledged is never silently dropped.

It stays in the write-ahead log (the committed position stays before it), is retried
at every flush interval with the batches behind it waiting, and after
DELIVERY_ATTEMPTS refusals lands in the dead-letter directory with a count and a log
line, while the batches behind it are stored. Real parts: the worker thread, the
pipeline, the write-ahead log and the DuckDB store; only the refusal is injected.
"""

from __future__ import annotations

import logging

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.collector.ingest import Item, ItemQueue
from flare.collector.pipeline import DELIVERY_ATTEMPTS, Pipeline
from flare.collector.telemetry import Counters
from flare.collector.wal import SIGNAL_TRACES, WriteAheadLog
from flare.collector.worker import Worker
from flare.exporters import store
from flare.exporters.flare_store import FlareStoreExporter

KEY = "collector.wal.test.committed_lsn"


class RefusingStore(FlareStoreExporter):
    """The real store, refusing the batches whose first span id is in `refuse` (fault
    injection: no real input makes the store refuse an acknowledged request any more)."""

    def __init__(self, path: str, refuse: dict[str, int]) -> None:
        super().__init__(path=path)
        self.refuse = refuse  # span id hex -> refusals left (-1: always)

    def export_traces(self, request) -> None:
        first = ExportTraceServiceRequest.FromString(bytes(request)) \
            if isinstance(request, (bytes, bytearray, memoryview)) else request
        span_id = first.resource_spans[0].scope_spans[0].spans[0].span_id.hex()
        left = self.refuse.get(span_id, 0)
        if left:
            self.refuse[span_id] = left - 1 if left > 0 else -1
            raise MemoryError("injected refusal")
        super().export_traces(request)


def _worker(tmp_path, refuse):
    counters = Counters()
    exporter = RefusingStore(str(tmp_path / "s.duckdb"), refuse)
    pipeline = Pipeline("traces", "traces", [], [("flare_store", exporter)], counters)
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open(0)
    queue = ItemQueue(1 << 30)
    worker = Worker(queue, [pipeline], {"flare_store": exporter}, wal, KEY, counters,
                    flush_interval_s=3600)
    worker.load_markers()
    worker.start()
    return worker, queue, wal, exporter, counters


def _send(helpers, queue, wal, first_index, n_spans=10):
    request = helpers.make_request(n_spans, first_index=first_index)
    payload = request.SerializeToString()
    lsn = wal.append(SIGNAL_TRACES, payload)
    queue.put(Item(lsn, SIGNAL_TRACES, None, len(payload), payload=payload))
    first = request.resource_spans[0].scope_spans[0].spans[0].span_id.hex()
    return lsn, first, payload


def _stored(tmp_path) -> int:
    con = store.open_reader(tmp_path / "s.duckdb")
    try:
        return con.execute("SELECT count(*) FROM spans").fetchone()[0]
    finally:
        con.close()


def test_a_refused_batch_holds_the_log_position_and_is_retried(tmp_path, helpers):
    refuse: dict[str, int] = {}
    worker, queue, wal, exporter, counters = _worker(tmp_path, refuse)
    try:
        first_lsn, _, _ = _send(helpers, queue, wal, 0)
        assert worker.flush() and exporter.read_meta(KEY) == str(first_lsn)
        held_lsn, first, _ = _send(helpers, queue, wal, 100)
        refuse[first] = DELIVERY_ATTEMPTS - 1  # refused on arrival and once more
        after_lsn, _, _ = _send(helpers, queue, wal, 200)
        assert worker.flush()
        # Refused: the position stays before it, and the batch behind it waits too.
        assert exporter.read_meta(KEY) == str(held_lsn - 1)
        assert _stored(tmp_path) == 10
        assert wal.committed_lsn == held_lsn - 1
        assert worker.flush()  # the retry that succeeds
        assert exporter.read_meta(KEY) == str(after_lsn) and _stored(tmp_path) == 30
        assert counters.get("export_errors", exporter="flare_store") == DELIVERY_ATTEMPTS - 1
        assert counters.get("dead_letter_requests", exporter="flare_store") == 0
        assert not (wal.directory / "dead-letter").exists()
    finally:
        worker.stop(5.0)
        wal.close()


def test_a_batch_refused_every_time_goes_to_the_dead_letter_directory(tmp_path, helpers, caplog):
    refuse: dict[str, int] = {}
    worker, queue, wal, exporter, counters = _worker(tmp_path, refuse)
    try:
        caplog.set_level(logging.ERROR, logger="flare.collector.pipeline")
        lsn, first, payload = _send(helpers, queue, wal, 0)
        refuse[first] = -1
        after_lsn, _, _ = _send(helpers, queue, wal, 100)
        for _ in range(DELIVERY_ATTEMPTS):
            assert worker.flush()
        assert exporter.read_meta(KEY) == str(after_lsn)
        assert _stored(tmp_path) == 10  # the batch behind it is stored
        assert wal.committed_lsn == after_lsn
        buried = sorted((wal.directory / "dead-letter").iterdir())
        assert [p.name for p in buried] == [f"{lsn:020d}-traces.pb", f"{lsn:020d}-traces.txt"]
        assert buried[0].read_bytes() == payload  # resendable as it was acknowledged
        note = buried[1].read_text()
        assert "refused it 3 times: injected refusal" in note and f"lsns: {lsn}" in note
        assert counters.get("dead_letter_requests", exporter="flare_store") == 1
        assert counters.get("dead_letter_spans", exporter="flare_store") == 10
        assert any("moved to" in r.getMessage() and "10 spans" in r.getMessage()
                   for r in caplog.records)
    finally:
        worker.stop(5.0)
        wal.close()
