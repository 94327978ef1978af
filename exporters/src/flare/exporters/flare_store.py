"""The `flare_store` exporter: OTLP requests into the embedded DuckDB store.

`export_*` only converts into in-memory columns (cheap, never touches the file);
`flush` writes everything buffered in ONE DuckDB transaction, opening the file for
that flush only (`store.writer`) so readers can get in between flushes. A caller that
keeps a write-ahead log passes `commit_marker=(key, value)`: the marker lands in
`flare_meta` in the same transaction as the rows, so after a crash the store says
exactly which log position it already holds (replay is exactly-once).

A flush that fails (store held by a reader past the timeout, disk full) keeps every
buffered row for the next flush and raises `store.StoreError` (`store.StoreFull` when
the disk is full, naming it and the space left).

Each commit is a checkpoint (`checkpoint_threshold` 0): the rows go into the file
once and DuckDB's own log (`.wal`) stays empty; see docs/store-schema.md for what
flush size costs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import duckdb
import pyarrow as pa

from flare.exporters import store
from flare.exporters.otlp_columns import MetricColumns, SpanColumns
from flare.processors import options


class FlareStoreExporter:
    def __init__(
        self, path: str | os.PathLike[str], timeout_s: float = 10.0, threads: int = 1,
        large_flush_rows: int | None = None,
    ) -> None:
        if not str(path):
            raise ValueError("flare_store needs a non-empty `path`")
        self.path = os.fspath(path)
        self.timeout_s = float(timeout_s)
        # A flush of at least this many spans is checkpointed without DuckDB's vacuum
        # (`_vacuum_off_if_large`); a quarter of a row group unless given.
        self.large_flush_rows = (LARGE_FLUSH_ROWS if large_flush_rows is None
                                 else options.count(large_flush_rows,
                                                    "flare_store.large_flush_rows",
                                                    minimum=1))
        # One DuckDB thread per flush: an insert of already-columnar data gains little
        # from more, and the collector host's other cores are for receiving.
        self.threads = options.count(threads, "flare_store.threads", minimum=1)
        self._lock = threading.Lock()  # guards the buffers, not the file
        self._flush_lock = threading.Lock()  # one flush at a time keeps row order
        self._spans = SpanColumns()
        self._metrics = MetricColumns()
        # (device, inode) of the file whose schema an earlier flush checked: later
        # flushes to that same file skip the checks and DDL.
        self._checked_file: tuple[int, int] | None = None
        # Tables of a failed flush, written first by the next one.
        self._unwritten_spans: list[pa.Table] = []
        self._unwritten_metrics: list[pa.Table] = []
        self._counters = {
            "spans_written": 0.0,
            "metric_points_written": 0.0,
            "flushes": 0.0,
            "flush_errors": 0.0,
            "last_flush_ms": 0.0,
        }

    # ------------------------------------------------------------ pipeline side
    def export_traces(self, request: Any) -> None:
        """Buffer a request: an `ExportTraceServiceRequest`, or its serialized bytes
        (cheaper when the caller still has them, e.g. a receiver or a WAL replay).
        Bytes that are not a request raise ValueError and buffer nothing."""
        if isinstance(request, (bytes, bytearray, memoryview)):
            with self._lock:
                self._spans.add_payload(bytes(request))
            return
        with self._lock:
            self._spans.add_request(request)

    def export_metrics(self, request: Any) -> None:
        with self._lock:
            self._metrics.add_request(request)

    def buffered(self) -> int:
        """Spans and metric points not yet durable in the store."""
        with self._lock:
            pending = len(self._spans) + len(self._metrics)
            pending += sum(t.num_rows for t in self._unwritten_spans)
            pending += sum(t.num_rows for t in self._unwritten_metrics)
        return pending

    def flush(self, commit_marker: tuple[str, str] | None = None) -> None:
        """Durably write everything buffered (and the marker) in one transaction."""
        with self._flush_lock:
            with self._lock:
                spans, self._spans = self._spans, SpanColumns()
                points, self._metrics = self._metrics, MetricColumns()
                span_tables = [*self._unwritten_spans, spans.table()] if len(spans) else list(self._unwritten_spans)
                metric_tables = [*self._unwritten_metrics, points.table()] if len(points) else list(self._unwritten_metrics)
                self._unwritten_spans, self._unwritten_metrics = [], []
            if not span_tables and not metric_tables and commit_marker is None:
                return
            t0 = time.perf_counter()
            try:
                written_spans, written_points = self._write(span_tables, metric_tables, commit_marker)
            except BaseException:
                with self._lock:
                    self._unwritten_spans[:0] = span_tables
                    self._unwritten_metrics[:0] = metric_tables
                    self._counters["flush_errors"] += 1
                raise
            with self._lock:
                self._counters["spans_written"] += written_spans
                self._counters["metric_points_written"] += written_points
                self._counters["flushes"] += 1
                self._counters["last_flush_ms"] = (time.perf_counter() - t0) * 1e3

    def _write(
        self,
        span_tables: list[pa.Table],
        metric_tables: list[pa.Table],
        commit_marker: tuple[str, str] | None,
    ) -> tuple[int, int]:
        written_spans = written_points = 0
        try:
            checked = self._checked_file is not None and self._checked_file == _file_id(self.path)
            self._checked_file = None  # a failed flush checks again next time
            rows = sum(t.num_rows for t in span_tables) + sum(t.num_rows for t in metric_tables)
            # The collector's store: its directory is made as its files are.
            with store.writer(self.path, timeout_s=self.timeout_s, ensure_schema=not checked,
                              create_directory=True) as con:
                con.execute(f"SET threads = {self.threads}")
                # The commit checkpoints: the rows go into the file once, compressed,
                # and never into DuckDB's own log (`.wal`), which would hold them
                # uncompressed until the checkpoint at close; on a nearly full disk
                # that log is what no longer fits. About the same CPU for a small flush.
                con.execute("SET checkpoint_threshold = '0b'")
                with _vacuum_off_if_large(con, rows >= self.large_flush_rows):
                    con.begin()
                    try:
                        for table in span_tables:
                            written_spans += store.insert_spans(con, table)
                        for table in metric_tables:
                            written_points += store.insert_metrics(con, table)
                        if commit_marker is not None:
                            key, value = commit_marker
                            con.execute(
                                "INSERT OR REPLACE INTO flare_meta VALUES (?, ?)", [str(key), str(value)]
                            )
                        con.commit()
                    except BaseException:
                        # A failed COMMIT has ended the transaction already: the error
                        # to report is the commit's, not the rollback's.
                        with contextlib.suppress(duckdb.Error):
                            con.rollback()
                        raise
            self._checked_file = _file_id(self.path)
        except store.StoreError:
            raise
        except Exception as exc:  # duckdb errors (disk full, I/O) become one sentence
            raise store.no_space(self.path, exc) or store.StoreError(
                f"cannot write store {self.path}: {str(exc).splitlines()[0]}"
            ) from exc
        return written_spans, written_points

    def read_meta(self, key: str) -> str | None:
        """A `flare_meta` value (e.g. the last committed WAL position), None if absent."""
        if not os.path.exists(self.path):
            return None
        with self._flush_lock, store.writer(self.path, timeout_s=self.timeout_s) as con:
            row = con.execute("SELECT value FROM flare_meta WHERE key = ?", [key]).fetchone()
        return None if row is None else row[0]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._counters)
        out["buffered"] = float(self.buffered())
        out["decoder_fallbacks"] = float(SpanColumns.decoder_fallbacks)
        return out

    def shutdown(self) -> None:
        self.flush()


# A flush at least this big checkpoints without DuckDB's vacuum (see below).
LARGE_FLUSH_ROWS = store.ROW_GROUP_ROWS // 4


@contextlib.contextmanager
def _vacuum_off_if_large(con: Any, large: bool) -> Iterator[None]:
    """Write and checkpoint a large flush without DuckDB's vacuum.

    Each flush ends in a partial row group, and the vacuum of the next checkpoint (the
    one at close, or the one DuckDB runs at commit when a large append skips its WAL)
    merged it with its neighbours by rewriting and recompressing them: as much CPU again
    as the insert (~0.3 s per 130,000-span flush). Off for a large flush, the store
    keeps one partial row group per flush (readers see the same rows); small flushes (a
    quiet collector) keep the vacuum, which stops the store fragmenting into a row group
    per flush. The setting is back to DuckDB's default before the file is closed.

    Like every flush, it is checkpointed at its commit (`checkpoint_threshold` 0, set
    by `_write`) rather than logged first: the commit writes the rows to the file
    directly instead of to DuckDB's own WAL and again at the checkpoint. A flush of
    65,000 spans: 0.28 s of CPU → 0.23 s; a 500-span flush about the same either way.
    Just as durable: the commit returns once the checkpoint is on disk.
    """
    if not large:
        yield
        return
    con.execute("SET max_vacuum_tasks = 0")
    try:
        yield
        con.execute("CHECKPOINT")
    finally:
        try:
            con.execute("RESET max_vacuum_tasks")
        except duckdb.Error:
            pass  # a broken connection is closed next, and the setting with it


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
