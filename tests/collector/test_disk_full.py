"""A store disk that fills up, on a real collector process.

Two real ways to run out of room: an 8 MiB tmpfs filled to the last byte (needs root to
mount; skipped otherwise) and the collector's file size limit (RLIMIT_FSIZE, set on the
running process with prlimit: writes past it fail with EFBIG, as Python ignores
SIGXFSZ). Either way the collector's log must name the cause (not DuckDB's "cannot
rollback - no transaction is active"), /metrics must count it, the requests it
acknowledged meanwhile must wait in the write-ahead log (on another disk here), and
once there is room again every one of them is in the store exactly once.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flare.exporters import store

DISK_FULL = "flare_collector_store_disk_full_errors_total"
FLARE = str(Path(sys.executable).parent / "flare")


class Tmpfs:
    """A small tmpfs holding the store; `fill` takes its last byte, `free` gives it back."""

    cause = f"the disk is full ({os.strerror(errno.ENOSPC)})"
    space_left = r"; \d+\.\d MiB free"

    def __init__(self, directory: Path) -> None:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        directory.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(directory)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
        self.directory = directory
        self.filler = directory / "filler"

    def fill(self, proc=None) -> None:
        with open(self.filler, "wb") as out:
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC

    def free(self, proc=None) -> None:
        self.filler.unlink()

    def close(self) -> None:
        subprocess.run(["umount", str(self.directory)], check=True)


class FileSizeLimit:
    """The store's file may not grow past its size when `fill` is called."""

    cause = f"the file size limit is reached ({os.strerror(errno.EFBIG)})"
    space_left = ""  # the disk has room: its free space would only mislead

    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        self.directory = directory

    def fill(self, proc) -> None:
        size = (self.directory / "store.duckdb").stat().st_size
        resource.prlimit(proc.proc.pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

    def free(self, proc) -> None:
        resource.prlimit(proc.proc.pid, resource.RLIMIT_FSIZE,
                         (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    def close(self) -> None:
        pass


@pytest.fixture(params=[Tmpfs, FileSizeLimit], ids=["tmpfs", "file-size-limit"])
def disk(request, tmp_path):
    disk = request.param(tmp_path / "disk")
    yield disk
    disk.close()


def _send(helpers, proc, first_index: int, spans: int = 500) -> set[str]:
    request = helpers.make_request(spans, first_index=first_index)
    status, _, _ = helpers.post(f"http://{proc.http}/v1/traces", request.SerializeToString())
    assert status == 200
    return {s.span_id.hex() for s in request.resource_spans[0].scope_spans[0].spans}


def _wait_committed(proc) -> None:
    last = proc.scrape()["flare_collector_wal_last_lsn"]
    proc.wait_for("flare_collector_wal_committed_lsn", lambda v: v >= last)


def test_a_full_disk_is_named_counted_and_loses_nothing(disk, collector_process, helpers,
                                                        tmp_path):
    config = helpers.base_config(disk.directory / "store.duckdb")
    config["extensions"]["flare_wal"]["directory"] = str(tmp_path / "ingest-wal")  # another disk
    proc = collector_process(config)
    try:
        proc.start()
        acknowledged = _send(helpers, proc, 0)
        _wait_committed(proc)
        assert proc.scrape()[DISK_FULL] == 0

        disk.fill(proc)
        # The collector goes on acknowledging into its log while flushes fail.
        deadline = time.monotonic() + 30
        index = 500
        while proc.scrape()[DISK_FULL] == 0:
            assert time.monotonic() < deadline, proc.log()
            acknowledged |= _send(helpers, proc, index)
            index += 500
            time.sleep(0.2)
        acknowledged |= _send(helpers, proc, index)
        proc.wait_for(DISK_FULL, lambda v: v >= 2)  # counted per failed flush
        log = proc.log()
        said = re.escape(f"could not flush: {disk.cause} writing {proc.store_path}") + disk.space_left
        assert re.search(said + "; the rows stay in the write-ahead log and are retried", log), log
        assert "cannot rollback" not in log
        assert log.count("could not flush") == 1  # once per spell, not per flush
        # DuckDB's own log stays empty: the commits checkpoint into the file.
        wal = disk.directory / "store.duckdb.wal"
        assert not wal.exists() or wal.stat().st_size < 4096

        disk.free(proc)
        _wait_committed(proc)
        assert "exporter flare_store flushes again" in proc.log()
        assert proc.terminate() == 0
    finally:
        proc.stop_if_running()
    ids = helpers.stored_span_ids(proc.store_path)
    assert len(ids) == len(set(ids))  # exactly once
    assert set(ids) == acknowledged  # nothing acknowledged is lost


def _kineto_trace(directory: Path, rank: int) -> Path:
    directory.mkdir()
    (directory / f"rank{rank}.json").write_text(json.dumps({
        "schemaVersion": 1, "distributedInfo": {"rank": rank},
        "traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1",
                         "pid": 1, "tid": 1, "ts": 100, "dur": 50}]}))
    return directory


def test_import_kineto_on_a_full_disk_names_it_and_keeps_what_is_stored(tmp_path):
    """Its failed COMMIT ended the transaction: the error is the commit's, not the
    ROLLBACK's "no transaction is active"."""
    disk = Tmpfs(tmp_path / "disk")
    try:
        path = disk.directory / "store.duckdb"

        def flare_import(rank: int) -> subprocess.CompletedProcess:
            traces = _kineto_trace(tmp_path / f"rank{rank}", rank)
            return subprocess.run([FLARE, "import-kineto", str(traces), "--store", str(path),
                                   "--job", "j"], capture_output=True, text=True, timeout=60)

        assert flare_import(0).returncode == 0
        disk.fill()
        result = flare_import(1)
        assert result.returncode != 0
        said = re.escape(f"flare: error: the disk is full ({os.strerror(errno.ENOSPC)}) "
                         f"writing {path}; ") + r"\d+\.\d MiB free"
        assert re.fullmatch(said, result.stderr.strip()), result.stderr
        disk.free()
        con = store.open_reader(path)
        try:
            assert con.execute("SELECT rank, count(*) FROM spans GROUP BY rank").fetchall() == [(0, 1)]
        finally:
            con.close()
    finally:
        disk.close()
