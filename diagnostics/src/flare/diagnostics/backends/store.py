"""The embedded DuckDB store as a diagnosis backend, with filters and aggregation
pushed down to SQL so a thousand-rank hour never has to fit in Python memory.

The collector writes the file in short flushes, and a reader holding the file locks
it out, so a backend never holds the file for long: a query opens it read-only, and
the connection is kept for the next queries only within `hold_s` of that open (a
timer closes it then, busy or idle) and never past a large result or a long query.
A diagnosis asks about a dozen queries, most of them a few rows; opening the file is
~20 ms of each. Closing after a large result or a long scan returns DuckDB's memory
of that query before the next one builds its own.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from flare.diagnostics.backends.attributes import (
    BITMASK_ATTRIBUTES,
    is_list,
    sql_extract,
    sql_extract_from_list,
    sql_path,
    sql_typed_from_strings,
    type_name,
)
from flare.diagnostics.backends.base import BackendError
from flare.diagnostics.columns import Table
from flare.diagnostics.model import SpanQuery, SpanReader
from flare.exporters import store as flare_store
from flare.wire import semconv as sc

# (The store module offers its columns without pyarrow as SPAN_SQL_COLUMNS.)
_SPAN_COLUMN_NAMES = tuple(column[0] for column in getattr(flare_store, "SPAN_SQL_COLUMNS", None)
                           or flare_store.SPAN_COLUMNS)


# A result this large, or a query this long, ends the connection's reuse: either one
# leaves DuckDB holding memory (working memory, cached blocks of a long scan) that a new
# connection would not, and the ~20 ms of an open is small beside it. (The kernel table
# of one Kineto rank is ~5 MB; the counts and summaries of a small store take ~10 ms.)
_RELEASE_AFTER_BYTES = 1 << 20
_RELEASE_AFTER_S = 0.1
# A store file smaller than this is read with one DuckDB thread: its queries take
# milliseconds either way, and each extra thread's working memory is ~8 MB of the
# diagnosis's peak (a Kineto rank's kernel table: 124 -> 116 MB). Larger stores keep
# DuckDB's parallel scans (a 1,024-rank hour: 7.3 s wall with two threads, 8.1 s with one).
_SINGLE_THREAD_BELOW_BYTES = 64 << 20
# Backends holding a connection. At exit they close it from the main thread, or wait
# for their timer thread to finish closing it: a thread still inside DuckDB when the
# interpreter stops its daemon threads aborts the process ("terminate called ...
# exception not rethrown").
_HOLDING: weakref.WeakSet[StoreBackend] = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for backend in list(_HOLDING):
        backend.close()


class StoreBackend:
    def __init__(self, path: str | os.PathLike[str], open_timeout_s: float = 30.0,
                 memory_limit: str = "256MB", hold_s: float = 0.5,
                 release_after_bytes: int = _RELEASE_AFTER_BYTES) -> None:
        self.path = Path(path)
        self.release_after_bytes = release_after_bytes
        self.memory_limit = memory_limit
        self.name = f"store:{self.path}"
        self.open_timeout_s = open_timeout_s
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._con = None
        self._opened_at = 0.0
        self._timer: threading.Timer | None = None
        # Fail now, with the store's own one-line reason, rather than at first query.
        self.query("SELECT 1")

    def query(self, sql: str, params: Sequence[object] = ()) -> Table:
        """The result as numpy columns (DuckDB's `fetchnumpy`; no Arrow)."""
        with self._lock:
            if self._con is not None and time.monotonic() - self._opened_at > self.hold_s:
                self._release()
            if self._con is None:
                self._open()
            started = time.monotonic()
            try:
                # A cursor of its own: open_reader leaves its version check result on
                # `con`. Held until the result is read: DuckDB < 1.3 closes a collected
                # cursor's connection under the relation still reading from it.
                cursor = self._con.cursor()
                try:
                    relation = cursor.sql(sql, params=list(params))
                    table = Table.from_numpy(relation.fetchnumpy()) if relation is not None \
                        else Table({})
                finally:
                    cursor.close()
            except BaseException:
                self._release()
                raise
            if (_result_bytes(table, self.release_after_bytes) >= self.release_after_bytes
                    or self.hold_s <= 0
                    or time.monotonic() - started >= _RELEASE_AFTER_S):
                self._release()
            return table

    def _open(self) -> None:
        try:
            con = flare_store.open_reader(self.path, timeout_s=self.open_timeout_s)
        except flare_store.StoreError as exc:
            raise BackendError(str(exc)) from None
        try:
            # Diagnosis must stay small beside a training job: cap DuckDB's working memory
            # (it spills to disk beyond it) instead of its default share of the machine's RAM.
            con.execute(f"SET memory_limit = '{self.memory_limit}'")
            if self._single_thread():
                con.execute("SET threads = 1")
        except BaseException:
            con.close()
            raise
        self._con, self._opened_at = con, time.monotonic()
        _HOLDING.add(self)
        if self.hold_s > 0:
            self._timer = threading.Timer(self.hold_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _single_thread(self) -> bool:
        try:
            return self.path.stat().st_size < _SINGLE_THREAD_BELOW_BYTES
        except OSError:
            return False

    def _expire(self) -> None:
        with self._lock:
            if self._con is not None and time.monotonic() - self._opened_at >= self.hold_s * 0.99:
                self._release()

    def _release(self) -> None:
        """Close the held connection (the caller holds `_lock`)."""
        if self._timer is not None:
            if self._timer is not threading.current_thread():
                self._timer.cancel()
            self._timer = None
        if self._con is not None:
            con, self._con = self._con, None
            con.close()
        # Only now: an exit while a timer closes waits for it in `close()`, under `_lock`.
        _HOLDING.discard(self)

    def jobs(self) -> list[str]:
        rows = self.query("SELECT DISTINCT job FROM spans WHERE job IS NOT NULL ORDER BY job")
        return [j for j in rows.column("job").to_pylist() if j]

    def job_data(self, job: str) -> StoreJobData:
        return StoreJobData(self, job)

    def close(self) -> None:
        """Release the store file now (a later query opens it again)."""
        with self._lock:
            self._release()


def _name_filter(names: Sequence[str]) -> tuple[str, list[object]]:
    """`names` are exact span names, or prefixes ending in '*' (e.g. 'collective.*')."""
    exact = [n for n in names if not n.endswith("*")]
    prefixes = [n[:-1] for n in names if n.endswith("*")]
    parts: list[str] = []
    params: list[object] = []
    if exact:
        parts.append("name IN (" + ", ".join("?" for _ in exact) + ")")
        params.extend(exact)
    for prefix in prefixes:
        parts.append("starts_with(name, ?)")
        params.append(prefix)
    return "(" + " OR ".join(parts or ["FALSE"]) + ")", params


def _range_filter(
    first_step: int | None, last_step: int | None, ranks: Sequence[int] | None
) -> tuple[str, list[object]]:
    parts: list[str] = []
    params: list[object] = []
    if first_step is not None:
        parts.append("step >= ?")
        params.append(int(first_step))
    if last_step is not None:
        parts.append("step <= ?")
        params.append(int(last_step))
    if ranks is not None:
        parts.append("rank IN (" + ", ".join(str(int(r)) for r in ranks) + ")" if ranks else "FALSE")
    return " AND ".join(parts or ["TRUE"]), params


class StoreJobData(SpanReader):
    """`JobData` over one job in the store."""

    def __init__(self, backend: StoreBackend, job: str) -> None:
        self._backend = backend
        self.job = job
        self.backend = backend.name

    def query(self, q: SpanQuery) -> Table:
        names, attributes, first_step, last_step = q.names, q.attributes, q.first_step, q.last_step
        ranks, columns, limit, status_code = q.ranks, q.columns, q.limit, q.status_code
        name_sql, params = _name_filter(names)
        range_sql, range_params = _range_filter(first_step, last_step, ranks)
        if status_code is not None:
            range_sql += f" AND status_code = {int(status_code)}"
        cols = list(columns) if columns is not None else list(_SPAN_COLUMN_NAMES)
        # Each span's JSON is parsed once for all scalar keys (as strings, typed from
        # there) and once more for all list keys, if any are asked.
        scalars = [a for a in attributes if not is_list(a)]
        lists = [a for a in attributes if is_list(a)]
        extracted = {a: sql_typed_from_strings(a, i) for i, a in enumerate(scalars)}
        extracted |= {a: sql_extract_from_list(a, i) for i, a in enumerate(lists)}
        select = ", ".join(cols + [f'{extracted[a]} AS "{a}"' for a in attributes])
        source = "spans"
        if attributes:
            parsed = []
            if scalars:
                paths = "[" + ", ".join(sql_path(a) for a in scalars) + "]"
                parsed.append(f"json_extract_string(attributes, {paths}) AS s")
            if lists:
                paths = "[" + ", ".join(sql_path(a) for a in lists) + "]"
                parsed.append(f"json_extract(attributes, {paths}) AS v")
            source = f"(SELECT *, {', '.join(parsed)} FROM spans)"
        sql = (
            f"SELECT {select} FROM {source} WHERE job = ? AND {name_sql} AND {range_sql} "
            "ORDER BY start_ns"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        table = self._backend.query(sql, [self.job, *params, *range_params])
        return _typed(table, attributes)

    def step_summary(
        self,
        attributes: Sequence[str] = (),
        step_bucket: int = 1,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> Table:
        """Per (rank, step bucket) means of train.step duration and `attributes`.

        Columns: rank, step (first step of the bucket), steps (how many steps),
        start_ns (min), end_ns (max), duration_ms (mean), then one mean per attribute
        (the bitwise OR for the bit masks of `attributes.BITMASK_ATTRIBUTES`), as float32:
        a thousand-rank hour is over a million rows, and the matrices built from them are
        float32 anyway (halves the table: 420 → 385 MiB peak for the whole diagnosis).
        Duplicated deliveries of one span collapse first, then buckets average.
        """
        bucket = max(1, int(step_bucket))
        range_sql, range_params = _range_filter(first_step, last_step, None)
        # One JSON parse per span for all attributes (a list of paths), not one per key.
        paths = "[" + ", ".join(sql_path(a) for a in attributes) + "]"
        means = ", ".join(
            f'bit_or(TRY_CAST(v[{i + 1}] AS BIGINT))::FLOAT AS "{a}"' if a in BITMASK_ATTRIBUTES
            else f'avg(TRY_CAST(v[{i + 1}] AS DOUBLE))::FLOAT AS "{a}"' for i, a in enumerate(attributes))
        # Grouped straight into buckets: a duplicated delivery of a span repeats the
        # same values, so it leaves the means as they are. (Deduplicating first would
        # build a hash table of every (rank, step), the largest thing in a thousand-rank
        # hour; `steps` therefore counts a rare duplicate twice.) Rows come unordered:
        # the caller places them by (rank, step) itself.
        sql = (
            f"SELECT rank, (step // {bucket}) * {bucket} AS step, count(*) AS steps, "
            "min(step) AS first_step, max(step) AS last_step, "
            "min(start_ns) AS start_ns, max(end_ns) AS end_ns, avg(duration_ns) / 1e6 AS duration_ms"
            + (", " + means if means else "")
            + " FROM (SELECT rank, step, start_ns, end_ns, duration_ns"
            + (f", json_extract(attributes, {paths}) AS v" if attributes else "")
            + " FROM spans WHERE job = ? AND name = ? AND rank IS NOT NULL AND step IS NOT NULL"
            f" AND {range_sql}) GROUP BY 1, 2"
        )
        table = self._backend.query(sql, [self.job, sc.SPAN_STEP, *range_params])
        return _cast(table, {"rank": "int32", "step": "int64", "steps": "int64",
                             "first_step": "int64", "last_step": "int64"}
                     | {a: "float" for a in attributes} | {"duration_ms": "double"})

    def steps_range(self) -> tuple[int, int] | None:
        row = self._backend.query(
            "SELECT min(step) AS lo, max(step) AS hi FROM spans WHERE job = ? AND name = ?",
            [self.job, sc.SPAN_STEP],
        ).to_pylist()[0]
        if row["lo"] is None:
            return None
        return int(row["lo"]), int(row["hi"])

    def step_count(self) -> int:
        """Distinct step numbers: what the matrices' width is bounded by (sampled or
        imported steps are numbered sparsely, so the range overstates it)."""
        row = self._backend.query(
            "SELECT count(DISTINCT step) AS n FROM spans WHERE job = ? AND name = ?",
            [self.job, sc.SPAN_STEP]).to_pylist()[0]
        return int(row["n"] or 0)

    def ranks(self) -> list[int]:
        rows = self._backend.query(
            "SELECT DISTINCT rank FROM spans WHERE job = ? AND rank IS NOT NULL ORDER BY rank",
            [self.job],
        )
        return [int(r) for r in rows.column("rank").to_pylist()]

    def world_size(self) -> int | None:
        row = self._backend.query(
            f"SELECT max({sql_extract(sc.WORLD_SIZE, 'resource')}::BIGINT) AS ws, max(rank) AS hi "
            "FROM (SELECT resource, rank FROM spans WHERE job = ? AND name = ? LIMIT 100000)",
            [self.job, sc.SPAN_STEP],
        ).to_pylist()[0]
        if row["ws"] is not None:
            return int(row["ws"])
        if row["hi"] is not None:
            return int(row["hi"]) + 1
        return None

    def source(self) -> str | None:
        """The `flare.source` resource of the job's spans (any one: an importer marks all)."""
        row = self._backend.query(
            f"SELECT {sql_extract(sc.JOB_SOURCE, 'resource')} AS source FROM spans "
            "WHERE job = ? AND resource IS NOT NULL LIMIT 1", [self.job]).to_pylist()
        return row[0]["source"] if row and row[0]["source"] else None

    def rank_activity(self, names: Sequence[str]) -> Table:
        """Per rank: spans, first_start_ns, last_end_ns, last_step, over spans named `names`."""
        name_sql, params = _name_filter(names)
        table = self._backend.query(
            "SELECT rank, count(*) AS spans, min(start_ns) AS first_start_ns, "
            "max(end_ns) AS last_end_ns, max(step) AS last_step FROM spans "
            f"WHERE job = ? AND {name_sql} AND rank IS NOT NULL GROUP BY rank ORDER BY rank",
            [self.job, *params])
        return _cast(table, {"rank": "int32", "spans": "int64", "last_step": "int64"})

    def rank_resources(self, names: Sequence[str]) -> Table:
        """rank, resource: each distinct pair once, by first start time."""
        name_sql, params = _name_filter(names)
        return self._backend.query(
            f"SELECT rank, resource FROM spans WHERE job = ? AND {name_sql} AND rank IS NOT NULL "
            "GROUP BY rank, resource ORDER BY min(start_ns), rank", [self.job, *params])

    def count(self, names: Sequence[str]) -> int:
        name_sql, params = _name_filter(names)
        return int(self._backend.query(
            f"SELECT count(*) AS n FROM spans WHERE job = ? AND {name_sql}", [self.job, *params]
        ).column("n")[0].as_py())


def _typed(table: Table, attributes: Sequence[str]) -> Table:
    return _cast(table, {a: type_name(a) for a in attributes})


def _cast(table: Table, types: dict[str, str]) -> Table:
    for name, typ in types.items():
        if name in table and table[name].type != typ:
            table = table.append_column(name, table[name].cast(typ))
    return table


def _result_bytes(table: Table, enough: int) -> int:
    """A result's size: its arrays, and the text its object columns hold (counted only
    until `enough`, the release threshold, is reached)."""
    total = table.nbytes
    for name in table.column_names:
        if total >= enough:
            break
        data = table[name].data
        if data.dtype == object:
            total += sum(len(v) for v in data.tolist() if v is not None)
    return total
