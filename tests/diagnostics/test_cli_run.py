"""`flare run`: real embedded collector, real OTLP from a child process, exit status,
write-back and forwarding (to a second real collector standing in for Jaeger/Tempo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flare.collector.config import embedded_config
from flare.collector.service import Collector
from flare.exporters import store as flare_store

FLARE = str(Path(sys.executable).parent / "flare")
EMIT = str(Path(__file__).with_name("emit_steps.py"))


def _run(args, cwd, timeout=120):
    return subprocess.run([FLARE, "run", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _anomaly_spans(path) -> list[dict]:
    con = flare_store.open_reader(path)
    try:
        rows = con.execute("SELECT attributes, links FROM spans WHERE name = 'flare.anomaly'").fetchall()
    finally:
        con.close()
    return [{"attributes": json.loads(a), "links": json.loads(link)} for a, link in rows]


def test_run_diagnoses_writes_back_and_forwards(tmp_path):
    upstream_store = tmp_path / "upstream.duckdb"
    upstream = Collector(embedded_config(upstream_store))
    upstream.start()
    try:
        result = _run(["--job", "emit", "--format", "json", "--otlp-forward", f"http://{upstream.grpc_endpoint}",
                       "--", sys.executable, EMIT, "3"], cwd=tmp_path)
        upstream.flush()
    finally:
        upstream.stop(10)
    assert result.returncode == 3, result.stderr  # the command's own status
    report = json.loads(result.stdout)
    assert report["job"] == "emit"
    stragglers = [a for a in report["anomalies"] if a["kind"] == "straggler"]
    assert stragglers and stragglers[0]["ranks"] == [3] and stragglers[0]["cause"] == "compute"
    assert stragglers[0]["first_step"] == 10
    local = _anomaly_spans(tmp_path / ".flare" / "store.duckdb")
    forwarded = _anomaly_spans(upstream_store)
    assert {s["attributes"]["flare.anomaly.kind"] for s in local} >= {"straggler"}
    assert len(forwarded) == len(local) == len(report["anomalies"])
    assert all(s["links"] for s in local)


def test_forwarding_to_an_otlp_http_port_that_is_not_4318_is_detected(tmp_path):
    """No --otlp-forward-protocol and a port other than 4318: the target answers an
    HTTP/1.1 request, so the spans go over OTLP/HTTP (gRPC would send nothing)."""
    upstream_store = tmp_path / "upstream.duckdb"
    upstream = Collector(embedded_config(upstream_store))
    upstream.start()
    try:
        assert not upstream.http_endpoint.endswith(":4318")
        result = _run(["--job", "emit", "--format", "json", "--otlp-forward",
                       f"http://{upstream.http_endpoint}", "--", sys.executable, EMIT, "3"],
                      cwd=tmp_path)
        upstream.flush()
    finally:
        upstream.stop(10)
    assert result.returncode == 3, result.stderr
    assert "lost" not in result.stderr
    assert len(_anomaly_spans(upstream_store)) == len(json.loads(result.stdout)["anomalies"]) > 0


def test_a_forward_target_that_refuses_everything_is_reported(tmp_path):
    """Forwarding is best effort, but spans the target did not take are said, in one
    line, and the job's status and the local store are unaffected."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_404():
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                try:
                    connection.recv(65536)
                    connection.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                                       b"Connection: close\r\n\r\n")
                except OSError:
                    pass

    threading.Thread(target=answer_404, daemon=True).start()
    try:
        result = _run(["--job", "emit", "--format", "json", "--otlp-forward",
                       f"http://127.0.0.1:{port}", "--", sys.executable, EMIT, "3"],
                      cwd=tmp_path)
    finally:
        server.close()
    assert result.returncode == 3, result.stderr
    lost = [line for line in result.stderr.splitlines() if "lost" in line]
    assert len(lost) == 1 and f"forwarding to http://127.0.0.1:{port} lost" in lost[0]
    assert "404" in lost[0] and "the store has them all" in lost[0]
    assert json.loads(result.stdout)["anomalies"]  # diagnosed from the local store


