"""Hostile input to the `flare` CLI, run as a user would (`flare ...` in a subprocess):
each ends in one error line and a non-zero exit, at once, leaving nothing behind.

- a FLARE_BACKEND_TOKEN that cannot be an HTTP header value (a line break, non-ASCII);
- a --store that is not a regular file (a FIFO, a device, a directory);
- an import into a store whose directory does not exist;
- error wording ("the the collector URL").
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flare.exporters import store

FLARE = str(Path(sys.executable).parent / "flare")
HOSTILE_TOKENS = {
    "crlf": "secret\r\nX-Injected: 1",  # was a ValueError traceback
    "non-latin1": "jeton-€",  # was a UnicodeEncodeError traceback
    "latin1": "tökén",  # was sent as latin-1 bytes no server reads as the token
}


def _flare(*args: str, cwd: Path, env: dict[str, str] | None = None,
           timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """`flare ARGS`; a hang fails the test (TimeoutExpired) instead of hanging it."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    return subprocess.run([FLARE, *args], cwd=cwd, env={**full_env, **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def _empty_store(path: Path) -> Path:
    with store.writer(path):
        pass
    return path


@pytest.mark.parametrize("token", list(HOSTILE_TOKENS.values()), ids=list(HOSTILE_TOKENS))
@pytest.mark.parametrize("command", ["capture", "diagnose-jaeger", "diagnose-tempo", "follow"])
def test_a_token_that_cannot_be_a_header_is_one_line_naming_the_setting(command, token, tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        argv = {
            "capture": ["capture", "--collector", url, "--job", "J", "--ranks", "2"],
            "diagnose-jaeger": ["diagnose", "--backend", f"jaeger+{url}"],
            "diagnose-tempo": ["diagnose", "--backend", f"tempo+{url}"],
            "follow": ["diagnose", "--store", str(_empty_store(tmp_path / "s.duckdb")),
                       "--follow", "--interval", "1", "--collector", url],
        }[command]
        result = _flare(*argv, cwd=tmp_path, env={"FLARE_BACKEND_TOKEN": token})
        line = _one_error_line(result)
        assert "FLARE_BACKEND_TOKEN" in line
        assert token not in result.stderr + result.stdout  # a secret is never echoed
        server.settimeout(0.0)
        with pytest.raises(BlockingIOError):  # nothing was sent: no connection at all
            server.accept()
    finally:
        server.close()


@pytest.fixture(params=["fifo", "device", "directory"])
def not_a_file(request, tmp_path) -> Path:
    if request.param == "fifo":
        path = tmp_path / "store.duckdb"
        os.mkfifo(path)
        return path
    if request.param == "device":
        return Path("/dev/zero")
    path = tmp_path / "store.duckdb"
    path.mkdir()
    return path


@pytest.mark.parametrize("command", ["diagnose", "jobs"])
def test_a_store_that_is_not_a_regular_file_is_refused_at_once(command, not_a_file, tmp_path):
    kind = not_a_file.lstat().st_mode
    result = _flare(command, "--store", str(not_a_file), cwd=tmp_path, timeout_s=20)
    assert _one_error_line(result) == f"flare: error: store {not_a_file} is not a regular file"
    assert stat.S_IFMT(not_a_file.lstat().st_mode) == stat.S_IFMT(kind)  # left as it was


def _kineto_trace(directory: Path) -> Path:
    directory.mkdir()
    (directory / "rank0.json").write_text(json.dumps({
        "schemaVersion": 1, "distributedInfo": {"rank": 0},
        "traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1",
                         "pid": 1, "tid": 1, "ts": 100, "dur": 50}]}))
    return directory


def test_import_into_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "store.duckdb"
    os.mkfifo(fifo)
    result = _flare("import-kineto", str(_kineto_trace(tmp_path / "traces")), "--store", str(fifo),
                    cwd=tmp_path, timeout_s=20)
    assert _one_error_line(result) == f"flare: error: store {fifo} is not a regular file"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_import_into_a_missing_directory_creates_nothing(tmp_path):
    traces = _kineto_trace(tmp_path / "traces")
    target = tmp_path / "no-such-dir" / "deeper" / "x.duckdb"
    result = _flare("import-kineto", str(traces), "--store", str(target), cwd=tmp_path)
    assert _one_error_line(result) == (
        f"flare: error: the directory of store {target} does not exist")
    assert not (tmp_path / "no-such-dir").exists()


def test_import_into_the_default_store_creates_its_directory(tmp_path):
    """The documented default, .flare/store.duckdb, is the one path whose directory is made."""
    traces = _kineto_trace(tmp_path / "traces")
    result = _flare("import-kineto", str(traces), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    jobs = _flare("jobs", "--store", ".flare/store.duckdb", "--format", "json", cwd=tmp_path)
    assert [row["job"] for row in json.loads(jobs.stdout)] == ["traces"]


@pytest.mark.parametrize("argv,env", [
    (["--collector", "http://127.0.0.1:9"], {"FLARE_BACKEND_CA_FILE": "/no/such/ca.pem"}),
    (["--collector", "ftp://127.0.0.1:9"], {}),
    (["--collector", "http://127.0.0.1:99999"], {}),
], ids=["tls-on-http", "not-http", "bad-port"])
def test_collector_url_errors_read_well(argv, env, tmp_path):
    result = _flare("capture", *argv, "--job", "J", "--ranks", "2", cwd=tmp_path, env=env)
    line = _one_error_line(result)
    assert "the collector" in line
    assert "the the" not in line
