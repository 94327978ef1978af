"""ClickHouse's OpenTelemetry traces table as a diagnosis backend.

Reads the table otelcol-contrib's `clickhouse` exporter writes (`otel_traces`: one row
per span, resource and span attributes as `Map(LowCardinality(String), String)`, every
value as text) over HTTP(S) with `clickhouse-connect` (`clickhouse+http://HOST:8123/DB`),
or an embedded chDB directory (`chdb:PATH`), with the same SQL.

Everything a detector aggregates is aggregated in ClickHouse: the per-step, per-rank
frame is one GROUP BY over the job's `train.step` rows, attribute values are cast in
SQL (`toFloat64OrNull(SpanAttributes.values[indexOf(SpanAttributes.keys, 'flare.step.compute_ms')])`), and only the columns
and attributes asked for leave the server, as Arrow. The job, span names and step range
are filtered on the table's own columns, so the exporter's bloom-filter indexes on the
attribute maps and its `(ServiceName, SpanName, …)` order key prune what is read.
Values users give (job ids, span names) travel as query parameters, never as SQL text.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flare.diagnostics.backends import attributes as attrs
from flare.diagnostics.backends.base import BackendError
from flare.diagnostics.backends.clickhouse_engines import Chdb, Http
from flare.diagnostics.columns import Column, Table, list_value_type
from flare.diagnostics.model import SpanQuery, SpanReader
from flare.wire import semconv as sc

DEFAULT_TABLE = "otel_traces"
# The columns Flare reads; a table without them is not the exporter's traces table.
REQUIRED_COLUMNS = ("Timestamp", "TraceId", "SpanId", "ParentSpanId", "SpanName", "SpanKind",
                    "ServiceName", "ResourceAttributes", "SpanAttributes", "Duration",
                    "StatusCode", "StatusMessage", "Events.Timestamp", "Events.Name",
                    "Events.Attributes", "Links.TraceId", "Links.SpanId", "Links.Attributes")
_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


def _key(key: str) -> str:
    """An attribute key as a SQL literal. Keys are Flare's own names, never user text;
    one that could leave the literal is refused rather than escaped."""
    if "'" in key or "\\" in key:
        raise ValueError(f"attribute key {key!r} cannot be a ClickHouse map key literal")
    return f"'{key}'"


def _lookup(column: str, key: str) -> str:
    """`column[key]` ('' where absent), read through the map's `keys` and `values`
    subcolumns: the same value as ClickHouse's map subscript, 2.5x faster on the
    exporter's `Map(LowCardinality(String), String)` (chDB 4.4: 14 step attributes over
    3.7 M spans, 1.03 s against 2.60 s; `benchmarks/diagnose_scale.py --chdb`)."""
    return f"{column}.values[indexOf({column}.keys, {_key(key)})]"


def _has(column: str, key: str) -> str:
    return f"has({column}.keys, {_key(key)})"


def _res(key: str) -> str:
    return _lookup("ResourceAttributes", key)


def _attr(key: str) -> str:
    return _lookup("SpanAttributes", key)


_JOB = f"if({_res(sc.JOB_ID)} = '', toString(ServiceName), {_res(sc.JOB_ID)})"
_START = "toInt64(toUnixTimestamp64Nano(Timestamp))"
_DURATION = "toInt64(Duration)"
# The exporter writes kinds and status codes as text: `traceutil` spells them as the
# proto does ("SPAN_KIND_SERVER", "STATUS_CODE_ERROR"), newer pdata as "Server", "Error".
_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_KIND = ("toInt8(multiIf(" + ", ".join(
    f"upper(SpanKind) IN ('SPAN_KIND_{k}', '{k}'), {i}" for i, k in enumerate(_KINDS) if i) + ", 0))")
_STATUS = ("toInt8(multiIf(upper(StatusCode) IN ('STATUS_CODE_ERROR', 'ERROR'), 2, "
           "upper(StatusCode) IN ('STATUS_CODE_OK', 'OK'), 1, 0))")
_EVENTS = ("toJSONString(arrayMap((t, n, a) -> CAST(tuple(n, toUnixTimestamp64Nano(t), a), "
           "'Tuple(name String, time_ns Int64, attributes Map(String, String))'), "
           "`Events.Timestamp`, `Events.Name`, `Events.Attributes`))")
_LINKS = ("toJSONString(arrayMap((t, s, a) -> CAST(tuple(lower(t), lower(s), a), "
          "'Tuple(trace_id String, span_id String, attributes Map(String, String))'), "
          "`Links.TraceId`, `Links.SpanId`, `Links.Attributes`))")
# The store's span columns (flare.exporters.store.SPAN_SQL_COLUMNS), from the table's.
_COLUMNS: dict[str, str] = {
    "job": _JOB,
    "service": "toString(ServiceName)",
    "trace_id": "lower(TraceId)",
    "span_id": "lower(SpanId)",
    "parent_span_id": "lower(ParentSpanId)",
    "name": "toString(SpanName)",
    "kind": _KIND,
    "start_ns": _START,
    "end_ns": f"{_START} + {_DURATION}",
    "duration_ns": _DURATION,
    "status_code": _STATUS,
    "status_message": "StatusMessage",
    "rank": f"toInt32OrNull({_res(sc.RANK)})",
    "step": f"toInt64OrNull({_attr(sc.STEP)})",
    "host": f"nullIf({_res(sc.HOST_NAME)}, '')",
    "pid": f"toInt32OrNull({_res(sc.PROCESS_PID)})",
    "attributes": "toJSONString(SpanAttributes)",
    "resource": "toJSONString(ResourceAttributes)",
    "events": _EVENTS,
    "links": _LINKS,
}
_COLUMN_TYPES = {"kind": "int8", "status_code": "int8", "rank": "int32", "pid": "int32",
                 "start_ns": "int64", "end_ns": "int64", "duration_ns": "int64", "step": "int64"}
_LIST_SQL = {"int64": "Int64", "double": "Float64", "string": "String", "bool": "Bool"}


def _typed_attribute(key: str, column: str = "SpanAttributes") -> str:
    """`key`'s value from the map, cast in SQL to the type Flare gives it (NULL where
    absent or not of that type); lists were written as JSON text by the exporter."""
    value = _lookup(column, key)
    name = attrs.type_name(key)
    if name == "double":
        return f"toFloat64OrNull({value})"
    if name == "int64":
        return f"toInt64OrNull({value})"
    if name == "bool":
        return f"multiIf({value} = 'true', true, {value} = 'false', false, NULL)"
    if attrs.is_list(key):
        inner = _LIST_SQL.get(list_value_type(name), "String")
        return f"if({_has(column, key)}, JSONExtract({value}, 'Array({inner})'), NULL)"
    return f"if({_has(column, key)}, {value}, NULL)"


class _Params:
    """Query parameters, `{p0:String}` in the SQL: ClickHouse binds them itself."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def add(self, value: Any, typ: str = "String") -> str:
        name = f"p{len(self.values)}"
        self.values[name] = value
        return f"{{{name}:{typ}}}"


