"""A directory of Kineto traces → the store: each file's rows through a CSV file into
one transaction that first deletes what an earlier import of the same (job, rank)
wrote, so importing twice does not double the data and a failure leaves the store as
it was."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flare.exporters import store
from flare.importers.kineto.limits import FileResult, ImportResult, Limits, TraceError
from flare.importers.kineto.trace import brief, read_trace

TRACE_SUFFIXES = (".json", ".json.gz")  # covers torch's *.pt.trace.json[.gz] names


# The store's columns as (name, SQL type), read without loading pyarrow where the store
# module offers them so (the import needs neither Arrow nor its ~25 MB).
SPAN_SQL_COLUMNS: tuple[tuple[str, str], ...] = getattr(store, "SPAN_SQL_COLUMNS", None) or tuple(
    (name, sql) for name, sql, *_ in store.SPAN_COLUMNS)
_INT_SQL = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT"}
_CSV_BLOCK = 1024  # rows formatted at a time


class RowFile:
    """A file's span rows as CSV text in a private temporary file, for DuckDB's reader.

    The rows leave Python before DuckDB opens the store: their memory (and the parse's)
    goes back to the allocator DuckDB then draws from, and neither numpy nor pyarrow is
    loaded (on ws16_rank0 the import peaks at ~105 MB instead of ~118 with a numpy
    batch). The text is unambiguous: every string is quoted (a quote doubled), a NULL is
    an empty unquoted field, and DuckDB reads quoted fields as values (never NULL) with
    each column's type given, so each value is the one the row held.
    """

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        self.rows = len(columns["name"]) if columns else 0
        self._dir = tempfile.mkdtemp(prefix="flare-kineto-")
        self.path = os.path.join(self._dir, "spans.csv")
        self.longest = 0
        try:
            with open(self.path, "w", encoding="utf-8", errors="replace", newline="") as out:
                for start in range(0, self.rows, _CSV_BLOCK):
                    fields = [_csv_fields(columns[name][start:start + _CSV_BLOCK], sql in _INT_SQL)
                              for name, sql in SPAN_SQL_COLUMNS]
                    lines = [",".join(row) for row in zip(*fields, strict=True)]
                    self.longest = max(self.longest, max(map(len, lines)))
                    out.write("\n".join(lines))
                    out.write("\n")
        except BaseException:
            self.remove()
            raise
        columns.clear()

    def insert_into(self, con) -> int:
        """`INSERT INTO spans` the rows (inside the caller's transaction)."""
        if self.rows == 0:
            return 0
        names = ", ".join(name for name, _ in SPAN_SQL_COLUMNS)
        types = ", ".join(f"'{name}': '{sql}'" for name, sql in SPAN_SQL_COLUMNS)
        # A line is at most `longest` characters, up to 4 bytes each in UTF-8; small read
        # buffers (128 KB for ws16_rank0) keep the reader's memory small (-3 MB against 2 MB).
        line_bytes = max(1 << 16, 4 * self.longest + 16)
        con.execute(
            f"INSERT INTO spans ({names}) SELECT {names} FROM read_csv(?, header = false, "
            f"auto_detect = false, delim = ',', quote = '\"', escape = '\"', new_line = '\\n', "
            f"columns = {{{types}}}, allow_quoted_nulls = false, strict_mode = true, "
            f"max_line_size = {line_bytes}, buffer_size = {2 * line_bytes})", [self.path])
        return self.rows

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def _csv_fields(values: list[Any], integer: bool) -> list[str]:
    if integer:
        return ["" if v is None else str(int(v)) for v in values]
    return ["" if v is None else '"' + str(v).replace('"', '""') + '"' for v in values]


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files of a directory (or the one file given), in name order."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir()
                  if p.is_file() and p.name.endswith(TRACE_SUFFIXES))


def import_directory(path: str | os.PathLike[str], store_path: str | os.PathLike[str],
                     job: str | None = None, limits: Limits | None = None,
                     create_directory: bool = False) -> ImportResult:
    """Import every trace file under `path` (or `path` itself) into the store.

    Raises TraceError only when `path` itself is missing or holds no trace file; a file
    that cannot be read (or breaks `limits`, default `Limits()`) gets one error line in
    the result, its rank's spans already stored stay, and the other files still import.
    The store's directory must exist unless `create_directory`.
    """
    import duckdb  # loaded with the store module already

    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    files = trace_files(path)
    if not files:
        raise TraceError(f"{path}: no Kineto trace files (*.json, *.json.gz)")
    job = job or (path.stem.removesuffix(".json") if path.is_file() else path.resolve().name)
    result = ImportResult(job=job, store_path=str(store_path), files=[])
    seen_ranks: dict[int, str] = {}
    for file in files:
        entry = FileResult(path=str(file))
        result.files.append(entry)
        try:
            spans = read_trace(file, job, limits)
        except TraceError as exc:
            entry.error = str(exc)
            continue
        except Exception as exc:  # one file's surprise must not stop the others
            entry.error = f"{file}: cannot import ({type(exc).__name__}: {brief(exc)})"
            continue
        entry.rank, entry.skipped_events = spans.rank, spans.skipped
        if spans.rank in seen_ranks:
            entry.error = (f"{file}: rank {spans.rank} was already imported from "
                           f"{seen_ranks[spans.rank]}; one rank per file")
            continue
        seen_ranks[spans.rank] = str(file)
        row_file = RowFile(spans.columns)  # the rows leave Python before DuckDB opens
        try:
            with store.writer(store_path, create_directory=create_directory) as con:
                # One thread: the insert and its checkpoint peak ~10 MB lower, for a few
                # thousand rows per file no slower.
                con.execute("SET threads = 1")
                con.execute("BEGIN TRANSACTION")
                try:
                    con.execute("DELETE FROM spans WHERE job = ? AND rank = ?", [job, spans.rank])
                    rows = row_file.insert_into(con)
                    con.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(duckdb.Error):  # a failed COMMIT ended it
                        con.execute("ROLLBACK")
                    raise
        except (duckdb.ConversionException, duckdb.InvalidInputException,
                duckdb.OutOfRangeException) as exc:  # this file's values; the store is as it was
            entry.error = f"{file}: the store refused its spans ({brief(exc)})"
            continue
        finally:
            row_file.remove()
        entry.spans, entry.kernels, entry.steps = rows, spans.kernels, spans.steps
    return result
