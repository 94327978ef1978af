"""The ClickHouse backend over a chDB directory: the exporter's `otel_traces` layout,
filled from a real DuckDB store the way otelcol-contrib's exporter writes the same
OTLP, must give what the store gives — every JobData call and every diagnosis."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flare.diagnostics.backends import BackendError, open_backend
from flare.diagnostics.model import DiagnosisConfig
from flare.diagnostics.pipeline import diagnose
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store as flare_store
from flare.wire import semconv as sc

chdb = pytest.importorskip("chdb", reason="chdb is not installed (pip install chdb)")

from flare.diagnostics.backends import clickhouse  # noqa: E402

JOBS = {
    "straggler": (Fault("compute", 2, 20),),
    "gc": (Fault("gc", 1, 25, extra_ms=60),),
    "input": (Fault("input", 3, 20),),
    "communication": (Fault("communication", 0, 30),),
    "error": (Fault("error", 1, 40),),
    "healthy": (),
    "quote's \"job\"": (Fault("compute", 0, 20),),
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(the DuckDB store, the chDB backend holding the same spans)."""
    root = tmp_path_factory.mktemp("clickhouse")
    path = root / "store.duckdb"
    with flare_store.writer(path) as con:
        for seed, (job, faults) in enumerate(JOBS.items()):
            flare_store.insert_spans(con, job_spans(job, 4, 80, faults, seed=seed, hiccups=0.05,
                                                    bytes_per_step=1 << 20))
    backend = clickhouse.create_chdb(root / "chdb")
    assert clickhouse.load_store(backend, path) > 0
    store = open_backend(f"store:{path}")
    yield store, backend
    backend.close()
    store.close()


def _labels(report):
    return [(a.kind, a.ranks, a.cause, a.first_step, a.last_step, a.callsite, round(a.impact, 4))
            for a in report.anomalies]


@pytest.mark.parametrize("job", list(JOBS))
def test_the_same_diagnosis_as_the_store(stores, job):
    store, chdb_backend = stores
    quiet = lambda _: None  # noqa: E731
    expected = diagnose(store.job_data(job), DiagnosisConfig(), warn=quiet)
    got = diagnose(chdb_backend.job_data(job), DiagnosisConfig(), warn=quiet)
    assert _labels(got) == _labels(expected)
    assert (job == "healthy") == (not expected.anomalies)


def test_every_job_data_call_answers_as_the_store_does(stores):
    store, chdb_backend = stores
    assert chdb_backend.jobs() == store.jobs()
    s, c = store.job_data("straggler"), chdb_backend.job_data("straggler")
    for call in ("steps_range", "step_count", "ranks", "world_size", "source"):
        assert getattr(c, call)() == getattr(s, call)(), call
    assert c.count([sc.SPAN_STEP]) == s.count([sc.SPAN_STEP]) == 4 * 80
    assert c.count(["*"]) == s.count(["*"])
    assert c.rank_activity([sc.SPAN_STEP]).to_pylist() == s.rank_activity([sc.SPAN_STEP]).to_pylist()
    keys = [sc.STEP_COMPUTE_MS, sc.STEP_COLLECTIVE_BYTES, sc.STEP_PG_WAIT_MS, sc.STEP_DETAIL]
    args = dict(first_step=10, last_step=30, ranks=[1, 2])
    mine, theirs = c.spans([sc.SPAN_STEP], keys, **args), s.spans([sc.SPAN_STEP], keys, **args)
    assert mine.types == theirs.types
    order = [sorted(t.to_pylist(), key=lambda r: (r["start_ns"], r["rank"])) for t in (mine, theirs)]
    assert len(order[0]) == len(order[1]) == 2 * 21
    for a, b in zip(*order, strict=True):
        assert json.loads(a.pop("resource")).items() >= json.loads(b.pop("resource")).items()
        assert a == b  # (the resource gains the store's host and pid columns)
    summary = [c.step_summary([sc.STEP_COMPUTE_MS, sc.STEP_GPU_THROTTLE], step_bucket=4),
               s.step_summary([sc.STEP_COMPUTE_MS, sc.STEP_GPU_THROTTLE], step_bucket=4)]
    rows = [sorted(t.to_pylist(), key=lambda r: (r["rank"], r["step"])) for t in summary]
    assert len(rows[0]) == len(rows[1]) == 4 * 20
    for a, b in zip(*rows, strict=True):
        assert {k: v for k, v in a.items() if k != sc.STEP_COMPUTE_MS} == \
            {k: v for k, v in b.items() if k != sc.STEP_COMPUTE_MS}
        assert a[sc.STEP_COMPUTE_MS] == pytest.approx(b[sc.STEP_COMPUTE_MS], rel=1e-6)


