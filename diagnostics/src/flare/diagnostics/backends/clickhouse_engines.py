"""How Flare reaches ClickHouse: an embedded chDB directory or a server over HTTP(S)
(clickhouse-connect). Both answer `arrow(sql, params)` with a `pyarrow.Table` and turn
the engine's errors into one-line `BackendError`s; the SQL is `clickhouse.py`'s."""

from __future__ import annotations

import logging
import os
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from flare.diagnostics.backends.base import BackendError
from flare.wire import semconv as sc

# clickhouse-connect logs "Unexpected Http Driver Exception" before raising, which
# Python's last-resort handler printed as a second line above Flare's one-line error.
logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())


class Chdb:
    """An embedded chDB directory. chDB serves one directory per process: backends on
    the same directory share its session, which closes with the last of them."""

    _lock = threading.Lock()
    _open: dict[str, list] = {}  # resolved path → [session, users]

    def __init__(self, path: str) -> None:
        if not Path(path).is_dir():
            if Path(path).exists():  # (seen: a DuckDB store named here read "does not exist")
                raise BackendError(f"chDB needs a directory and {path} is not one "
                                   "(a Flare store file is read with --store PATH)")
            raise BackendError(f"chDB directory {path} does not exist")
        try:
            from chdb import session
        except ImportError:
            raise BackendError("the chdb backend needs the chdb package (pip install chdb)") from None
        self.where = f"chDB at {path}"
        self._path = str(Path(path).resolve())
        with self._lock:
            entry = self._open.get(self._path)
            if entry is None:
                if self._open:
                    raise BackendError(f"chDB opens one directory per process and "
                                       f"{next(iter(self._open))} is open")
                opened = _open_session(session, self._path, self.where)
                # Arrow handed over in-process needs no compression: ClickHouse's default
                # lz4_frame cost the bucketed step summary of an hour of 1,024 ranks 5.2-7.2 s
                # against 2.5 s without (compressed by chDB, decompressed by pyarrow).
                opened.query("SET output_format_arrow_compression_method = 'none'")
                # A GROUP BY past 400 MB of state spills to disk rather than growing this
                # process: the step summary of an hour of 6,144 ranks peaked at 1,863 MiB
                # in 20.3 s, 1,141 MiB in 23.7 s with it (1,024 ranks: 1,636 against
                # 1,132 MiB, 5.9 against 5.3 s).
                opened.query("SET max_bytes_before_external_group_by = 400000000")
                entry = self._open[self._path] = [opened, 0]
            entry[1] += 1
        self._session = entry[0]
        self._closed = False

    def arrow(self, sql: str, params: dict[str, Any]):
        # chDB hands parameters to ClickHouse as escaped text (TSV rules)
        text = {k: str(v).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
                for k, v in params.items()}
        # Arrow's file format read here: chDB's own "ArrowTable" output imports pandas
        # for it (0.3-0.7 s and ~60 MB of a diagnosis that never uses it).
        import pyarrow as pa

        with self._lock:
            if self._closed:
                raise BackendError(f"{self.where} is closed")
            try:
                result = self._session.query(sql, "Arrow", params=text)
            except RuntimeError as exc:  # chdb.ChdbError
                raise BackendError(f"{self.where}: {first_line(exc)}") from None
            # Copied out of the engine's result buffer before anything else runs on the
            # session: uncompressed, the table's arrays would point into that buffer,
            # which a later query reuses (an hour of 6,144 ranks read back ranks such as
            # -2145668583 once the next queries had run).
            data = b"" if len(result) == 0 else result.get_memview().tobytes()
            del result
            # The engine's allocator keeps what a query used for the next one: after the
            # step summary of an hour of 1,024 ranks, 900 MB of this process (1,439 MiB
            # resident, 547 after the purge). Purging takes under a millisecond.
            try:
                self._session.query("SYSTEM JEMALLOC PURGE")
            except RuntimeError:  # an engine built without jemalloc
                pass
        if not data:
            return pa.table({})
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entry = self._open[self._path]
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[self._path]
                entry[0].close()


def _open_session(session, path: str, where: str):
    """chDB's session; its engine prints why it cannot start on stderr itself (a second
    process on the directory): that text goes into the one-line error instead."""
    import tempfile

    with tempfile.TemporaryFile() as said:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(said.fileno(), 2)
        try:
            return session.Session(path)
        except RuntimeError as exc:
            said.seek(0)
            printed = said.read().decode(errors="replace")
            if "Another server instance" in printed or "Cannot lock file" in printed:
                raise BackendError(f"{where} is in use by another process (chDB opens a "
                                   "directory from one process at a time)") from None
            raise BackendError(f"cannot open {where}: {first_line(exc)}") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class Http:
    """A ClickHouse server over HTTP(S), through clickhouse-connect."""

    def __init__(self, url: str, database: str) -> None:
        try:
            parsed = urllib.parse.urlsplit(url)
            port = parsed.port
        except ValueError as exc:
            raise BackendError(f"ClickHouse URL {url!r} is not http(s)://HOST:PORT/DB "
                               f"({str(exc).lower()})") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise BackendError(f"ClickHouse URL {url!r} is not http(s)://HOST:PORT/DB")
        try:
            import clickhouse_connect
            from clickhouse_connect.driver.exceptions import ClickHouseError
        except ImportError:
            raise BackendError("the clickhouse backend needs clickhouse-connect "
                               "(pip install clickhouse-connect)") from None
        self._errors = (ClickHouseError,)
        secure = parsed.scheme == "https"
        self.where = f"ClickHouse at {parsed.scheme}://{parsed.hostname}:{port or (8443 if secure else 8123)}"
        env = os.environ.get
        token = env(sc.ENV_BACKEND_TOKEN) or None
        options: dict[str, Any] = {
            "host": parsed.hostname, "port": port or (8443 if secure else 8123),
            "database": database, "secure": secure,
            "username": urllib.parse.unquote(parsed.username or "") or env(sc.ENV_BACKEND_USER) or "default",
            "password": urllib.parse.unquote(parsed.password or "") or env(sc.ENV_BACKEND_PASSWORD) or "",
            "connect_timeout": 10, "send_receive_timeout": 300, "compress": True,
        }
        if token:
            options["access_token"] = token
        if secure:
            options |= {"ca_cert": env(sc.ENV_BACKEND_CA_FILE) or None,
                        "client_cert": env(sc.ENV_BACKEND_CERT_FILE) or None,
                        "client_cert_key": env(sc.ENV_BACKEND_KEY_FILE) or None}
        try:
            self._client = clickhouse_connect.get_client(**options)
        except ClickHouseError as exc:
            raise BackendError(f"cannot reach {self.where}: {_os_reason(exc) or first_line(exc)}") from None

    def arrow(self, sql: str, params: dict[str, Any]):
        try:
            return self._client.query_arrow(sql, parameters=params)
        except self._errors as exc:
            raise BackendError(f"{self.where}: {first_line(exc)}") from None

    def close(self) -> None:
        self._client.close()


def _os_reason(exc: BaseException) -> str | None:
    """The socket's own reason under a driver's wrapping ("Connection refused", not
    urllib3's 300 characters of pool, URL and query id)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
