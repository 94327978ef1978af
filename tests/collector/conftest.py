"""Fixtures that run the real collector: `python -m flare.collector --config FILE`.

Ports are 0 (free ports picked by the OS); the process logs one `ready:` line naming
what it bound, which the fixture reads back from its stderr file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.exporters import store

_READY = re.compile(r"ready: (.*)$", re.MULTILINE)


def base_config(store_path: Path, **service: Any) -> dict[str, Any]:
    """The embedded configuration on free ports, with a metrics endpoint."""
    return {
        "receivers": {"otlp": {"protocols": {
            "grpc": {"endpoint": "127.0.0.1:0"},
            "http": {"endpoint": "127.0.0.1:0"},
        }}},
        "processors": {"memory_limiter": {"limit_mib": 64}, "rank_correlation": {}},
        "exporters": {"flare_store": {"path": str(store_path)}},
        "extensions": {
            "flare_wal": {"directory": str(store_path) + ".ingest-wal"},
            "flare_metrics": {"endpoint": "127.0.0.1:0"},
        },
        "service": {
            "extensions": ["flare_wal", "flare_metrics"],
            "flush_interval": "200ms",
            **service,
            "pipelines": {
                "traces": {"receivers": ["otlp"], "processors": ["memory_limiter", "rank_correlation"],
                           "exporters": ["flare_store"]},
                "metrics": {"receivers": ["otlp"], "processors": ["memory_limiter"],
                            "exporters": ["flare_store"]},
            },
        },
    }


class CollectorProcess:
    def __init__(self, config: dict[str, Any], workdir: Path, name: str = "collector") -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.grpc = self.http = self.metrics = None

    @property
    def store_path(self) -> Path:
        return Path(self.config["exporters"]["flare_store"]["path"])

    @property
    def wal_dir(self) -> Path:
        return Path(self.config["extensions"]["flare_wal"]["directory"])

    def start(self, timeout_s: float = 60.0) -> CollectorProcess:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flare.collector", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text()[offset:]
            match = _READY.search(text)
            if match:
                parts = dict(p.split(" ", 1) for p in match.group(1).split(", "))
                self.grpc = parts.get("OTLP/gRPC")
                self.http = parts.get("OTLP/HTTP")
                self.metrics = parts.get("metrics")
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"collector exited {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"collector not ready in {timeout_s} s:\n{self.log_path.read_text()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def scrape(self) -> dict[str, float]:
        """Unlabelled samples and label-summed totals from /metrics."""
        with urllib.request.urlopen(f"{self.metrics}", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait_for(self, name: str, predicate, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.scrape().get(name, 0.0)
            if predicate(value):
                return value
            time.sleep(0.05)
        raise AssertionError(f"{name} stayed at {value}")

    def stop_if_running(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def collector_process(tmp_path):
    started: list[CollectorProcess] = []

    def make(config: dict[str, Any] | None = None, name: str = "collector") -> CollectorProcess:
        proc = CollectorProcess(config or base_config(tmp_path / "store.duckdb"), tmp_path, name)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop_if_running()


def make_request(
    n_spans: int, job: str = "job-1", rank: int = 0, step: int = 0, first_index: int = 0
) -> ExportTraceServiceRequest:
    """A request with `n_spans` distinct spans; span ids encode (rank, index)."""
    rs = ResourceSpans()
    for key, value in (("service.name", AnyValue(string_value="test")),
                       ("flare.job.id", AnyValue(string_value=job)),
                       ("flare.rank", AnyValue(int_value=rank))):
        rs.resource.attributes.append(KeyValue(key=key, value=value))
    ss: ScopeSpans = rs.scope_spans.add()
    now = time.time_ns()
    for i in range(first_index, first_index + n_spans):
        span: Span = ss.spans.add()
        span.trace_id = (step + 1).to_bytes(16, "big")
        span.span_id = ((rank << 40) | (i + 1)).to_bytes(8, "big")
        span.name = "test.span"
        span.start_time_unix_nano = now
        span.end_time_unix_nano = now + 1000
        span.attributes.append(KeyValue(key="flare.step", value=AnyValue(int_value=step)))
    return ExportTraceServiceRequest(resource_spans=[rs])


def post(url: str, body: bytes, content_type: str = "application/x-protobuf",
         headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


def stored_span_ids(store_path: Path) -> list[str]:
    con = store.open_reader(store_path, timeout_s=30)
    try:
        return [r[0] for r in con.execute("SELECT span_id FROM spans WHERE name = 'test.span'").fetchall()]
    finally:
        con.close()


@pytest.fixture
def helpers():
    """The helper functions, for tests (conftest modules are not importable by name)."""

    class Helpers:
        base_config = staticmethod(base_config)
        make_request = staticmethod(make_request)
        post = staticmethod(post)
        stored_span_ids = staticmethod(stored_span_ids)

    return Helpers


@pytest.fixture(scope="module")
def shared_collector(tmp_path_factory):
    """One collector for a module's receiver tests, with a 1 MiB body cap."""
    workdir = tmp_path_factory.mktemp("collector")
    config = base_config(workdir / "store.duckdb")
    protocols = config["receivers"]["otlp"]["protocols"]
    protocols["http"]["max_request_body_size"] = "1MiB"
    protocols["grpc"]["max_recv_msg_size_mib"] = 1
    proc = CollectorProcess(config, workdir).start()
    yield proc
    proc.stop_if_running()