@pytest.mark.parametrize("args, code, message", [
    (["--bogus", "--", "true"], 2, "unrecognized arguments: --bogus"),
    ([], 2, "no command to run"),
    (["--", "/no/such/command"], 1, "command not found: /no/such/command"),
    (["--otlp-forward", "http://127.0.0.1:9", "--", "true"], 1, "is unreachable"),
    (["--otlp-forward", "http://localhost:notaport", "--", "true"], 1, "is not a URL"),
    (["--otlp-forward", "http://localhost:99999", "--", "true"], 1, "is not a URL"),
])
def test_bad_input_is_one_clear_line(tmp_path, args, code, message):
    result = _run(args, cwd=tmp_path, timeout=60)
    assert result.returncode == code
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1


def test_a_command_that_sends_nothing_keeps_its_status(tmp_path):
    result = _run(["--", sys.executable, "-c", "raise SystemExit(5)"], cwd=tmp_path)
    assert result.returncode == 5
    # the likelier cause, not a hint that the instrumentation is missing
    assert "sent no spans; nothing to diagnose (the command exited with status 5 before " \
        "sending any)" in result.stderr


@pytest.mark.parametrize("signum, status, said", [
    (2, 130, "interrupted; stopping the job"),
    (15, 143, "terminated (SIGTERM); stopping the job")])  # a scheduler's stop