def test_step_spans_of_some_steps_are_read_in_those_steps_time_once_the_summary_is_known(stores):
    """After the whole-job step summary, a query for some steps' `train.step` spans is
    bounded by the time those steps ran in (the order key's Timestamp): the same rows,
    read from those granules only. Other spans, and steps the summary did not see, are
    not bounded."""
    store, chdb_backend = stores
    c, s = chdb_backend.job_data("straggler"), store.job_data("straggler")
    seen: list[str] = []
    engine = chdb_backend._engine
    real = engine.arrow

    def arrow(sql, params):
        seen.append(sql)
        return real(sql, params)

    engine.arrow = arrow
    try:
        def rows(job, **args):
            table = job.spans([sc.SPAN_STEP], columns=["trace_id", "span_id", "rank", "step"], **args)
            return sorted(tuple(r.values()) for r in table.to_pylist())

        before = rows(c, first_step=30, last_step=32)
        assert "Timestamp >=" not in seen[-1]
        c.step_summary([sc.STEP_COMPUTE_MS], step_bucket=4)
        after = rows(c, first_step=30, last_step=32)
        assert "Timestamp >=" in seen[-1]
        assert after == before and len(after) == 4 * 3
        assert [(t.lower(), sid.lower(), r, st) for t, sid, r, st in rows(s, first_step=30, last_step=32)] == after
        rows(c, first_step=70, last_step=200)  # past the summary's last step
        assert "Timestamp >=" not in seen[-1]
        c.spans([sc.SPAN_HEARTBEAT], first_step=30, last_step=32)
        assert "Timestamp >=" not in seen[-1]
    finally:
        engine.arrow = real


def test_a_result_stays_intact_after_the_next_queries(stores):
    """chDB reuses its result buffer for later queries: a table that pointed into it (an
    uncompressed Arrow result read without a copy) read back other numbers once the next
    queries had run — a rank_missing of ranks such as -2145668583 at 6,144 ranks."""
    _, chdb_backend = stores
    engine = chdb_backend._engine
    first = engine.arrow("SELECT number AS n FROM numbers(2000000)", {})
    engine.arrow("SELECT number * 7 AS m, toString(number) AS x FROM numbers(3000000)", {})
    values = first.column("n").to_numpy()
    assert len(values) == 2000000 and (values == np.arange(2000000)).all()


def test_an_error_keeps_its_exception_event(stores):
    store, chdb_backend = stores
    mine = chdb_backend.job_data("error").spans(["*"], status_code=2)
    theirs = store.job_data("error").spans(["*"], status_code=2)
    assert mine.num_rows == theirs.num_rows > 0
    [event] = json.loads(mine.column("events").to_pylist()[0])
    [expected] = json.loads(theirs.column("events").to_pylist()[0])
    assert event["name"] == expected["name"] == "exception"
    assert event["time_ns"] == expected["time_ns"]
    assert event["attributes"]["exception.type"] == expected["attributes"]["exception.type"]


def test_a_job_id_is_a_parameter_never_sql(stores):
    _, chdb_backend = stores
    job = chdb_backend.job_data("x' OR 1=1 OR SpanName != '")
    assert job.steps_range() is None and job.ranks() == [] and job.count(["*"]) == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("spec, message", [
    ("chdb:/nonexistent/dir", "chDB directory /nonexistent/dir does not exist"),
    ("clickhouse+http://127.0.0.1:{port}/otel", "cannot reach ClickHouse at http://127.0.0.1:{port}"),
    ("clickhouse+http://127.0.0.1:{port}/otel?tabel=x", "unknown ClickHouse backend option 'tabel'"),
    ("clickhouse+http://127.0.0.1:{port}/otel?table=a;drop", "is not NAME or DATABASE.NAME"),
])
def test_bad_backends_are_one_line(spec, message):
    port = _closed_port()
    with pytest.raises(BackendError) as caught:
        open_backend(spec.format(port=port))
    assert message.format(port=port) in str(caught.value)


