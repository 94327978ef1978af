"""`flare diagnose --follow`: the always-on diagnostic service.

Polls a backend (store, Jaeger, Tempo) on an interval and labels anomalies as they
appear, with the same detectors as a one-shot diagnosis. It is incremental: every
rank's `train.step` spans — the bulk of what detectors read — are kept in a local
window and each poll fetches only the steps not yet complete (every rank has moved
past them), so a poll costs what arrived since the last one, not the whole job.
Rarer spans (hang dumps, errors, heartbeats) are still asked of the backend, with
its own filters.

Each new anomaly is written once as a `flare.anomaly` span through OTLP (or into the
store when no OTLP endpoint is given). "Once" survives re-detection on later polls
with a slightly different onset, backend outages (the poll simply fails; nothing
advances until the backend answers, then it catches up), write failures (an anomaly
is remembered as sent only after the write succeeded) and restarts (anomaly spans
already in the backend are read back at start).

Health and the service's own metrics are on a small HTTP endpoint: `/healthz`
(200 while the last poll succeeded, 503 during an outage) and `/metrics`
(Prometheus text: the service's counters, plus the per-rank gauges the Grafana
dashboard reads — step time, collective wait, culprit share, anomalies by kind and
rank — so a deployment that keeps its spans in Tempo or Jaeger gets the dashboard
from the follow service alone).

The window is incremental.py's, which labels are new follow_labels.py's, the metrics
and health endpoint follow_metrics.py's, the collector's capture client
collector_client.py's; this module is the loop that drives them.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from flare.diagnostics import pipeline, report_text, writeback
from flare.diagnostics.backends import BackendError, open_backend
from flare.diagnostics.collector_client import collector_asker
from flare.diagnostics.complete import CompleteSteps
from flare.diagnostics.follow_labels import Labeller
from flare.diagnostics.follow_metrics import FollowMetrics, HealthServer, rank_gauges
from flare.diagnostics.incremental import IncrementalJobData
from flare.diagnostics.model import Anomaly, DiagnosisConfig


class FollowService:
    """One followed job: poll → diagnose → write new labels. `poll_once()` is the unit
    tests drive; `run()` loops until `stop` is set."""

    def __init__(
        self,
        backend_spec: str,
        job: str | None,
        config: DiagnosisConfig | None = None,
        otlp_endpoint: str | None = None,
        out: TextIO | None = None,
        backend_opts: dict[str, Any] | None = None,
        max_steps: int = 5000,
        warn: Callable[[str], None] | None = None,
        capture=None,
    ) -> None:
        self.capture = capture  # a hotspots.CaptureRequests: new labels' ranks are captured
        self.backend_spec = backend_spec
        self.backend = open_backend(backend_spec, **(backend_opts or {}))
        self.job = job
        self.config = dataclasses.replace(config or DiagnosisConfig(), live=True)
        self.otlp_endpoint = otlp_endpoint
        self.out = out or sys.stdout
        self.max_steps = max_steps
        self.metrics = FollowMetrics()
        self.labeller = Labeller()
        self.pending: list[tuple[Anomaly, list[tuple[str, str]]]] = []
        self.data: IncrementalJobData | None = None
        self.stop = threading.Event()
        self._warn = warn or (lambda line: print(line, file=sys.stderr))
        self._down_since: float | None = None

    # -- one poll

    def poll_once(self) -> list[Anomaly]:
        """Refresh, diagnose, write what is new; returns the anomalies written now."""
        started = time.monotonic()
        try:
            if self.data is None and not self._attach():
                self._record_poll(started, ok=True)
                return []
            assert self.data is not None
            self.data.refresh()
            # only the steps every rank has sent (a late rank's missing steps would read
            # as its peers' problem); the final word on open steps comes next poll
            diagnosis = pipeline.diagnose(CompleteSteps.of(self.data), self.config,
                                          warn=self._warn)
            gauges = rank_gauges(self.data)
            with self.metrics.lock:
                self.metrics.rank_gauges = gauges
        except BackendError as exc:
            self._record_poll(started, ok=False, error=str(exc))
            return []
        for anomaly in diagnosis.anomalies:
            if self.labeller.is_new(anomaly) and not any(
                p.key == anomaly.key for p, _ in self.pending
            ):
                self.pending.append((anomaly, diagnosis.evidence_links.get(anomaly.key, [])))
                self._ask_capture(anomaly, diagnosis)
        written = self._write_pending()
        self._record_poll(started, ok=True)
        return written

    def _ask_capture(self, anomaly: Anomaly, diagnosis) -> None:
        if self.capture is None:
            return
        try:
            self.capture.on_alert(anomaly, diagnosis)
        except BackendError as exc:  # the collector is away: the label stands without its line
            self._warn(f"flare follow: capture of ranks {anomaly.ranks} not asked: {exc}")

    def _attach(self) -> bool:
        if self.job is None:
            jobs = self.backend.jobs()
            jobs = [j for j in jobs if j != writeback.SERVICE]
            if not jobs:
                return False  # nothing reported yet: a follow service may start first
            if len(jobs) > 1:  # the user's to settle, not an outage to wait out
                raise AmbiguousJob(
                    f"{self.backend.name} holds {len(jobs)} jobs ({', '.join(jobs[:5])}); "
                    "choose one with --job"
                )
            self.job = jobs[0]
        inner = self.backend.job_data(self.job)
        self.labeller.read_back(self.backend, self.job, inner)
        self.data = IncrementalJobData(inner, self.max_steps)
        print(f"flare follow: following job {self.job} on {self.backend.name}", file=self.out,
              flush=True)
        return True

    def _write_pending(self) -> list[Anomaly]:
        if not self.pending:
            return []
        anomalies = [a for a, _ in self.pending]
        links = {a.key: list(evidence) for a, evidence in self.pending}
        assert self.job is not None
        try:
            if self.otlp_endpoint:
                writeback.send_otlp(
                    self.otlp_endpoint, writeback.anomaly_spans(self.job, anomalies, links)
                )
            elif self.backend_spec.startswith("store:") or "://" not in self.backend_spec:
                path = self.backend_spec.removeprefix("store:")
                self.backend.close()  # release the read-only connection for the writer
                writeback.write_to_store(path, self.job, anomalies, links)
        except writeback.WritebackError as exc:
            with self.metrics.lock:
                self.metrics.write_errors += 1
                self.metrics.pending = len(self.pending)
            self._warn(f"flare follow: {exc}; will retry")
            return []
        for anomaly in anomalies:
            self.labeller.remember(anomaly)
            with self.metrics.lock:
                self.metrics.anomalies[anomaly.kind] = self.metrics.anomalies.get(anomaly.kind, 0) + 1
                for rank in anomaly.ranks or ["none"]:
                    key = (self.job, anomaly.kind, str(rank))
                    self.metrics.anomalies_by_rank[key] = self.metrics.anomalies_by_rank.get(key, 0) + 1
            # the line `flare run` prints for a live alert
            print(report_text.live_alert_line(self.job, anomaly), file=self.out, flush=True)
        self.pending = []
        with self.metrics.lock:
            self.metrics.pending = 0
        return anomalies

    def _record_poll(self, started: float, ok: bool, error: str = "") -> None:
        with self.metrics.lock:
            self.metrics.polls += 1
            self.metrics.last_poll_s = time.monotonic() - started
            if ok:
                self.metrics.backend_up = 1
                self.metrics.last_success_unix = time.time()
                self.metrics.last_error = ""
            else:
                self.metrics.poll_errors += 1
                self.metrics.backend_up = 0
                self.metrics.last_error = error
            if self.data is not None:
                self.metrics.steps_complete = self.data.complete_step
                self.metrics.window_rows = self.data.window_rows
                self.metrics.fetched_rows = self.data.fetched_rows
        # One line when an outage starts and one when it ends, not one per poll.
        if not ok and self._down_since is None:
            self._down_since = time.monotonic()
            self._warn(f"flare follow: backend unavailable: {error}; retrying")
        elif ok and self._down_since is not None:
            self._warn(f"flare follow: backend back after {time.monotonic() - self._down_since:.0f} s")
            self._down_since = None

    # -- the loop

    def run(self, interval_s: float) -> None:
        while not self.stop.is_set():
            self.poll_once()
            self.stop.wait(interval_s)

    def close(self) -> None:
        self.backend.close()


class AmbiguousJob(Exception):
    """No --job, and the backend holds several: a usage error (exit 2)."""


def health_endpoint_from_env(environ=None) -> str:
    """Where /healthz and /metrics listen: FLARE_FOLLOW_HOST, else FLARE_HOST (the one
    host setting every Flare endpoint follows), else loopback; on FLARE_FOLLOW_PORT,
    else a free port (printed at start)."""
    import os

    env = os.environ if environ is None else environ
    host = env.get("FLARE_FOLLOW_HOST") or env.get("FLARE_HOST") or "127.0.0.1"
    return f"{host}:{env.get('FLARE_FOLLOW_PORT') or 0}"


def main(
    backend_spec: str,
    job: str | None,
    config: DiagnosisConfig | None,
    interval_s: float,
    otlp_endpoint: str | None,
    out: TextIO | None,
    *,
    health_endpoint: str | None = "",
    backend_opts: dict[str, Any] | None = None,
    stop: threading.Event | None = None,
    collector: str | None = None,
) -> int:
    """Run the follow service until SIGINT/SIGTERM (or `stop`); the exit status.
    `health_endpoint` "" is the deployment default (`health_endpoint_from_env`), None
    serves none."""
    if health_endpoint == "":
        health_endpoint = health_endpoint_from_env()
    out = out or sys.stdout
    if interval_s <= 0:
        print("flare: --interval must be positive", file=sys.stderr)
        return 2
    try:
        service = FollowService(backend_spec, job, config, otlp_endpoint, out, backend_opts,
                                capture=None if collector is None else _collector_capture(collector, job))
    except BackendError as exc:
        print(f"flare: {exc}", file=sys.stderr)
        return 2
    if stop is not None:
        service.stop = stop
    health = None
    if health_endpoint:
        try:
            health = HealthServer(health_endpoint, service.metrics)
        except OSError as exc:
            print(f"flare: cannot serve health on {health_endpoint}: {exc.strerror}", file=sys.stderr)
            return 2
        print(f"flare follow: health {health.url}/healthz, metrics {health.url}/metrics",
              file=sys.stderr, flush=True)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: service.stop.set())
    try:
        service.run(interval_s)
    except AmbiguousJob as exc:
        print(f"flare: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if health is not None:
            health.stop()
        service.close()
    return 0



def _collector_capture(url: str, job: str | None):
    """CaptureRequests that ask a Flare collector over HTTP (`--follow --collector`)."""
    from flare.diagnostics.hotspots import CaptureRequests

    return CaptureRequests(collector_asker(url), job)