def _split_table(spec: str) -> tuple[str, str]:
    """`LOCATION?table=NAME` → (LOCATION, NAME); the table is checked as an identifier."""
    location, _, query = spec.partition("?")
    options = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(options) - {"table"})
    if unknown:
        raise BackendError(f"unknown ClickHouse backend option {unknown[0]!r} (only ?table=NAME)")
    table = (options.get("table") or [DEFAULT_TABLE])[-1] or DEFAULT_TABLE
    if not _TABLE_NAME.match(table):
        raise BackendError(f"ClickHouse table name {table!r} is not NAME or DATABASE.NAME")
    return location, table


class ClickHouseBackend:
    """`clickhouse+http(s)://[USER:PASSWORD@]HOST:PORT/DB[?table=NAME]` or `chdb:PATH`."""

    def __init__(self, spec: str) -> None:
        self.name = spec.split("?", 1)[0]
        self.bytes_received = 0
        if spec.startswith("chdb:"):
            location, self.table = _split_table(spec[len("chdb:"):])
            if not location:
                raise BackendError("the chdb backend needs a directory: chdb:PATH")
            self._engine: Chdb | Http = Chdb(location)
        else:
            location, self.table = _split_table(spec.partition("+")[2])
            parsed = urllib.parse.urlsplit(location)
            database = parsed.path.strip("/") or "default"
            if not _TABLE_NAME.match(database) or "." in database:
                raise BackendError(f"ClickHouse database name {database!r} is not a NAME")
            self._engine = Http(urllib.parse.urlunsplit(parsed._replace(path="")), database)
            self.name = f"clickhouse+{parsed.scheme}://{parsed.hostname}:{parsed.port or ''}/{database}"
        try:
            self._check_table()
        except BaseException:
            self._engine.close()  # a refused table must not keep the directory (or server) open
            raise

    def _check_table(self) -> None:
        database, _, table = self.table.rpartition(".")
        params = _Params()
        where_db = f"database = {params.add(database)}" if database else "database = currentDatabase()"
        found = self.query(f"SELECT name, type FROM system.columns WHERE {where_db} "
                           f"AND table = {params.add(table)}", params).to_pylist()
        if not found:
            raise BackendError(f"{self._engine.where} has no table {self.table}")
        types = {row["name"]: row["type"] for row in found}
        missing = [c for c in REQUIRED_COLUMNS if c not in types]
        if missing:
            raise BackendError(f"{self.table} is not an OpenTelemetry traces table as the "
                               f"clickhouse exporter writes it (no {', '.join(missing[:3])})")
        if not types["SpanAttributes"].startswith("Map("):
            raise BackendError(f"{self.table} keeps attributes as {types['SpanAttributes']}, the "
                               "exporter's experimental `json: true` layout; Flare reads the default "
                               "Map layout")

    def query(self, sql: str, params: _Params | None = None) -> Table:
        table = self._engine.arrow(sql, params.values if params else {})
        self.bytes_received += table.nbytes  # what the diagnosis pulled (docs/backends.md)
        return Table.from_arrow(table)

    def jobs(self) -> list[str]:
        """Jobs with a step, an error, a hang dump or a heartbeat: the spans every rank
        of a job sends (read through the order key's SpanName, not the whole table)."""
        params = _Params()
        names = ", ".join(params.add(n) for n in (sc.SPAN_STEP, sc.SPAN_ERROR, sc.SPAN_HANG,
                                                    sc.SPAN_HEARTBEAT))
        rows = self.query(f"SELECT DISTINCT {_JOB} AS job FROM {self.table} "
                          f"WHERE SpanName IN ({names}) ORDER BY job", params)
        return [j for j in rows.column("job").to_pylist() if j]

    def job_data(self, job: str) -> ClickHouseJobData:
        return ClickHouseJobData(self, job)

    def close(self) -> None:
        self._engine.close()


