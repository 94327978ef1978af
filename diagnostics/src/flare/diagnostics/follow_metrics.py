"""The follow service's own metrics and health (`/metrics`, `/healthz`), with the
per-rank gauges the Grafana dashboard reads, from the follow window: a deployment
that keeps its spans in Tempo or Jaeger gets the dashboard from the follow service
alone.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from flare.diagnostics.incremental import IncrementalJobData
from flare.wire import semconv as sc


def rank_gauges(data: IncrementalJobData, recent_steps: int = 10,
                culprit_steps: int = 100) -> list[tuple[str, dict[str, str], float]]:
    """The per-rank gauges of the Grafana dashboard, from the follow window.

    Same names and meaning as the collector's `query_api.RankGauges`, so the dashboard
    works with either scrape target: mean step time and collective wait over the last
    `recent_steps` complete steps, and each rank's share of the last `culprit_steps`
    steps in which it was the culprit by the correlator's own rule
    (`correlation_windows.culprit`: least collective wait, ARCHITECTURE §4).
    """
    last = data.complete_step
    if last < 0:
        return []
    wait_key = sc.STEP_COLLECTIVE_WAIT_MS
    table = data.step_summary([wait_key], first_step=max(0, last - culprit_steps + 1),
                              last_step=last)
    if table.num_rows == 0:
        return []
    from flare.processors.correlation_windows import RankStep, culprit

    rows = table.to_pylist()
    out: list[tuple[str, dict[str, str], float]] = []
    recent: dict[int, list[tuple[float, float | None]]] = {}
    by_step: dict[int, dict[int, RankStep]] = {}
    for row in rows:
        if row["step"] > last - recent_steps:
            recent.setdefault(row["rank"], []).append((row["duration_ms"], row[wait_key]))
        wait = row[wait_key]
        by_step.setdefault(row["step"], {})[row["rank"]] = RankStep(
            b"", b"", int(row["start_ns"]), int(row["end_ns"]),
            None if wait is None or wait != wait else float(wait))
    # The culprit of a step as the collector's correlator names it (least collective
    # wait, ties to the later finisher), so both scrape targets show the same gauge.
    least = {step: culprit(ranks)[0] for step, ranks in by_step.items() if len(ranks) > 1}
    for rank, values in sorted(recent.items()):
        labels = {"flare_job": data.job, "rank": str(rank)}
        out.append(("flare_rank_step_seconds", labels,
                    sum(d for d, _ in values) / len(values) / 1e3))
        waits = [w for _, w in values if w is not None]
        if waits:
            out.append(("flare_rank_wait_seconds", labels, sum(waits) / len(waits) / 1e3))
    if least:
        counts: dict[int, int] = {}
        for rank in least.values():
            counts[rank] = counts.get(rank, 0) + 1
        for rank, count in sorted(counts.items()):
            out.append(("flare_rank_culprit_ratio", {"flare_job": data.job, "rank": str(rank)},
                        count / len(least)))
    return out


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
        self.rank_gauges: list[tuple[str, dict[str, str], float]] = []
        self.anomalies_by_rank: dict[tuple[str, str, str], int] = {}  # (job, kind, rank)

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
            samples = list(self.rank_gauges) + [
                ("flare_anomalies", {"flare_job": job, "kind": kind, "rank": rank}, float(count))
                for (job, kind, rank), count in sorted(self.anomalies_by_rank.items())
            ]
            for name, labels, value in samples:
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
