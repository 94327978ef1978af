"""Where `flare diagnose -o FILE` may write: never over a store, and a bad path is one
line (with `--follow` too, which opens FILE before it starts)."""

from __future__ import annotations

import pytest

from flare.diagnostics.cli import main
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store as flare_store


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s.duckdb"
    with flare_store.writer(path) as con:
        flare_store.insert_spans(con, job_spans("slow", 4, 40, (Fault("compute", 2, 10),)))
    return path


@pytest.mark.parametrize("fmt", ["text", "json", "html"])
def test_a_report_is_never_written_over_a_store(store, tmp_path, capsys, fmt):
    other = tmp_path / "other.duckdb"
    with flare_store.writer(other) as con:
        flare_store.insert_spans(con, job_spans("ok", 2, 20))
    for target in (store, other):
        before = target.read_bytes()
        assert main(["diagnose", "--store", str(store), "--format", fmt, "-o", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"flare: error: will not write the report over {target}: it is a DuckDB store")
        assert err.count("\n") == 1 and "Traceback" not in err
        assert target.read_bytes() == before
    assert main(["diagnose", "--store", str(store), "--job", "slow"]) == 0  # still a store


def test_follow_output_that_cannot_be_written_is_one_line(store, tmp_path, capsys):
    for target, reason in ((tmp_path / "no" / "r.txt", "no directory"), (tmp_path, "it is a directory")):
        assert main(["diagnose", "--store", str(store), "--job", "slow", "--follow",
                     "-o", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"flare: error: cannot write {target}: {reason}"), err
        assert "Traceback" not in err
    before = store.read_bytes()
    assert main(["diagnose", "--store", str(store), "--job", "slow", "--follow", "-o", str(store)]) == 1
    assert "is a DuckDB store" in capsys.readouterr().err
    assert store.read_bytes() == before


def test_a_failed_grpc_write_back_names_the_protocol_and_the_http_url(store, capsys):
    """`http://HOST:PORT` is OTLP/gRPC; a user who meant the OTLP/HTTP port is told so."""
    assert main(["diagnose", "--store", str(store), "--job", "slow", "--write-back",
                 "--otlp-endpoint", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flare: error: cannot send anomalies over OTLP/gRPC to 127.0.0.1:9: "), err
    assert "http://127.0.0.1:9/v1/traces" in err and err.count("\n") == 1


@pytest.mark.parametrize("job", ["", "   "])
def test_import_kineto_refuses_an_empty_job_name(tmp_path, capsys, job):
    """As `flare run` does: "" was imported under the directory's name, "   " as a job
    with a blank name."""
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "rank0.json").write_text('{"schemaVersion": 1, "traceEvents": []}')
    target = tmp_path / "k.duckdb"
    assert main(["import-kineto", str(traces), "--store", str(target), "--job", job]) == 1
    assert capsys.readouterr().err == (f"flare: error: --job {job!r} is empty: name the job, or "
                                       "leave --job out for the directory's name\n")
    assert not target.exists()


def test_output_to_a_fifo_is_written_not_read(store, tmp_path):
    """Only a regular file is looked into for the DuckDB check: reading a FIFO (or
    `-o /dev/stdout` into a pipe) to check it would block the report forever."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--store",
                                 str(store), "--job", "slow", "--format", "json", "-o", str(fifo)],
                                capture_output=True, text=True, timeout=60)
        out, _ = reader.communicate(timeout=30)
    finally:
        reader.kill()
        reader.wait()
    assert result.returncode == 0, result.stderr
    assert '"job": "slow"' in out


def test_the_time_table_keeps_its_columns_under_a_long_cause():
    """"hang (software)" (15 characters) pushed its row's seconds one column right of
    the heading's; the cause column is as wide as its widest cause."""
    from flare.diagnostics.report_text import _time_table

    rows = [{"who": "rank 1", "cause": "hang (communication)", "kind": "hang", "seconds": 21.77,
             "share": 0.985},
            {"who": "no label (noise, short stalls)", "cause": "-", "kind": "-", "seconds": 0.12,
             "share": 0.005}]
    heading, *lines = _time_table(rows)[2:]
    end = heading.index("SECONDS") + len("SECONDS")
    assert [line[end - 5:end] for line in lines] == ["21.77", " 0.12"]
    assert len({len(line) for line in (heading, *lines)}) == 1


def test_flare_run_refuses_its_store_as_its_report_before_the_job_runs(tmp_path, capsys):
    """`flare run --store S -o S`: found out before the job runs (the store need not exist
    yet), not after it, when the report would be lost (or, before, the store)."""
    marker = tmp_path / "ran"
    for target in (tmp_path / "new.duckdb", tmp_path / "new.duckdb"):
        assert main(["run", "--store", str(target), "-o", str(target), "--",
                     "python3", "-c", f"open({str(marker)!r}, 'w')"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"flare: error: will not write the report over {target}"), err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "new.duckdb").exists()
