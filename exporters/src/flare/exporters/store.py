"""The embedded span store: one DuckDB file with a documented columnar schema.

Schema (version `SCHEMA_VERSION`; documented in docs/store-schema.md):

    spans    one row per span; identity, timing and the columns diagnosis filters on
             (job, rank, step, name, start_ns) promoted out of the attribute map;
             the rest of the attributes, events and links as JSON text.
    metrics  one row per metric data point (NVML, collector self-metrics).
    flare_meta  key/value: schema version, writer, replay positions.

Concurrency: DuckDB lets one process hold a file for writing, and a read-only opener
fails while a writer holds it. The collector therefore opens the file only for the
duration of a flush (`Store.writer()` as a context manager) and readers retry on the
lock (`open_reader`). Data that arrives while a reader holds the file waits in the
collector's write-ahead log, never in memory alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 1

# (name, SQL type). The Arrow forms (SPAN_COLUMNS, SPAN_SCHEMA, ...) are built on first
# use, below: `flare import-kineto` and the diagnosis's store backend read and write the
# store without loading pyarrow (~25-35 MB of their processes).
SPAN_SQL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job", "VARCHAR"),
    ("service", "VARCHAR"),
    ("trace_id", "VARCHAR"),  # 32 lowercase hex digits
    ("span_id", "VARCHAR"),  # 16 lowercase hex digits
    ("parent_span_id", "VARCHAR"),  # '' for a root span
    ("name", "VARCHAR"),
    ("kind", "TINYINT"),  # OTLP SpanKind number
    ("start_ns", "BIGINT"),  # unix epoch nanoseconds
    ("end_ns", "BIGINT"),
    ("duration_ns", "BIGINT"),
    ("status_code", "TINYINT"),  # OTLP: 0 unset, 1 ok, 2 error
    ("status_message", "VARCHAR"),
    ("rank", "INTEGER"),  # flare.rank of the resource; NULL if none
    ("step", "BIGINT"),  # flare.step of the span; NULL if none
    ("host", "VARCHAR"),
    ("pid", "INTEGER"),
    ("attributes", "VARCHAR"),  # JSON object of span attributes
    ("resource", "VARCHAR"),  # JSON object of resource attributes
    ("events", "VARCHAR"),  # JSON array [{name, time_ns, attributes}]
    ("links", "VARCHAR"),  # JSON array [{trace_id, span_id, attributes}]
)

METRIC_SQL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job", "VARCHAR"),
    ("rank", "INTEGER"),
    ("name", "VARCHAR"),
    ("time_ns", "BIGINT"),
    ("value", "DOUBLE"),
    ("unit", "VARCHAR"),
    ("attributes", "VARCHAR"),  # JSON object of point + resource attrs
)

_ARROW_TYPE = {"VARCHAR": "string", "TINYINT": "int8", "INTEGER": "int32", "BIGINT": "int64",
               "DOUBLE": "float64"}
_ARROW_NAMES = ("SPAN_COLUMNS", "METRIC_COLUMNS", "SPAN_SCHEMA", "METRIC_SCHEMA")


def _arrow(name: str) -> Any:
    """SPAN_COLUMNS / METRIC_COLUMNS ((name, SQL type, Arrow type) triples) and
    SPAN_SCHEMA / METRIC_SCHEMA, built (importing pyarrow) on first use."""
    if name not in globals():
        import pyarrow as pa

        def typed(columns: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str, pa.DataType], ...]:
            return tuple((n, t, getattr(pa, _ARROW_TYPE[t])()) for n, t in columns)

        spans, metrics = typed(SPAN_SQL_COLUMNS), typed(METRIC_SQL_COLUMNS)
        globals().update(
            SPAN_COLUMNS=spans, METRIC_COLUMNS=metrics,
            SPAN_SCHEMA=pa.schema([(n, t) for n, _, t in spans]),
            METRIC_SCHEMA=pa.schema([(n, t) for n, _, t in metrics]),
        )
    return globals()[name]


def __getattr__(name: str) -> Any:
    if name in _ARROW_NAMES:
        return _arrow(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DuckDB's row group: an insert at least this big is written straight into the file;
# a smaller one goes through DuckDB's own log first and is written twice.
ROW_GROUP_ROWS = 122_880

# The JSON text columns are most of a store's bytes. DuckDB's default for text (FSST
# with a dictionary) keeps them at about twice the size zstd does on Flare's span mix
# (docs/store-schema.md, "Size"); the compression is a storage detail, so readers see
# the same columns and values, and stores created before it keep their old layout.
ZSTD_COLUMNS = frozenset({"attributes", "resource", "events", "links"})


def _column_ddl(columns: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(
        f"{n} {t}" + (" USING COMPRESSION zstd" if n in ZSTD_COLUMNS else "")
        for n, t in columns
    )


# Zone maps (automatic min/max per row group) already prune by start_ns because spans
# arrive roughly in time order; the explicit index serves the lookups diagnosis makes
# by job and span name.
_DDL = [
    "CREATE TABLE IF NOT EXISTS flare_meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
    f"CREATE TABLE IF NOT EXISTS spans ({_column_ddl(SPAN_SQL_COLUMNS)})",
    f"CREATE TABLE IF NOT EXISTS metrics ({_column_ddl(METRIC_SQL_COLUMNS)})",
    "CREATE INDEX IF NOT EXISTS spans_job_name ON spans (job, name)",
]


class StoreError(Exception):
    """A store problem a user can act on; the message is one sentence."""


class StoreLocked(StoreError):
    pass


class StoreFull(StoreError):
    """A write failed for want of space (the disk, a quota or the file size limit)."""


# The C library's words for running out of room, which DuckDB's I/O errors quote.
_NO_ROOM = {os.strerror(errno.ENOSPC): "the disk is full",
            os.strerror(errno.EDQUOT): "the disk quota is used up",
            os.strerror(errno.EFBIG): "the file size limit is reached"}


def no_space(path: str | os.PathLike[str], exc: BaseException) -> StoreFull | None:
    """A write error as a StoreFull naming the cause (and the space left), or None when
    it is another error."""
    reason = next((r for r in _NO_ROOM if r in str(exc)), None)
    if reason is None:
        return None
    text = f"{_NO_ROOM[reason]} ({reason}) writing {path}"
    if reason != os.strerror(errno.EFBIG):  # (the disk itself may have room)
        with contextlib.suppress(OSError):
            text += f"; {shutil.disk_usage(Path(path).parent).free / (1 << 20):.1f} MiB free"
    return StoreFull(text)


def _check_regular(path: Path) -> None:
    """Refuse a store (or its DuckDB log) that is a FIFO, a device or a directory:
    opening one would block forever or read endless bytes."""
    for candidate in (path, path.with_name(path.name + ".wal")):
        if candidate.exists() and not candidate.is_file():
            raise StoreError(f"store {candidate} is not a regular file")


# The first bytes of a SQLite database: DuckDB opens such a file through its sqlite
# extension, downloading it first when it is not installed.
_SQLITE_HEADER = b"SQLite format 3\x00"


def _check_not_sqlite(path: Path) -> None:
    """Refuse a SQLite database before DuckDB sees it (seen: `flare jobs --store` on
    one waited ~2 s for a download of the sqlite_scanner extension, then failed with
    DuckDB's download error). Checked here rather than by opening DuckDB with extension
    auto-loading off: that configuration differs from a plain `duckdb.connect`'s, and
    DuckDB refuses two configurations of one file in one process (clickhouse.load_store
    opens the store plainly while a StoreBackend may hold it)."""
    try:
        with open(path, "rb") as file:
            head = file.read(len(_SQLITE_HEADER))
    except OSError:
        return  # (missing or unreadable: DuckDB says which)
    if head == _SQLITE_HEADER:
        raise StoreError(f"{path} is not a Flare store: it is a SQLite database file")


def _duckdb_path(path: Path) -> str:
    """`path` as DuckDB must be given it: a relative path whose first part holds a colon
    goes with "./", or DuckDB reads "NAME:…" as a database of its NAME extension (seen:
    `--store sqlite:x.duckdb` waited for a download of the sqlite extension; `odd:x.duckdb`
    could not be opened at all). Other paths as given: a path spelt differently would be a
    second DuckDB instance of the same file in one process."""
    if not path.is_absolute() and path.parts and ":" in path.parts[0]:
        return os.path.join(os.curdir, str(path))
    return str(path)


def _connect(path: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    _check_regular(path)
    _check_not_sqlite(path)
    try:
        return duckdb.connect(_duckdb_path(path), read_only=read_only)
    except (duckdb.IOException, duckdb.ConnectionException) as exc:
        text = str(exc)
        # Another process holds the file ("lock"), or this process holds it with the
        # other mode ("different configuration"): both clear once that flush ends.
        if "lock" in text.lower() or "different configuration" in text:
            raise StoreLocked(f"store {path} is held by another process") from exc
        if "not a valid DuckDB database" in text:
            raise StoreError(_unreadable(path, exc)) from exc
        raise StoreError(f"cannot open store {path}: {text.splitlines()[0]}") from exc
    except duckdb.Error as exc:
        raise StoreError(_unreadable(path, exc)) from exc


def is_store_error(exc: BaseException) -> bool:
    """An error DuckDB raised (a damaged file shows only when a query reaches it)."""
    return isinstance(exc, duckdb.Error)


def is_interrupt(exc: BaseException) -> bool:
    """DuckDB's form of a Ctrl-C that arrived during a query (an InterruptException, or
    while its result streams to Arrow, a RuntimeError saying so)."""
    return isinstance(exc, duckdb.InterruptException) or (
        isinstance(exc, RuntimeError) and str(exc).startswith("Query interrupted"))


def _unreadable(path: Path, exc: Exception) -> str:
    """One line for a file DuckDB cannot read: not a DuckDB file at all, or a damaged
    one (truncated, overwritten blocks)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "not a valid DuckDB database" in text:
        return f"{path} is not a Flare store: {text}"
    return f"store {path} is damaged or unreadable: {text}"


