"""What every `flare` command shares: the default store, the one-line user error,
and writing a report where it was asked for (`cli` and `run` both use them; neither
imports the other for them)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flare.diagnostics.model import DiagnosisConfig

DEFAULT_STORE = os.path.join(".flare", "store.duckdb")


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


def _is_duckdb_file(path: str) -> bool:
    """A DuckDB database file: its magic `DUCK` follows the 8-byte checksum. Only a
    regular file is read (`-o /dev/stdout` into a pipe, or a FIFO, would block)."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(12)[8:12] == b"DUCK"
    except OSError:
        return False


def check_output(path: str, store: str | None = None) -> None:
    """-o FILE can take a report: not a directory, in a directory that exists and can be
    written (and so can the file, if it exists), not `store`, and not a DuckDB file
    (seen: `-o` naming the store replaced every job it held with the report). Checked
    before the diagnosis (before the job, under `flare run`, whose store may not exist
    yet), and again just before writing."""
    if os.path.isdir(path):
        raise UserError(f"cannot write {path}: it is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UserError(f"cannot write {path}: no directory {directory}")
    if not os.access(path if os.path.exists(path) else directory, os.W_OK):
        raise UserError(f"cannot write {path}: permission denied")
    if (store is not None and os.path.abspath(path) == os.path.abspath(store)) or _is_duckdb_file(path):
        raise UserError(f"will not write the report over {path}: it is a DuckDB store "
                        "(every job in it would be lost); name another file with -o")


def open_report(path: str):
    """-o FILE checked (`check_output`) and opened for writing; a failure is the
    one-line error."""
    check_output(path)
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def emit(diagnosis, job_data, config: DiagnosisConfig, fmt: str, output: str | None) -> None:
    if fmt == "json":
        text = json.dumps(diagnosis.to_json(), indent=2) + "\n"
    elif fmt == "html":
        from flare.diagnostics import report_html

        text = report_html.render(diagnosis, diagnosis.job_data or job_data, config)
    else:
        from flare.diagnostics import report_text

        colour = output is None and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        text = report_text.render(diagnosis, colour=colour)
    if output:
        with open_report(output) as handle:
            try:
                handle.write(text)
            except OSError as exc:
                raise UserError(f"cannot write {output}: {exc.strerror}") from None
        if fmt != "text":
            print(f"flare: wrote {fmt} report to {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