class ClickHouseJobData(SpanReader):
    """`JobData` over one job of the traces table."""

    def __init__(self, backend: ClickHouseBackend, job: str) -> None:
        self._backend = backend
        self.job = job
        self.backend = backend.name
        # When the job's steps ran, learnt from the whole-job step summary: (first step,
        # last step, first start ns, last end ns) per bucket, over every rank.
        self._step_times: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _time_bounds(self, q: SpanQuery) -> tuple[int, int] | None:
        """The time the steps `q` asks for ran in, where it is known: `train.step` spans
        of those steps start inside it, so the table's order key (`toDateTime(Timestamp)`
        after the span name) reads only those granules. An hour of 6,144 ranks: the
        topology's first 5 steps in 0.1 s against 8.0 s, an anomaly's evidence steps
        against 4.5 s each. Other spans keep no such promise (a hang report is written
        long after its step began; a written-back label when the diagnosis ran)."""
        if self._step_times is None or set(q.names) != {sc.SPAN_STEP}:
            return None
        if q.first_step is None and q.last_step is None:
            return None
        firsts, lasts, starts, ends = self._step_times
        lo = q.first_step if q.first_step is not None else int(firsts[0])
        hi = q.last_step if q.last_step is not None else int(lasts[-1])
        if lo < firsts[0] or hi > lasts[-1]:
            return None  # steps the summary did not see (a job still running)
        chosen = (lasts >= lo) & (firsts <= hi)
        if not chosen.any():
            return None
        return int(starts[chosen].min()), int(ends[chosen].max())

    def _rows(self, params: _Params, where: str = "") -> str:
        """The job's rows of the table; `where` filters on its own columns."""
        job = params.add(self.job)
        return (f"{self._backend.table} WHERE ({_res(sc.JOB_ID)} = {job} OR "
                f"({_res(sc.JOB_ID)} = '' AND ServiceName = {job}))" + (f" AND {where}" if where else ""))

    @staticmethod
    def _names(names: Sequence[str], params: _Params) -> str:
        parts = [f"SpanName = {params.add(n)}" for n in names if not n.endswith("*")]
        parts += [f"startsWith(SpanName, {params.add(n[:-1])})" for n in names if n.endswith("*")]
        return "(" + (" OR ".join(parts) or "false") + ")"

    @staticmethod
    def _range(first_step: int | None, last_step: int | None, ranks: Sequence[int] | None,
               step: str = "step") -> str:
        parts = []
        if first_step is not None:
            parts.append(f"{step} >= {int(first_step)}")
        if last_step is not None:
            parts.append(f"{step} <= {int(last_step)}")
        if ranks is not None:
            parts.append(f"rank IN ({', '.join(str(int(r)) for r in ranks)})" if ranks else "false")
        return " AND ".join(parts) or "true"

    def query(self, q: SpanQuery) -> Table:
        names, attributes, first_step, last_step = q.names, q.attributes, q.first_step, q.last_step
        ranks, columns, limit, status_code = q.ranks, q.columns, q.limit, q.status_code
        params = _Params()
        cols = list(columns) if columns is not None else list(_COLUMNS)
        unknown = [c for c in cols if c not in _COLUMNS]
        if unknown:
            raise ValueError(f"no span column {unknown[0]!r}")
        needed = set(cols) | {"start_ns", "step", "rank"} | ({"status_code"} if status_code is not None else set())
        inner = ", ".join(f"{_COLUMNS[c]} AS {c}" for c in _COLUMNS if c in needed)
        inner += "".join(f", {_typed_attribute(a)} AS {_quoted(a)}" for a in attributes)
        where = self._range(first_step, last_step, ranks)
        if status_code is not None:
            where += f" AND status_code = {int(status_code)}"
        spans = self._names(names, params)
        bounds = self._time_bounds(q)
        if bounds is not None:
            spans += (f" AND Timestamp >= fromUnixTimestamp64Nano({params.add(bounds[0], 'Int64')}) "
                      f"AND Timestamp <= fromUnixTimestamp64Nano({params.add(bounds[1], 'Int64')})")
        sql = (f"SELECT {', '.join(cols + [_quoted(a) for a in attributes])} FROM "
               f"(SELECT {inner} FROM {self._rows(params, spans)}) "
               f"WHERE {where} ORDER BY start_ns" + (f" LIMIT {int(limit)}" if limit is not None else ""))
        table = self._backend.query(sql, params)
        for column in ("resource", "attributes"):
            if column in cols:
                table = _typed_json_column(table, column)
        return _cast(table, {c: _COLUMN_TYPES[c] for c in cols if c in _COLUMN_TYPES}
                     | {a: attrs.type_name(a) for a in attributes})

    def step_summary(
        self,
        attributes: Sequence[str] = (),
        step_bucket: int = 1,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> Table:
        """As the store's: per (rank, bucket of steps) the means of train.step's duration
        and of `attributes` (bit masks ORed), computed in ClickHouse."""
        bucket = max(1, int(step_bucket))
        params = _Params()
        values = "".join(  # as the store: every value a number (bit masks integers)
            f", to{'Int64' if a in attrs.BITMASK_ATTRIBUTES else 'Float64'}OrNull({_attr(a)}) AS v{i}"
            for i, a in enumerate(attributes))
        means = "".join(
            f", toFloat32(groupBitOr(v{i})) AS {_quoted(a)}" if a in attrs.BITMASK_ATTRIBUTES
            else f", toFloat32(avg(v{i})) AS {_quoted(a)}" for i, a in enumerate(attributes))
        where = self._range(first_step, last_step, None, step="s")
        sql = (
            f"SELECT r AS rank, intDiv(s, {bucket}) * {bucket} AS step, count() AS steps, "
            "min(s) AS first_step, max(s) AS last_step, min(b) AS start_ns, max(e) AS end_ns, "
            f"avg(d) / 1e6 AS duration_ms{means} FROM (SELECT {_COLUMNS['rank']} AS r, "
            f"{_COLUMNS['step']} AS s, {_START} AS b, {_START} + {_DURATION} AS e, "
            f"{_DURATION} AS d{values} FROM {self._rows(params, f'SpanName = {params.add(sc.SPAN_STEP)}')}) "
            f"WHERE r IS NOT NULL AND s IS NOT NULL AND {where} GROUP BY r, intDiv(s, {bucket})"
        )
        table = _cast(self._backend.query(sql, params),
                      {"rank": "int32", "step": "int64", "steps": "int64", "first_step": "int64",
                       "last_step": "int64", "start_ns": "int64", "end_ns": "int64",
                       "duration_ms": "double"} | {a: "float" for a in attributes})
        if first_step is None and last_step is None and table.num_rows:
            self._step_times = _step_times(table)
        return table

    def _one(self, select: str, where: str, params: _Params) -> dict[str, Any]:
        return self._backend.query(f"SELECT {select} FROM {self._rows(params, where)}",
                                   params).to_pylist()[0]

    def step_numbers(self) -> tuple[tuple[int, int] | None, int]:
        """The step range and how many distinct steps it holds, in one pass over the
        job's step spans (two queries of 0.8 s each for an hour of 1,024 ranks)."""
        params = _Params()
        step = _COLUMNS["step"]
        row = self._one(f"min({step}) AS lo, max({step}) AS hi, uniqExact({step}) AS n",
                        f"SpanName = {params.add(sc.SPAN_STEP)}", params)
        if row["lo"] is None:
            return None, 0
        return (int(row["lo"]), int(row["hi"])), int(row["n"] or 0)

    def steps_range(self) -> tuple[int, int] | None:
        return self.step_numbers()[0]

    def step_count(self) -> int:
        return self.step_numbers()[1]

    def ranks(self) -> list[int]:
        params = _Params()
        rows = self._backend.query(
            f"SELECT DISTINCT {_COLUMNS['rank']} AS rank FROM {self._rows(params)} "
            "ORDER BY rank", params)
        return [int(r) for r in rows.column("rank").to_pylist() if r is not None]

    def world_size(self) -> int | None:
        params = _Params()
        # Every span carries it: the first 100,000 step spans say it (as the store).
        row = self._backend.query(
            f"SELECT max(toInt64OrNull(ws)) AS ws, max(rank) AS hi FROM (SELECT "
            f"{_res(sc.WORLD_SIZE)} AS ws, {_COLUMNS['rank']} AS rank FROM "
            f"{self._rows(params, f'SpanName = {params.add(sc.SPAN_STEP)}')} LIMIT 100000)",
            params).to_pylist()[0]
        if row["ws"] is not None:
            return int(row["ws"])
        return None if row["hi"] is None else int(row["hi"]) + 1

    def source(self) -> str | None:
        params = _Params()
        # An importer marks every span: the job's first spans say it (a live job has none,
        # and reading all its spans for that took 2.7 s at 6,144 ranks).
        rows = self._backend.query(
            f"SELECT source FROM (SELECT {_res(sc.JOB_SOURCE)} AS source FROM "
            f"{self._rows(params)} LIMIT 1000) WHERE source != '' LIMIT 1", params).to_pylist()
        return rows[0]["source"] if rows else None

    def rank_activity(self, names: Sequence[str]) -> Table:
        params = _Params()
        table = self._backend.query(
            f"SELECT {_COLUMNS['rank']} AS rank, count() AS spans, min({_START}) AS first_start_ns, "
            f"max({_START} + {_DURATION}) AS last_end_ns, max({_COLUMNS['step']}) AS last_step "
            f"FROM {self._rows(params, self._names(names, params))} "
            "GROUP BY rank HAVING rank IS NOT NULL ORDER BY rank", params)
        return _cast(table, {"rank": "int32", "spans": "int64", "first_start_ns": "int64",
                             "last_end_ns": "int64", "last_step": "int64"})

    def rank_resources(self, names: Sequence[str]) -> Table:
        params = _Params()
        table = self._backend.query(
            f"SELECT {_COLUMNS['rank']} AS rank, toJSONString(ResourceAttributes) AS resource "
            f"FROM {self._rows(params, self._names(names, params))} GROUP BY rank, resource "
            f"HAVING rank IS NOT NULL ORDER BY min({_START}), rank", params)
        return _typed_json_column(_cast(table, {"rank": "int32"}), "resource")

    def count(self, names: Sequence[str]) -> int:
        params = _Params()
        return int(self._one("count() AS n", self._names(names, params), params)["n"])


def _step_times(summary: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per bucket of a step summary, over every rank: its first and last step, the first
    start and the last end (ns), in step order."""
    keys, column = np.unique(summary["step"].to_numpy(), return_inverse=True)
    out = []
    for name, reduce, fill in (("first_step", np.minimum, np.iinfo(np.int64).max),
                               ("last_step", np.maximum, np.iinfo(np.int64).min),
                               ("start_ns", np.minimum, np.iinfo(np.int64).max),
                               ("end_ns", np.maximum, np.iinfo(np.int64).min)):
        values = np.full(keys.size, fill, dtype=np.int64)
        reduce.at(values, column, summary[name].to_numpy().astype(np.int64))
        out.append(values)
    return out[0], out[1], out[2], out[3]


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _cast(table: Table, types: dict[str, str]) -> Table:
    for name, typ in types.items():
        if name in table and table[name].type != typ:
            table = table.append_column(name, table[name].cast(typ))
    return table


def _typed_json_column(table: Table, column: str) -> Table:
    """The exporter wrote every attribute value as text; give the keys Flare knows their
    types back (a world size is a number), so the JSON reads as the store's does."""
    if column not in table or table.num_rows == 0:
        return table
    cache: dict[str, str | None] = {}

    def typed(text: str | None) -> str | None:
        if text is None:
            return None
        if text not in cache:
            cache[text] = json.dumps({k: attrs.from_text(v, k) for k, v in json.loads(text).items()})
        return cache[text]

    return table.append_column(column, Column.from_values(
        [typed(t) for t in table.column(column).to_pylist()], "string"))


# The exporter's traces table (otelcol-contrib `clickhouse` exporter, its current
# template), for chDB directories and tests; production tables are created by the
# exporter itself (docs/deployment.md gives the settings Flare's queries want).
TRACES_TABLE_SQL = """CREATE TABLE IF NOT EXISTS {table} (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (Timestamp DateTime64(9), Name LowCardinality(String),
                   Attributes Map(LowCardinality(String), String)) CODEC(ZSTD(1)),
    Links Nested (TraceId String, SpanId String, TraceState String,
                  Attributes Map(LowCardinality(String), String)) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""


def _as_map(json_column: str) -> str:
    """A JSON object's members as the exporter's Map(String, String): strings without
    their quotes, numbers, bools, lists and objects as their JSON text
    (pcommon.Value.AsString)."""
    kv = f"JSONExtractKeysAndValuesRaw(coalesce({json_column}, '{{}}'))"
    return (f"CAST((arrayMap(x -> x.1, {kv}), arrayMap(x -> if(startsWith(x.2, '\"'), "
            f"JSONExtractString(concat('[', x.2, ']'), 1), x.2), {kv})), 'Map(String, String)')")


_KIND_NAMES = "['SPAN_KIND_UNSPECIFIED', " + ", ".join(f"'SPAN_KIND_{k}'" for k in _KINDS[1:]) + "]"
_FROM_STORE = f"""SELECT
    fromUnixTimestamp64Nano(start_ns) AS Timestamp, trace_id AS TraceId, span_id AS SpanId,
    parent_span_id AS ParentSpanId, '' AS TraceState, name AS SpanName,
    {_KIND_NAMES}[least(greatest(coalesce(kind, 0), 0), 5) + 1] AS SpanKind,
    coalesce(service, '') AS ServiceName, {_as_map('resource')} AS ResourceAttributes,
    '' AS ScopeName, '' AS ScopeVersion, {_as_map('attributes')} AS SpanAttributes,
    toUInt64(greatest(duration_ns, 0)) AS Duration,
    ['STATUS_CODE_UNSET', 'STATUS_CODE_OK', 'STATUS_CODE_ERROR'][least(greatest(coalesce(status_code, 0), 0), 2) + 1] AS StatusCode,
    coalesce(status_message, '') AS StatusMessage,
    arrayMap(e -> fromUnixTimestamp64Nano(JSONExtractInt(e, 'time_ns')), JSONExtractArrayRaw(coalesce(events, '[]'))) AS `Events.Timestamp`,
    arrayMap(e -> JSONExtractString(e, 'name'), JSONExtractArrayRaw(coalesce(events, '[]'))) AS `Events.Name`,
    arrayMap(e -> {_as_map("JSONExtractRaw(e, 'attributes')")}, JSONExtractArrayRaw(coalesce(events, '[]'))) AS `Events.Attributes`,
    arrayMap(l -> JSONExtractString(l, 'trace_id'), JSONExtractArrayRaw(coalesce(links, '[]'))) AS `Links.TraceId`,
    arrayMap(l -> JSONExtractString(l, 'span_id'), JSONExtractArrayRaw(coalesce(links, '[]'))) AS `Links.SpanId`,
    arrayMap(l -> '', JSONExtractArrayRaw(coalesce(links, '[]'))) AS `Links.TraceState`,
    arrayMap(l -> {_as_map("JSONExtractRaw(l, 'attributes')")}, JSONExtractArrayRaw(coalesce(links, '[]'))) AS `Links.Attributes`
FROM file({{path:String}}, Parquet)"""


def load_store(backend: ClickHouseBackend, store_path: str | os.PathLike[str], job: str | None = None) -> int:
    """Copy a Flare store's spans (one job, or all) into a chDB directory's traces table,
    each row as the exporter would have written it from the same OTLP: for trying the
    backend on a store at hand, and for tests and benchmarks. Returns the rows copied."""
    if not isinstance(backend._engine, Chdb):
        raise BackendError("load_store fills chDB directories only (a server is filled by the exporter)")
    import tempfile

    import duckdb

    with tempfile.TemporaryDirectory() as scratch:
        parquet = str(Path(scratch) / "spans.parquet")
        con = duckdb.connect(str(store_path), read_only=True)
        try:
            con.execute("SET enable_progress_bar = false")
            where, args = ("WHERE job = ?", [job]) if job is not None else ("", [])
            # (a store's host and pid columns came from the resource; rows imported or
            # made without them in the resource get them back there)
            con.execute(
                "COPY (SELECT * REPLACE (json_merge_patch(json_merge_patch("
                f"CASE WHEN host IS NULL THEN '{{}}' ELSE json_object('{sc.HOST_NAME}', host) END, "
                f"CASE WHEN pid IS NULL THEN '{{}}' ELSE json_object('{sc.PROCESS_PID}', pid) END), "
                f"CASE WHEN json_valid(resource) THEN resource ELSE '{{}}' END)::VARCHAR AS resource) "
                f"FROM spans {where}) "
                f"TO '{parquet}' (FORMAT parquet)", args)
            rows = int(con.execute(f"SELECT count(*) FROM spans {where}", args).fetchone()[0])
        finally:
            con.close()
        params = _Params()
        params.values["path"] = parquet
        backend._engine.arrow(f"INSERT INTO {backend.table} {_FROM_STORE}", params.values)
    return rows


def create_chdb(path: str | os.PathLike[str], table: str = DEFAULT_TABLE) -> ClickHouseBackend:
    """A chDB directory at `path` with an empty traces table, opened as a backend."""
    if not _TABLE_NAME.match(table):
        raise BackendError(f"ClickHouse table name {table!r} is not NAME or DATABASE.NAME")
    Path(path).mkdir(parents=True, exist_ok=True)
    engine = Chdb(str(path))
    database = table.rpartition(".")[0]
    if database:
        engine.arrow(f"CREATE DATABASE IF NOT EXISTS {database}", {})
    try:
        engine.arrow(TRACES_TABLE_SQL.format(table=table), {})
        return ClickHouseBackend(f"chdb:{path}?table={table}")
    finally:
        engine.close()
