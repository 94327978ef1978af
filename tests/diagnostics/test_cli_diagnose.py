"""`flare diagnose` over real DuckDB stores filled with synthetic spans of known faults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flare.diagnostics.cli import main
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store as flare_store


def _store(path, *tables):
    with flare_store.writer(path) as con:
        for table in tables:
            flare_store.insert_spans(con, table)
    return path


@pytest.fixture
def straggler_store(tmp_path):
    return _store(tmp_path / "s.duckdb", job_spans("slow", 4, 60, (Fault("compute", 2, 20),)))


def test_json_contract(straggler_store, capsys):
    assert main(["diagnose", "--store", str(straggler_store), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"] == "slow"
    assert report["backend"] == f"store:{straggler_store}"
    assert report["steps"] == {"first": 0, "last": 59}
    kinds = {a["kind"]: a for a in report["anomalies"]}
    straggler = kinds["straggler"]
    assert straggler["ranks"] == [2] and straggler["cause"] == "compute"
    assert straggler["first_step"] == 20
    assert set(straggler) >= {"kind", "ranks", "cause", "first_step", "last_step", "impact",
                              "confidence", "callsite", "summary", "evidence", "trace_ids"}
    assert straggler["trace_ids"] and len(straggler["trace_ids"][0]) == 32


def test_healthy_job_has_empty_list(tmp_path, capsys):
    path = _store(tmp_path / "h.duckdb", job_spans("ok", 4, 60))
    assert main(["diagnose", "--store", str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["anomalies"] == []
    assert main(["diagnose", "--store", str(path)]) == 0
    assert "No anomalies found." in capsys.readouterr().out


def test_text_is_plain_when_not_a_tty(straggler_store, capsys):
    assert main(["diagnose", "--store", str(straggler_store)]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert "straggler" in out and "compute" in out and "rank 2" in out


def test_html_is_self_contained(straggler_store, tmp_path):
    out = tmp_path / "report.html"
    assert main(["diagnose", "--store", str(straggler_store), "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!doctype html>")
    assert "data:image/png;base64," in page and "<svg" in page
    assert "straggler" in page
    for outside in ("http://", "https://", "<link", "<script src"):
        assert outside not in page.replace("http://www.w3.org/2000/svg", "")


def test_write_back_is_idempotent(straggler_store, capsys):
    for _ in range(2):
        assert main(["diagnose", "--store", str(straggler_store), "--write-back", "--format", "json"]) == 0
    count = len(json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")["anomalies"])
    con = flare_store.open_reader(straggler_store)
    try:
        rows = con.execute("SELECT attributes, links, trace_id FROM spans WHERE name = 'flare.anomaly'").fetchall()
    finally:
        con.close()
    assert len(rows) == count
    attributes = json.loads(rows[0][0])
    assert attributes["flare.anomaly.kind"] in ("straggler", "fail_slow")
    assert json.loads(rows[0][1])  # linked to evidence spans


def test_regression_against_baseline(tmp_path, capsys):
    path = _store(tmp_path / "r.duckdb", job_spans("base", 4, 60),
                  job_spans("new", 4, 60, (Fault("communication", 0, 0),), comm_ms=10))
    assert main(["diagnose", "--store", str(path), "--job", "new", "--baseline-job", "base",
                 "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    regression = [a for a in report["anomalies"] if a["kind"] == "regression"]
    assert regression and regression[0]["cause"] == "communication"
    assert "communication" in regression[0]["summary"]


def test_a_regression_a_straggler_explains_is_that_stragglers_evidence(tmp_path, capsys):
    """Rank 1 slower from step 20 of a job whose baseline had no such rank: the
    straggler is the whole of the regression against the baseline, one label (a new
    user's sleeping rank read as a straggler, 78 %, and "regression all compute", 88 %,
    on top). A regression with no such label stays one."""
    path = _store(tmp_path / "r.duckdb", job_spans("base", 4, 60),
                  job_spans("new", 4, 60, (Fault("compute", 1, 10, extra_ms=60.0),)))
    assert main(["diagnose", "--store", str(path), "--job", "new", "--baseline-job", "base",
                 "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(a["kind"], a["ranks"]) for a in report["anomalies"]] == [("straggler", [1])]
    [label] = report["anomalies"]
    assert "slower per step than baseline base" in label["evidence"]["regression"]
    assert "; against the baseline: " in label["summary"]


@pytest.mark.parametrize("args, message", [
    (["--store", "{tmp}/missing.duckdb"], "does not exist"),
    (["--store", "{tmp}/two.duckdb"], "holds 2 jobs; choose one with --job: a, b"),
    (["--store", "{tmp}/two.duckdb", "--job", "zzz"], "job 'zzz' is not in"),
    (["--store", "{tmp}/two.duckdb", "--job", "a", "--baseline-job", "zz"],
     "baseline job 'zz' is not in"),
    (["--store", "{tmp}/empty.duckdb"], "holds no jobs"),
    (["--store", "{tmp}/newer.duckdb"], "newer Flare"),
    (["--store", "{tmp}/badversion.duckdb"], "damaged schema_version ('two'"),
    (["--store", "{tmp}/junk.duckdb"], "is not a Flare store"),
    (["--store", "{tmp}/half.duckdb"], "is damaged or unreadable"),
    (["--backend", "jaeger+http://127.0.0.1:9"], ""),
    (["--backend", "jaeger+http://localhost:notaport"], "port"),
    (["--backend", "tempo+http://localhost:99999"], "port"),
    (["--backend", "jaeger+http://[::1"], "http://[::1"),
    (["--store", "{tmp}/two.duckdb", "--job", "a", "--otlp-endpoint", "http://127.0.0.1:9"],
     "--otlp-endpoint is where --write-back or --follow send anomaly spans"),
    (["--backend", "jaeger+http://127.0.0.1:9", "--job", "a", "--write-back"],
     "needs --otlp-endpoint"),
    (["--store", "{tmp}/two.duckdb", "--job", "a", "--write-back", "--otlp-endpoint",
      "http://127.0.0.1:9/v1/traces"],
     "cannot send anomalies to http://127.0.0.1:9/v1/traces: Connection refused"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    _store(tmp_path / "two.duckdb", job_spans("a", 2, 8), job_spans("b", 2, 8))
    _store(tmp_path / "empty.duckdb")
    _store(tmp_path / "newer.duckdb", job_spans("a", 2, 8))
    with flare_store.writer(tmp_path / "newer.duckdb") as con:
        con.execute("UPDATE flare_meta SET value = '99' WHERE key = 'schema_version'")
    _store(tmp_path / "badversion.duckdb", job_spans("a", 2, 8))
    with flare_store.writer(tmp_path / "badversion.duckdb") as con:
        con.execute("UPDATE flare_meta SET value = 'two' WHERE key = 'schema_version'")
    (tmp_path / "junk.duckdb").write_bytes(b"garbage" * 1000)
    whole = _store(tmp_path / "whole.duckdb", job_spans("a", 4, 200)).read_bytes()
    (tmp_path / "half.duckdb").write_bytes(whole[:len(whole) // 2])  # a truncated copy
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", *argv],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert message in lines[0]


def test_unknown_flag_is_a_usage_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--bogus"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr
    assert "Traceback" not in result.stderr
    # said by the subcommand, with its own usage line
    assert "flare diagnose: error:" in result.stderr and "usage: flare diagnose" in result.stderr


def test_a_baseline_that_is_the_job_itself_is_one_line():
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--job",
                             "a", "--baseline-job", "a"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == ("flare: error: --baseline-job is the job being diagnosed; "
                                     "name an earlier job")


def test_a_partial_report_says_so_and_fails(straggler_store, capsys, monkeypatch):
    """A detector that fails (seen: a store damaged in a block only the hang detector's
    query reads) leaves a partial report: it must not read "No anomalies found." nor
    exit 0. The failure is injected into one detector; the others run for real."""
    import duckdb

    from flare.diagnostics.detectors import hang

    def damaged(job, config):
        raise duckdb.IOException("Corrupt database file: computed checksum does not match")

    monkeypatch.setattr(hang, "detect", damaged)
    assert main(["diagnose", "--store", str(straggler_store)]) == 1
    captured = capsys.readouterr()
    assert "PARTIAL REPORT" in captured.out and "hang (IOException: Corrupt" in captured.out
    assert "straggler" in captured.out  # what the others found is still there
    assert captured.err.strip().splitlines()[-1] == (
        "flare: error: the report is partial: 1 detector(s) failed (hang)")
    html = straggler_store.parent / "r.html"
    assert main(["diagnose", "--store", str(straggler_store), "--format", "html", "-o", str(html)]) == 1
    assert "Partial report" in html.read_text()
    assert main(["diagnose", "--store", str(straggler_store), "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out)["detector_errors"] == {
        "hang": "IOException: Corrupt database file: computed checksum does not match"}


def test_a_query_interrupted_while_streaming_is_an_interrupt(straggler_store, capsys, monkeypatch):
    """Ctrl-C while DuckDB streams a result to Arrow surfaces as a RuntimeError("Query
    interrupted"): that is exit 130 and no report, not a detector failure (seen)."""
    from flare.diagnostics.detectors import gpu_idle

    def interrupted(job, config):
        raise RuntimeError("Query interrupted")

    monkeypatch.setattr(gpu_idle, "detect", interrupted)
    assert main(["diagnose", "--store", str(straggler_store)]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == "flare: interrupted"


def test_an_errors_call_site_is_said_once(tmp_path, capsys):
    # The error's summary names its call site; a second "at …" line under it read as
    # where the other ranks failed.
    path = _store(tmp_path / "e.duckdb", job_spans("err", 4, 30, (Fault("error", 2, 20),)))
    assert main(["diagnose", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "error" in out and out.count("train.py:42 in load_shard") == 1, out


def test_flare_jobs_lists_every_job_with_its_steps_and_times(tmp_path, capsys):
    path = tmp_path / "jobs.duckdb"
    _store(path, job_spans("alpha", world=4, steps=20, start_ns=1_700_000_000_000_000_000),
           job_spans("beta", world=2, steps=10, start_ns=1_700_000_100_000_000_000))
    assert main(["jobs", "--store", str(path), "--format", "json"]) == 0
    rows = {r["job"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["alpha"]["ranks"] == 4 and (rows["alpha"]["first_step"], rows["alpha"]["last_step"]) == (0, 19)
    assert rows["beta"]["ranks"] == 2 and rows["beta"]["first_step_time"] == "2023-11-14T22:15:00Z"
    assert main(["jobs", "--store", str(path)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("JOB") and [line.split()[0] for line in text[1:]] == ["alpha", "beta"]
    assert main(["jobs", "--store", str(tmp_path / "missing.duckdb")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_an_unknown_backend_scheme_is_named_with_the_known_ones(tmp_path):
    """Seen: `--backend bogus:xyz` said "store bogus:xyz does not exist", read as a path."""
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--backend",
                             "bogus:xyz"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "flare: error: unknown backend scheme 'bogus' in 'bogus:xyz' (known: store, jaeger, tempo, "
        "clickhouse, chdb): use store:PATH, jaeger+http(s)://HOST:PORT, tempo+http(s)://HOST:PORT, "
        "clickhouse+http(s)://HOST:PORT/DB or chdb:PATH")
    # a store whose file name holds a colon is still a store
    _store(tmp_path / "odd:name.duckdb", job_spans("a", 2, 8))
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "jobs", "--backend",
                             "odd:name.duckdb"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split()[0] == "a"


@pytest.mark.parametrize("command", ["jobs", "diagnose"])
def test_a_sqlite_file_is_not_a_store_and_nothing_is_downloaded(tmp_path, command):
    """Seen: a SQLite file as the store made DuckDB download its sqlite_scanner extension
    (a 3 s wait, then an IO Error about the download). HOME is the test's own, so an
    extension installed on this machine cannot hide that."""
    import os
    import sqlite3

    path = tmp_path / "sq.duckdb"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    before = path.read_bytes()
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", command, "--store", str(path)],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.strip() == f"flare: error: {path} is not a Flare store: it is a SQLite database file"
    assert not (tmp_path / ".duckdb").exists()  # no extension fetched
    assert path.read_bytes() == before


def test_a_line_waited_on_reads_waiting_in_and_the_heading_says_only_what_follows(tmp_path, capsys):
    """Seen: "at waiting in /tmp/x.py:24 in my_slow_sleep" under a label whose captured
    line was one its rank was blocked on, and a "Where the time went" heading naming
    "framework phase" rows when no phase row followed."""
    from flare.wire import semconv as sc

    rows = {k: [] for k in ("job", "trace_id", "span_id", "name", "start_ns", "end_ns", "duration_ns",
                            "rank", "step", "attributes")}
    for step in range(30, 40):  # rank 2 (the straggler) and a peer, captured
        for rank, frames in ((2, {"waiting in /tmp/x.py:24 in my_slow_sleep": 6, "x.py:5 in main": 1}),
                             (0, {"x.py:5 in main": 1})):
            for key, value in (("job", "slow"), ("trace_id", f"{step:016x}{rank:016x}"),
                               ("span_id", f"{step:08x}{rank:08x}"), ("name", sc.SPAN_CAPTURE),
                               ("start_ns", 1), ("end_ns", 2), ("duration_ns", 1), ("rank", rank),
                               ("step", step)):
                rows[key].append(value)
            rows["attributes"].append(json.dumps({sc.CAPTURE_FRAMES: list(frames),
                                                  sc.CAPTURE_SAMPLES: list(frames.values()),
                                                  sc.CAPTURE_INTERVAL_MS: 10.0}))
    path = _store(tmp_path / "c.duckdb", job_spans("slow", 4, 60, (Fault("compute", 2, 20),)),
                  flare_store.spans_table(rows))
    assert main(["diagnose", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "      waiting in /tmp/x.py:24 in my_slow_sleep: +60 ms/step" in out, out
    assert "at waiting in" not in out
    assert "Where the time went (time the other ranks waited, by culprit):" in out, out
    html = tmp_path / "r.html"
    assert main(["diagnose", "--store", str(path), "--format", "html", "-o", str(html)]) == 0
    assert "<br>waiting in <code>/tmp/x.py:24 in my_slow_sleep" in html.read_text()
