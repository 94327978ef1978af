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
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.compute as pc

from flare.diagnostics import pipeline, report_text, writeback
from flare.diagnostics.backends import BackendError, open_backend
from flare.diagnostics.backends.arrow import ArrowJobData
from flare.diagnostics.columns import Table
from flare.diagnostics.complete import CompleteSteps
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData, SpanQuery, SpanReader
from flare.exporters.store import spans_table
from flare.instrumentation import semconv as sc

# A rank that has not reported a step this many steps after the others is not waited
# for: its steps are closed anyway (rank_missing reports it).
MAX_OPEN_STEPS = 50
# Two labels of one kind, rank set and cause whose onsets lie this close are one anomaly
# seen twice (a change point's onset moves a little as more steps arrive).
SAME_ONSET_STEPS = 25


# ---------------------------------------------------------------- incremental data


class IncrementalJobData(SpanReader):
    """A JobData whose step spans come from a local window refreshed incrementally.

    `refresh()` fetches the steps after the last complete one and keeps the last
    `max_steps` steps, fewer when ranks × steps would pass `max_rows` (memory stays
    bounded at thousands of ranks); everything a detector
    asks about `train.step` is answered from the window (through `ArrowJobData`, so
    answers match a one-shot diagnosis), anything else goes to the backend.
    """

    def __init__(self, inner: JobData, max_steps: int = 5000, max_rows: int = 2_000_000) -> None:
        self.inner = inner
        self.job = inner.job
        self.backend = inner.backend
        self.max_steps = max_steps
        self.max_rows = max_rows
        self._window: pa.Table | None = None
        self.complete_step = -1  # every step ≤ this is final in the window
        self.fetched_rows = 0
        self._local = ArrowJobData(self.job, self.backend, self._from_window)

    # -- refresh

    def refresh(self) -> int:
        """Fetch the open steps; returns the number of step spans fetched."""
        # The window is Arrow (concatenated, filtered, read by ArrowJobData).
        fresh = _as_arrow(self.inner.spans([sc.SPAN_STEP], first_step=self.complete_step + 1))
        self.fetched_rows += fresh.num_rows
        if self._window is None:
            self._window = fresh
        else:
            kept = self._window.filter(
                pc.fill_null(pc.less_equal(self._window["step"], self.complete_step), False)
            )
            self._window = pa.concat_tables([kept, fresh.select(kept.column_names)])
        self._advance()
        return fresh.num_rows

    def _advance(self) -> None:
        window = self._window
        if window is None or window.num_rows == 0:
            return
        steps = window.filter(pc.and_(pc.is_valid(window["rank"]), pc.is_valid(window["step"])))
        if steps.num_rows == 0:
            return
        per_rank = steps.group_by("rank").aggregate([("step", "max")])["step_max"]
        newest = pc.max(per_rank).as_py()
        laggard = pc.min(per_rank).as_py()
        # A step is complete once every rank has reported a later one.
        self.complete_step = max(self.complete_step, min(laggard - 1, newest - 1),
                                 newest - MAX_OPEN_STEPS)
        # The window holds at most `max_rows` step spans: fewer steps for more ranks.
        ranks = max(1, len(per_rank))
        oldest_kept = newest - max(MAX_OPEN_STEPS * 2, min(self.max_steps, self.max_rows // ranks))
        if pc.min(steps["step"]).as_py() < oldest_kept:
            self._window = window.filter(
                pc.fill_null(pc.greater_equal(window["step"], oldest_kept), False)
            )

    def _from_window(
        self, names: Sequence[str], first_step: int | None, last_step: int | None,
        ranks: Sequence[int] | None,
    ) -> pa.Table:
        return self._window if self._window is not None else spans_table({})

    # -- JobData

    def query(self, q: SpanQuery) -> Table:
        return (self._local if q.names == (sc.SPAN_STEP,) else self.inner).query(q)

    def step_summary(self, attributes: Sequence[str] = (), step_bucket: int = 1,
                     first_step: int | None = None, last_step: int | None = None) -> Table:
        return self._local.step_summary(attributes, step_bucket, first_step, last_step)

    def steps_range(self) -> tuple[int, int] | None:
        return self._local.steps_range()

    def ranks(self) -> list[int]:
        return self._local.ranks()

    def world_size(self) -> int | None:
        return self._local.world_size()

    def rank_activity(self, names: Sequence[str]) -> Table:
        source = self._local if list(names) == [sc.SPAN_STEP] else self.inner
        return source.rank_activity(names)

    def count(self, names: Sequence[str]) -> int:
        return self.spans(names, columns=["span_id"]).num_rows

    def __getattr__(self, name: str) -> Any:
        # A JobData method added after this class was written is answered by the
        # backend itself: correct, only not incremental.
        return getattr(self.inner, name)

    @property
    def window_rows(self) -> int:
        return 0 if self._window is None else self._window.num_rows


# ---------------------------------------------------------------- dashboard gauges


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


# ---------------------------------------------------------------- labels


@dataclasses.dataclass
class Labeller:
    """Decides which anomalies are new; remembers only what was written."""

    sent: dict[str, Anomaly] = dataclasses.field(default_factory=dict)
    sent_signatures: list[tuple[str, tuple[int, ...], str, int | None]] = dataclasses.field(
        default_factory=list
    )

    @staticmethod
    def signature(anomaly: Anomaly) -> tuple[str, tuple[int, ...], str, int | None]:
        return anomaly.kind, tuple(sorted(anomaly.ranks)), anomaly.cause, anomaly.first_step

    def is_new(self, anomaly: Anomaly) -> bool:
        if anomaly.key in self.sent:
            return False
        kind, ranks, cause, first = self.signature(anomaly)
        for s_kind, s_ranks, s_cause, s_first in self.sent_signatures:
            if (s_kind, s_ranks, s_cause) != (kind, ranks, cause):
                continue
            if first is None or s_first is None or abs(first - s_first) <= SAME_ONSET_STEPS:
                return False
        return True

    def remember(self, anomaly: Anomaly) -> None:
        self.sent[anomaly.key] = anomaly
        self.sent_signatures.append(self.signature(anomaly))

    def remember_written(self, table: Table) -> None:
        """Seed from `flare.anomaly` spans already in the backend (a restarted service)."""
        for text in table.column("attributes").to_pylist() if table.num_rows else []:
            try:
                attrs = json.loads(text or "{}")
                self.sent_signatures.append((
                    str(attrs[sc.ANOMALY_KIND]),
                    tuple(sorted(int(r) for r in attrs.get(sc.ANOMALY_RANKS) or [])),
                    str(attrs.get(sc.ANOMALY_CAUSE)),
                    attrs.get(sc.ANOMALY_FIRST_STEP),
                ))
            except (ValueError, KeyError, TypeError):
                continue


# ---------------------------------------------------------------- metrics and health


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


# ---------------------------------------------------------------- the service


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
        self.config = config or DiagnosisConfig()
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
        try:
            self.labeller.remember_written(inner.spans([sc.SPAN_ANOMALY]))
            if getattr(self.backend, "path", None) is None:
                # On Jaeger and Tempo a job is a service, and written-back labels are
                # the diagnostics service's spans, each naming its job.
                written = _as_arrow(self.backend.job_data(writeback.SERVICE).spans(
                    [sc.SPAN_ANOMALY]))
                if written.num_rows:
                    mine = [json.loads(text or "{}").get(sc.JOB_ID) == self.job
                            for text in written.column("resource").to_pylist()]
                    self.labeller.remember_written(written.filter(pa.array(mine)))
        except BackendError:
            pass  # best effort: without it a restart may repeat a label, never lose one
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


def control_headers() -> dict[str, str]:
    """The control channel's credentials from the environment: the job's token
    (FLARE_JOB_TOKEN: that job only) and the operator's (FLARE_OPERATOR_TOKEN: any job)."""
    from flare.diagnostics.backends.http_json import header_token

    headers = {}
    for env, header in ((sc.ENV_JOB_TOKEN, sc.HEADER_JOB_TOKEN),
                        (sc.ENV_OPERATOR_TOKEN, sc.HEADER_OPERATOR_TOKEN)):
        value = os.environ.get(env)
        if value:
            headers[header] = header_token(value, env)
    return headers


def collector_asker(url: str):
    """`ask(job, ranks, steps, stacks=True)` → the answer of a Flare collector's
    /flare/v1/capture (token and TLS from the FLARE_BACKEND_* settings, as for the
    backends, and the control channel's from `control_headers`); transport and HTTP
    failures are BackendErrors."""
    from flare.diagnostics.backends.http_json import JsonClient

    client = JsonClient(url, "the collector")
    headers = control_headers()

    def ask(job_id: str | None, ranks: list[int], steps: int, stacks: bool = True) -> dict:
        return client.post_json("/flare/v1/capture",
                                {"job": job_id, "ranks": ranks, "steps": steps, "stacks": stacks},
                                headers)

    ask.close = client.close
    return ask


def _collector_capture(url: str, job: str | None):
    """CaptureRequests that ask a Flare collector over HTTP (`--follow --collector`)."""
    from flare.diagnostics.hotspots import CaptureRequests

    return CaptureRequests(collector_asker(url), job)


def _as_arrow(table: Table | pa.Table) -> pa.Table:
    return table.to_arrow() if isinstance(table, Table) else table