def test_a_signal_stops_the_job_reports_and_exits_as_a_shell_would(tmp_path, signum, status, said):
    flare = subprocess.Popen(
        [FLARE, "run", "--", sys.executable, "-c",
         "import sys, time; print('job running', file=sys.stderr, flush=True); time.sleep(120)"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "collecting into" in flare.stderr.readline()
        # the store exists from the start: a diagnose before the first flush finds it
        assert (tmp_path / ".flare" / "store.duckdb").exists()
        while "job running" not in flare.stderr.readline():
            pass
        flare.send_signal(signum)
        stdout, stderr = flare.communicate(timeout=60)
    finally:
        if flare.poll() is None:
            flare.kill()
    assert flare.returncode == status
    assert said in stderr
    # reported: the command is no training job. Whether its heartbeat and its
    # interruption (a flare.error) reached the collector before it stopped depends on
    # the host's load (seen both on this 2-core host): nothing arrived, or no step did.
    assert ("sent no spans; nothing to diagnose (is the instrumentation" in stderr
            or "no steps recorded" in stdout), (stdout, stderr)
    assert "Traceback" not in stderr.split("stopping the job", 1)[0]


def test_flare_run_started_with_sigint_ignored_still_stops_its_job_on_it(tmp_path):
    """`nohup flare run … &`, or flare run in the background of a script, starts with
    SIGINT ignored: the job must not inherit that, or the SIGINT flare run passes on to
    stop it is lost and only the escalation's SIGTERM, 15 s later, stops it."""
    import signal
    import time

    flare = subprocess.Popen(
        [FLARE, "run", "--", sys.executable, "-c",
         "import sys, time; print('job running', file=sys.stderr, flush=True); time.sleep(120)"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        while "job running" not in flare.stderr.readline():
            pass
        sent = time.monotonic()
        flare.send_signal(signal.SIGINT)
        _, stderr = flare.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if flare.poll() is None:
            flare.kill()
    assert flare.returncode == 130, stderr
    assert took < 10, (took, stderr)  # the job's own KeyboardInterrupt, not the SIGTERM at 15 s


def test_a_json_report_on_stdout_stays_parseable_when_the_job_prints(tmp_path):
    result = _run(["--job", "noisy", "--format", "json", "--", sys.executable, "-c",
                   "import subprocess, sys; print('step 0 loss 2.7', flush=True); "
                   f"sys.exit(subprocess.call([sys.executable, {EMIT!r}, '3']))"], cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert json.loads(result.stdout)["job"] == "noisy"
    assert "step 0 loss 2.7" in result.stderr  # the job's own output, kept


def test_a_job_that_ignores_the_interrupt_gets_the_next_signal(tmp_path):
    """A SIGINT can be lost (one caught just before an exec) or ignored: the job is sent
    SIGTERM once the escalation delay passes, without a second Ctrl-C."""
    import os
    import signal
    import threading
    import time

    from flare.diagnostics.run import INTERRUPTED_STATUS, _wait

    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGINT, "
         "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, process_group=0)
    assert child.stdout.readline().strip() == "ready"
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    assert _wait(child, escalate_after_s=1.0) == INTERRUPTED_STATUS
    assert child.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 10


def test_a_job_name_already_in_the_store_is_refused_before_the_job_runs(tmp_path):
    """Reusing --job would merge two runs' steps into one job (seen: a compute fault's
    +60 ms read as +30 ms, averaged with an earlier healthy run of the same name)."""
    store = tmp_path / "s.duckdb"
    first = _run(["--store", str(store), "--job", "same", "--format", "json", "--",
                  sys.executable, EMIT, "0"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    con = flare_store.open_reader(store)
    try:
        before = con.execute("SELECT count(*) FROM spans").fetchone()[0]
    finally:
        con.close()
    marker = tmp_path / "ran"
    second = _run(["--store", str(store), "--job", "same", "--", sys.executable, "-c",
                   f"open({str(marker)!r}, 'w').close()"], cwd=tmp_path)
    assert second.returncode == 1
    assert second.stderr.strip() == (
        f"flare: error: job 'same' is already in {store}; its steps would mix with this "
        "run's: choose another --job (or another --store)")
    assert not marker.exists()  # the command never ran
    con = flare_store.open_reader(store)
    try:
        assert con.execute("SELECT count(*) FROM spans").fetchone()[0] == before
    finally:
        con.close()


def test_an_unwritable_report_path_is_refused_before_the_job_runs(tmp_path):
    marker = tmp_path / "ran"
    result = _run(["--store", str(tmp_path / "s.duckdb"), "-o", str(tmp_path / "no" / "r.txt"),
                   "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                  cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"flare: error: cannot write {tmp_path / 'no' / 'r.txt'}: no directory {tmp_path / 'no'}")
    assert not marker.exists()


@pytest.mark.parametrize("job", [["--job", "x"], []], ids=["with-job", "without-job"])
@pytest.mark.parametrize("store", ["empty", "random", "directory"])
def test_a_store_that_is_not_a_store_is_one_line_with_or_without_job(tmp_path, store, job):
    """Seen: with --job, an empty file, random bytes or a directory as the store gave a
    traceback (BackendError from the check for a reused job name); without, one line."""
    path = tmp_path / "s.duckdb"
    if store == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"" if store == "empty" else bytes(range(256)) * 20)
    before = None if store == "directory" else path.read_bytes()
    marker = tmp_path / "ran"
    result = _run(["--store", str(path), *job, "--", sys.executable, "-c",
                   f"open({str(marker)!r}, 'w').close()"], cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flare: error: "), result.stderr
    assert ("is not a regular file" if store == "directory" else "is not a Flare store") in lines[0]
    assert not marker.exists()  # the command never ran
    if before is not None:
        assert path.read_bytes() == before  # nothing written over what was there
    # refused before the collector starts: no write-ahead log folder left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.duckdb"]


def test_a_script_that_is_not_executable_is_said_so(tmp_path):
    """Seen: `flare run -- ./script.py` on a file without its x bit said "command not
    found: ./script.py" although the file is there."""
    script = tmp_path / "script.py"
    script.write_text("#!/bin/sh\ntrue\n")
    script.chmod(0o644)
    result = _run(["--", "./script.py"], cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "flare: error: cannot run ./script.py: permission denied (it is not executable: "
        "chmod +x it, or run it with its interpreter)"]
    result = _run(["--", str(tmp_path)], cwd=tmp_path, timeout=60)
    assert result.stderr.strip() == f"flare: error: cannot run {tmp_path}: it is a directory"
    assert not (tmp_path / ".flare").exists()  # refused before the store was made


def test_a_store_in_a_missing_directory_is_refused_and_nothing_is_created(tmp_path):
    """Seen: `--store nodir/x.duckdb` made the directory (the collector creates it), where
    diagnose and import-kineto call a mistyped path an error."""
    marker = tmp_path / "ran"
    store = tmp_path / "nodir" / "x.duckdb"
    result = _run(["--store", str(store), "--", sys.executable, "-c",
                   f"open({str(marker)!r}, 'w').close()"], cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"flare: error: the directory {tmp_path / 'nodir'} of store {store} does not exist")
    assert not (tmp_path / "nodir").exists() and not marker.exists()


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_job_name_is_refused(tmp_path, name):
    """Seen: `--job ""` ran the job under a generated name, not the one meant."""
    result = _run(["--job", name, "--", "true"], cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"flare: error: --job {name!r} is empty: name the job, or "
                                     "leave --job out for a generated name")
    assert not (tmp_path / ".flare").exists()


def test_a_store_path_with_a_colon_is_a_file_not_a_duckdb_extension(tmp_path):
    """Seen: `--store sqlite:new.duckdb` made DuckDB read "sqlite:" as its extension's
    prefix and wait for a download of it. HOME is the test's own, so an extension
    installed on this machine cannot hide that."""
    import os

    result = subprocess.run([FLARE, "run", "--store", "sqlite:new.duckdb", "--no-diagnose", "--", "true"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "download" not in result.stderr
    assert (tmp_path / "sqlite:new.duckdb").is_file() and not (tmp_path / ".duckdb").exists()


def test_a_job_its_user_stopped_reads_the_same_from_the_store_later(tmp_path):
    """Ctrl-C twice while rank 0 hangs: flare run's report knows the user stopped the
    job; a later `flare diagnose` of the store read the stop's echoes as failures (seen:
    "rank 0 died without an error at step 30: killed by a signal (SIGKILL…)", and
    "fail_slow [1] cpu" over the step the stop stretched). The stop is stored."""
    import signal
    import time

    train = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
    store = tmp_path / "s.duckdb"
    flare = subprocess.Popen(
        [FLARE, "run", "--store", str(store), "--job", "stopped", "--format", "json", "-o",
         str(tmp_path / "run.json"), "--", str(Path(sys.executable).with_name("torchrun")),
         "--nproc_per_node", "2", str(train), "--steps", "200", "--fault", "hang",
         "--fault-rank", "0", "--fault-from", "30"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True)
    try:
        for line in flare.stdout:  # the job's own output (the report goes to -o)
            if "step 0 loss" in line:
                break
        time.sleep(3.0)  # past step 30: rank 0 hangs, rank 1 waits for it
        flare.send_signal(signal.SIGINT)
        time.sleep(0.3)
        flare.send_signal(signal.SIGINT)  # "Ctrl-C again to force"
        flare.communicate(timeout=120)
    finally:
        if flare.poll() is None:
            flare.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert flare.returncode == 130, stderr[-2000:]
    con = flare_store.open_reader(store)
    try:
        stops = con.execute("SELECT attributes->>'flare.run.signal' FROM spans "
                            "WHERE job = 'stopped' AND name = 'flare.run.stop'").fetchall()
    finally:
        con.close()
    assert stops == [("SIGINT",)]
    later = subprocess.run([FLARE, "diagnose", "--store", str(store), "--job", "stopped", "--format", "json"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    labels = [[(a["kind"], a["ranks"], a["cause"]) for a in json.loads(text)["anomalies"]]
              for text in ((tmp_path / "run.json").read_text(), later.stdout)]
    assert labels[0] == labels[1] == [], labels


def test_a_stopped_job_that_sent_nothing_is_no_job_of_the_store(tmp_path):
    """Ctrl-C of a command that sent no span (no Python, or stopped while starting):
    the stop is not recorded, or its span alone would make the job one of the store's —
    listed by `flare jobs`, its name refused next time."""
    import signal
    import time

    flare = subprocess.Popen([FLARE, "run", "--job", "quiet", "--", "sleep", "120"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "collecting into" in flare.stderr.readline()
        time.sleep(1.0)
        flare.send_signal(signal.SIGINT)
        _, stderr = flare.communicate(timeout=60)
    finally:
        if flare.poll() is None:
            flare.kill()
    assert flare.returncode == 130, stderr
    assert "job quiet sent no spans" in stderr, stderr
    con = flare_store.open_reader(tmp_path / ".flare" / "store.duckdb")
    try:
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (0,)
    finally:
        con.close()