def test_an_unreachable_server_is_one_line_with_the_sockets_reason():
    """docs/backends.md: an unreachable server is one line. clickhouse-connect logged
    "Unexpected Http Driver Exception" above it, and the line was urllib3's pool text
    cut at 300 characters."""
    pytest.importorskip("clickhouse_connect")
    port = _closed_port()
    result = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "jobs", "--backend",
                             f"clickhouse+http://127.0.0.1:{port}/otel"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == (f"flare: error: cannot reach ClickHouse at http://127.0.0.1:{port}: "
                             "Connection refused\n")


def test_a_file_named_as_a_chdb_directory_is_not_said_to_be_missing(tmp_path):
    store_file = tmp_path / "store.duckdb"
    store_file.write_bytes(b"x")
    with pytest.raises(BackendError) as caught:
        open_backend(f"chdb:{store_file}")
    assert str(caught.value) == (f"chDB needs a directory and {store_file} is not one "
                                 "(a Flare store file is read with --store PATH)")
    assert "\n" not in str(caught.value)


def test_a_table_that_is_not_the_exporters_is_named(stores):
    _, chdb_backend = stores
    path = chdb_backend.name[len("chdb:"):]
    users = clickhouse.Chdb._open[str(Path(path).resolve())][1]
    with pytest.raises(BackendError, match="has no table nope"):
        open_backend(f"chdb:{path}?table=nope")
    # a refused open gives its hold on the directory back (pytest-xdist set this module
    # up twice in one worker, and the second found the first's directory still held)
    assert clickhouse.Chdb._open[str(Path(path).resolve())][1] == users
    chdb_backend._engine.arrow("CREATE TABLE IF NOT EXISTS plain (x Int32) ENGINE = Memory", {})
    with pytest.raises(BackendError, match="plain is not an OpenTelemetry traces table"):
        open_backend(f"chdb:{path}?table=plain")
    json_layout = "\n".join(
        line for line in clickhouse.TRACES_TABLE_SQL.format(table="json_traces").replace(
            "SpanAttributes Map(LowCardinality(String), String)", "SpanAttributes JSON").splitlines()
        if "(SpanAttributes)" not in line)
    chdb_backend._engine.arrow(json_layout, {})
    with pytest.raises(BackendError, match="experimental `json: true` layout"):
        open_backend(f"chdb:{path}?table=json_traces")


FILL_CHDB = """
import sys
from flare.diagnostics.backends import clickhouse
backend = clickhouse.create_chdb(sys.argv[1])
print(clickhouse.load_store(backend, sys.argv[2]))
"""


def test_flare_diagnose_on_chdb_from_the_command_line(stores, tmp_path):
    """The CLI on a chDB directory (filled by another process: chDB holds a directory
    for its process's lifetime), on a missing one and on one another process holds:
    a report, else one line and a non-zero exit."""
    store, _ = stores
    directory = tmp_path / "chdb"
    filled = subprocess.run([sys.executable, "-c", FILL_CHDB, str(directory), store.name[len("store:"):]],
                            capture_output=True, text=True, timeout=120, check=False)
    assert filled.returncode == 0 and int(filled.stdout) > 0, filled.stderr[-2000:]

    def flare_diagnose(path):
        return subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--backend",
                               f"chdb:{path}", "--job", "straggler", "--format", "json"],
                              capture_output=True, text=True, timeout=120, check=False)

    done = flare_diagnose(directory)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [(a["kind"], a["ranks"], a["cause"]) for a in report["anomalies"]] == [
        ("straggler", [2], "compute")], done.stdout
    assert report["backend"] == f"chdb:{directory}"
    for path, reason in ((tmp_path / "none", "does not exist"),
                         (stores[1].name[len("chdb:"):], "in use by another process")):
        bad = flare_diagnose(path)
        assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0, bad.stderr
        assert reason in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
