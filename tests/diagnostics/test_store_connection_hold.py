"""The store backend keeps its read-only connection only briefly, and never past exit.

A diagnosis asks a dozen small queries; `StoreBackend` re-uses one connection for those
within `hold_s` of opening it, so a writer (the collector, a write-back) waits at most
that long, and a large result releases it at once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from flare.diagnostics.backends import store as store_backend
from flare.diagnostics.backends.store import StoreBackend
from flare.exporters import store as flare_store


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store.duckdb"
    with flare_store.writer(path) as con:
        con.execute("INSERT INTO spans (job, name, start_ns) VALUES ('j', 'train.step', 1)")
    return path


def _writable(path) -> bool:
    try:
        with flare_store.writer(path, timeout_s=0.0):
            return True
    except flare_store.StoreLocked:
        return False


def test_queries_share_a_connection_and_a_writer_gets_in_after_hold_s(store_path, monkeypatch):
    # Held whatever the host's load: no query counts as long (a slow one releases), and
    # the hold outlasts a descheduled test thread.
    monkeypatch.setattr(store_backend, "_RELEASE_AFTER_S", 60.0)
    backend = StoreBackend(store_path, hold_s=1.0)
    held = backend._con
    assert held is not None and backend.jobs() == ["j"] and backend._con is held
    assert not _writable(store_path)  # held: a writer waits (as for one long query)
    deadline = time.monotonic() + 15  # (the release timer's thread, on a loaded host)
    while backend._con is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend._con is None and _writable(store_path)  # the timer let go
    assert backend.jobs() == ["j"]  # and the next query opens again
    backend.close()
    assert backend._con is None and _writable(store_path)


def test_a_large_result_or_hold_zero_releases_at_once(store_path):
    backend = StoreBackend(store_path, hold_s=0)
    assert backend._con is None and backend.jobs() == ["j"] and backend._con is None
    backend = StoreBackend(store_path, hold_s=30, release_after_bytes=1)
    assert backend._con is None and _writable(store_path)


def test_exit_waits_for_a_timer_closing_the_connection(store_path, tmp_path):
    """A timer thread still closing the connection when the interpreter exits would be
    stopped inside DuckDB (the process aborts); exit waits for it instead."""
    marker = tmp_path / "closed"
    script = textwrap.dedent(f"""
        import time
        from flare.diagnostics.backends import store

        # The constructor's first query must leave the connection held: on a busy host
        # it can take over the 0.1 s after which a query releases it (seen in CI).
        store._RELEASE_AFTER_S = 60.0

        class SlowClose:  # the real connection, with a close that takes 0.4 s
            def __init__(self, con):
                self.con = con
            def cursor(self):
                return self.con.cursor()
            def close(self):
                time.sleep(0.4)
                self.con.close()
                open({str(marker)!r}, "w").write("closed")

        backend = store.StoreBackend({str(store_path)!r}, hold_s=0.2)
        assert backend._con is not None
        backend._con = SlowClose(backend._con)
        time.sleep(0.35)  # exit while the timer (fired at 0.2 s) is inside close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "closed"
