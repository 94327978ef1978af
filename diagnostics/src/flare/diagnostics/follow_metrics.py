"""The follow service's own metrics and health (`/metrics`, `/healthz`), with the
per-rank gauges the Grafana dashboard reads, from the follow window: a deployment
that keeps its spans in Tempo or Jaeger gets the dashboard from the follow service
alone.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from flare.collector import rank_gauges as gauges
from flare.diagnostics.incremental import IncrementalJobData
from flare.wire import semconv as sc


def rank_gauges(data: IncrementalJobData, recent_steps: int = gauges.RECENT_STEPS,
                culprit_steps: int = gauges.CULPRIT_STEPS) -> list[gauges.Sample]:
    """The per-rank gauges of the Grafana dashboard, from the follow window.

    What they are is `flare.collector.rank_gauges`, shared with the collector's
    `query_api.RankGauges`, so the dashboard works with either scrape target; this
    fetches the window's rows for it: each rank's step time and collective wait in the
    last `recent_steps` complete steps, and the culprit of each of the last
    `culprit_steps` complete steps that more than one rank reported. The window may not
    hold the correlator's `train.step.ranks` spans, so the culprit is recomputed by the
    correlator's own rule (`correlation_windows.culprit`: least collective wait, ties
    to the later finisher, ARCHITECTURE §4).
    """
    last = data.complete_step
    if last < 0:
        return []
    wait_key = sc.STEP_COLLECTIVE_WAIT_MS
    first = max(0, last - max(recent_steps, culprit_steps) + 1)
    table = data.step_summary([wait_key], first_step=first, last_step=last)
    if table.num_rows == 0:
        return []
    from flare.processors.correlation_windows import RankStep, culprit

    steps: list[gauges.RankSteps] = []
    by_step: dict[int, dict[int, RankStep]] = {}
    for row in table.to_pylist():
        step, rank, wait = row["step"], row["rank"], row[wait_key]
        if step > last - recent_steps:
            steps.append(gauges.RankSteps(data.job, rank, 1, row["duration_ms"],
                                          int(wait is not None), 0.0 if wait is None else wait))
        if step > last - culprit_steps:
            by_step.setdefault(step, {})[rank] = RankStep(
                b"", b"", int(row["start_ns"]), int(row["end_ns"]),
                None if wait is None or wait != wait else float(wait))
    culprits = [gauges.StepCulprits(data.job, culprit(ranks)[0])
                for ranks in by_step.values() if len(ranks) > 1]
    return gauges.samples(steps, culprits)


class FollowMetrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.polls = 0
        self.poll_errors = 0
        self.write_errors = 0
        self.anomalies: dict[str, int] = {}
        self.last_poll_s = 0.0
        self.last_success_unix = 0.0
        self.backend_up = 0
        self.last_error = ""
        self.steps_complete = -1
        self.window_rows = 0
        self.fetched_rows = 0
        self.pending = 0
        self.rank_gauges: list[gauges.Sample] = []
        self.anomalies_by_rank: dict[tuple[str, str, str], int] = {}  # (job, kind, rank)

    def dashboard_samples(self) -> list[gauges.Sample]:
        """The dashboard's gauges this service serves, as `rank_gauges.samples` gives
        them: the window's per-rank gauges and the anomalies written so far."""
        with self.lock:
            return self._dashboard_samples()

    def _dashboard_samples(self) -> list[gauges.Sample]:
        return list(self.rank_gauges) + gauges.samples(anomalies=[
            gauges.AnomalyCount(job, kind, (rank,), count)
            for (job, kind, rank), count in self.anomalies_by_rank.items()])

    def prometheus(self) -> str:
        from flare.collector.telemetry import Family, render

        with self.lock:
            families = {
                "flare_follow_polls_total": Family("counter", [({}, self.polls)]),
                "flare_follow_poll_errors_total": Family("counter", [({}, self.poll_errors)]),
                "flare_follow_write_errors_total": Family("counter", [({}, self.write_errors)]),
                "flare_follow_backend_up": Family("gauge", [({}, self.backend_up)]),
                "flare_follow_last_poll_seconds": Family("gauge", [({}, self.last_poll_s)]),
                "flare_follow_last_success_timestamp_seconds": Family(
                    "gauge", [({}, self.last_success_unix)]),
                "flare_follow_complete_step": Family("gauge", [({}, self.steps_complete)]),
                "flare_follow_window_spans": Family("gauge", [({}, self.window_rows)]),
                "flare_follow_fetched_spans_total": Family("counter", [({}, self.fetched_rows)]),
                "flare_follow_pending_anomalies": Family("gauge", [({}, self.pending)]),
                # every kind from zero: a counter's series exists before its first
                # increment, so the dashboard's panel reads 0, not "no data"
                "flare_follow_anomalies_total": Family("counter", [
                    ({"kind": kind}, self.anomalies.get(kind, 0))
                    for kind in sorted({*sc.ANOMALY_KINDS, *self.anomalies})]),
            }
            for name, labels, value in self._dashboard_samples():
                families.setdefault(name, Family("gauge", [])).points.append((labels, value))
        return render(families)

    def health(self) -> tuple[int, dict[str, Any]]:
        with self.lock:
            ok = self.backend_up == 1
            return (200 if ok else 503), {
                "status": "ok" if ok else ("starting" if self.polls == 0 else "backend_down"),
                "polls": self.polls,
                "last_success_unix": self.last_success_unix,
                "complete_step": self.steps_complete,
                "last_error": self.last_error or None,
            }


class HealthServer:
    """The service's `/metrics` and `/healthz`, on the collector's HTTP server (framing,
    caps and errors as its extensions have them)."""

    def __init__(self, endpoint: str, metrics: FollowMetrics) -> None:
        from flare.collector.config import HttpExtensionConfig
        from flare.collector.config_values import Endpoint
        from flare.collector.extensions import HttpExtension
        from flare.collector.telemetry import Counters

        def respond(method, path, query, headers):
            if path.startswith("/metrics"):
                return 200, {"Content-Type": "text/plain; version=0.0.4"}, metrics.prometheus().encode()
            if path.startswith("/healthz"):
                status, doc = metrics.health()
                return status, {"Content-Type": "application/json"}, json.dumps(doc).encode()
            return 404, {"Content-Type": "text/plain"}, b"not found\n"

        host, _, port = endpoint.rpartition(":")
        self.server = HttpExtension("flare_follow", HttpExtensionConfig(Endpoint(host or "127.0.0.1", int(port or 0))),
                                    respond, Counters())
        self.server.start()

    @property
    def url(self) -> str:
        return f"http://{self.server.endpoint}"

    def stop(self) -> None:
        self.server.stop()