def _check_version(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    try:
        _check_schema_version(con, path)
    except duckdb.Error as exc:  # blocks are read lazily: a damaged file fails here
        raise StoreError(_unreadable(path, exc)) from exc


def _check_schema_version(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "spans" not in tables or "flare_meta" not in tables:
        raise StoreError(f"{path} is not a Flare store (no spans table)")
    row = con.execute("SELECT value FROM flare_meta WHERE key = 'schema_version'").fetchone()
    try:
        version = int(row[0]) if row else 0
    except (TypeError, ValueError):
        raise StoreError(
            f"store {path} has a damaged schema_version ({row[0]!r} in flare_meta, "
            f"expected a whole number)"
        ) from None
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"store {path} was written by a newer Flare (schema {version}, this one reads "
            f"up to {SCHEMA_VERSION}); upgrade Flare to read it"
        )


def create_or_open(
    path: str | os.PathLike[str], ensure_schema: bool = True, create_directory: bool = False
) -> duckdb.DuckDBPyConnection:
    """Open `path` for writing, creating the file and schema when absent.

    `ensure_schema=False` skips the checks and DDL (about 5 ms of a ~40 ms open): for a
    writer that already checked this very file in an earlier open. A missing directory
    is an error (a mistyped path must not leave directories behind) unless
    `create_directory`.
    """
    path = Path(path)
    if create_directory:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.parent.is_dir():
        raise StoreError(f"the directory of store {path} does not exist")
    con = _connect(path, read_only=False)
    if not ensure_schema:
        return con
    try:
        tables = {
            r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()
        }
        if tables and "spans" in tables:
            _check_version(con, path)
        elif tables - {"flare_meta"}:
            raise StoreError(f"{path} is a DuckDB file but not a Flare store")
        for ddl in _DDL:
            con.execute(ddl)
        con.execute(
            "INSERT OR IGNORE INTO flare_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)]
        )
    except BaseException:
        con.close()
        raise
    return con


def open_reader(
    path: str | os.PathLike[str], timeout_s: float = 10.0
) -> duckdb.DuckDBPyConnection:
    """Open an existing store read-only, waiting out a writer's short flush."""
    path = Path(path)
    if not path.exists():
        raise StoreError(f"store {path} does not exist")
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        try:
            con = _connect(path, read_only=True)
            break
        except StoreLocked:
            if time.monotonic() >= deadline:
                raise StoreLocked(
                    f"store {path} stayed locked by a writer for {timeout_s:.0f} s"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
    try:
        _check_version(con, path)
    except BaseException:
        con.close()
        raise
    return con


@contextlib.contextmanager
def writer(
    path: str | os.PathLike[str], timeout_s: float = 10.0, ensure_schema: bool = True,
    create_directory: bool = False,
) -> Iterator[duckdb.DuckDBPyConnection]:
    """Hold the store for writing for the duration of one flush."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        try:
            con = create_or_open(path, ensure_schema=ensure_schema,
                                 create_directory=create_directory)
            break
        except StoreLocked:
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
    try:
        yield con
    finally:
        con.close()


def spans_table(columns: Mapping[str, Sequence[object]]) -> pa.Table:
    """Build an Arrow table in the span schema; missing columns become NULL."""
    import pyarrow as pa

    n = len(next(iter(columns.values()))) if columns else 0
    arrays = []
    for name, _, typ in _arrow("SPAN_COLUMNS"):
        values = columns.get(name)
        arrays.append(pa.array(values if values is not None else [None] * n, type=typ))
    return pa.Table.from_arrays(arrays, schema=_arrow("SPAN_SCHEMA"))


def metrics_table(columns: Mapping[str, Sequence[object]]) -> pa.Table:
    import pyarrow as pa

    n = len(next(iter(columns.values()))) if columns else 0
    arrays = []
    for name, _, typ in _arrow("METRIC_COLUMNS"):
        values = columns.get(name)
        arrays.append(pa.array(values if values is not None else [None] * n, type=typ))
    return pa.Table.from_arrays(arrays, schema=_arrow("METRIC_SCHEMA"))


def insert_spans(con: duckdb.DuckDBPyConnection, table: pa.Table) -> int:
    if table.num_rows == 0:
        return 0
    con.register("_flare_batch", table)
    try:
        con.execute("INSERT INTO spans SELECT * FROM _flare_batch")
    finally:
        con.unregister("_flare_batch")
    return table.num_rows


def insert_metrics(con: duckdb.DuckDBPyConnection, table: pa.Table) -> int:
    if table.num_rows == 0:
        return 0
    con.register("_flare_mbatch", table)
    try:
        con.execute("INSERT INTO metrics SELECT * FROM _flare_mbatch")
    finally:
        con.unregister("_flare_mbatch")
    return table.num_rows
