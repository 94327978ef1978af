"""One diagnosis: run every detector over one job, merge, order, attach evidence.

Detectors ask the backend for the same aggregates (the step summary above all);
`CachedJobData` (cached.py) answers repeated questions once, so a diagnosis costs one
pass over the job's step spans whatever the number of detectors. Merging and ordering
the labels is merging.py's; what the report says once about what Flare could not
measure, caveats.py's; the live alerts kept or withdrawn, live_alerts.py's.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from flare.diagnostics import caveats, merging, registry
from flare.diagnostics.cached import CachedJobData  # (benchmarks import it from here too)
from flare.diagnostics.live_alerts import live_alerts as live_alerts  # re-exported: run.py, tests
from flare.diagnostics.live_alerts import withdrawn as withdrawn  # re-exported: run.py, tests
from flare.diagnostics.merging import merge as merge  # (and re-exported: tests)
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.exporters import store as flare_store
from flare.wire import semconv as sc


@dataclasses.dataclass
class Diagnosis:
    job: str
    backend: str
    steps: tuple[int, int] | None
    anomalies: list[Anomaly]
    evidence_links: dict[str, list[tuple[str, str]]]
    detector_errors: dict[str, str]
    # The cached view the detectors read: reports reuse its aggregates, not re-query.
    job_data: JobData | None = None
    # Where the time went: the rank-level labels' seconds and shares of the run, then
    # what no label explains (ledger.where_the_time_went); empty without step data.
    time_lost: list[dict] = dataclasses.field(default_factory=list)
    # Live alerts (flare run, --follow) the final diagnosis does not keep, each with why.
    withdrawn: list[dict] = dataclasses.field(default_factory=list)
    # Every live alert flare run printed, in order, each with whether this report keeps it.
    live_alerts: list[dict] = dataclasses.field(default_factory=list)
    # Ranks the host starved of CPU (other work on the machine, not the job's doing):
    # reported beside the anomalies, not as one (see merging.host_contention).
    host_contention: list[dict] = dataclasses.field(default_factory=list)
    # Ranks with collectives Flare could not time (issued from C++ or a compiled graph):
    # their wait is unknown and inside compute; said once here and in the labels'
    # evidence (see caveats.wait_unknown).
    wait_unknown: dict | None = None
    # Ranks whose host gives no scheduler statistics (no run-queue wait: not Linux, or a
    # container that hides /proc/thread-self/schedstat): said once (see
    # caveats.contention_unknown).
    contention_unknown: dict | None = None
    # Lasting straggler labels that cost under straggler_min_run_share of the whole run
    # (short episodes): not reported, kept to say why a live alert of one was withdrawn.
    blips: list[Anomaly] = dataclasses.field(default_factory=list)
    # Ranks that trained and ended no step Flare could see (their optimizer is not one it
    # times): the whole step is unaccounted for; said once (see caveats.steps_unseen).
    steps_unseen: dict | None = None
    # The job compared with (--baseline-job): {"job", "picked": "given"|"auto", "signature"}.
    baseline: dict | None = None

    def to_json(self) -> dict:
        out = {
            "job": self.job,
            "backend": self.backend,
            "steps": None if self.steps is None else {"first": self.steps[0], "last": self.steps[1]},
            "anomalies": [a.to_json() for a in self.anomalies],
        }
        if self.baseline:
            out["baseline"] = dict(self.baseline)
        if self.time_lost:
            out["time_lost"] = list(self.time_lost)
        if self.withdrawn:
            out["withdrawn_alerts"] = list(self.withdrawn)
        if self.live_alerts:
            out["live_alerts"] = list(self.live_alerts)
        if self.host_contention:
            out["host_contention"] = list(self.host_contention)
        if self.wait_unknown:
            out["wait_unknown"] = dict(self.wait_unknown)
        if self.contention_unknown:
            out["contention_unknown"] = dict(self.contention_unknown)
        if self.steps_unseen:
            out["steps_unseen"] = dict(self.steps_unseen)
        if self.detector_errors:  # a partial report says so in itself, not only on stderr
            out["detector_errors"] = dict(self.detector_errors)
        return out

    def partial_text(self) -> str:
        """What a partial report says at its top (text and HTML): which detectors failed."""
        return ("these detectors failed, their anomalies are missing: "
                + "; ".join(f"{name} ({error})" for name, error in sorted(self.detector_errors.items())))


def diagnose(
    job: JobData,
    config: DiagnosisConfig | None = None,
    detectors: dict[str, Callable[[JobData, DiagnosisConfig], list[Anomaly]]] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Diagnosis:
    config = config or DiagnosisConfig()
    cached = CachedJobData(job)
    if not config.stopped_by_user and _stopped_by_user(cached):
        config = dataclasses.replace(config, stopped_by_user=True)
    if config.baseline is not None and not isinstance(config.baseline, CachedJobData):
        config = dataclasses.replace(config, baseline=CachedJobData(config.baseline))
    errors: dict[str, str] = {}
    found: list[Anomaly] = []
    for name, detect in (detectors or registry.discover()).items():
        try:
            found.extend(detect(cached, config))
        except Exception as exc:  # one broken detector must not hide the others' findings
            if flare_store.is_interrupt(exc):  # Ctrl-C inside a query: stop, no partial report
                raise KeyboardInterrupt from exc
            errors[name] = f"{type(exc).__name__}: {exc}"
            (warn or _stderr)(f"flare: detector {name} failed: {type(exc).__name__}: {exc}")
    anomalies, host = merging.host_contention(merging.order(merge(found)))
    anomalies, blips = merging.short_episodes(anomalies, config, cached.steps_range())
    unknown = caveats.wait_unknown(cached, config, anomalies)
    from flare.diagnostics import hotspots

    hotspots.attach(cached, anomalies)
    hotspots.name_phases(cached, anomalies)
    links = {a.key: evidence_spans(cached, a) for a in anomalies}
    for anomaly in anomalies:
        if not anomaly.trace_ids:
            anomaly.trace_ids = list(dict.fromkeys(t for t, _ in links[anomaly.key]))[:5]
    return Diagnosis(job.job, job.backend, cached.steps_range(), anomalies, links, errors, cached,
                     _time_lost(cached, config, anomalies + host),
                     host_contention=[merging.host_row(a) for a in host], wait_unknown=unknown,
                     contention_unknown=caveats.contention_unknown(cached, config),
                     blips=blips, steps_unseen=caveats.steps_unseen(cached))


def _stopped_by_user(job: JobData) -> bool:
    """Whether `flare run` recorded that its user stopped the job (run._record_stop)."""
    return has_span(job, sc.SPAN_RUN_STOP)


def has_span(job: JobData, name: str) -> bool:
    """Whether the job holds a span named `name` (one Flare itself writes: a stop, a
    written-back label); a backend that cannot say reads as no."""
    try:
        return job.spans([name], columns=["start_ns"], limit=1).num_rows > 0
    except Exception as exc:
        if flare_store.is_interrupt(exc):
            raise KeyboardInterrupt from exc
        return False


def _time_lost(job: JobData, config: DiagnosisConfig, anomalies: list[Anomaly]) -> list[dict]:
    """The closing table: who cost the run how much (straggler labels, from the ledger;
    a job-wide slowdown, from its change point), then what no label explains."""
    from flare.diagnostics import frame as frames
    from flare.diagnostics import ledger as ledgers
    from flare.diagnostics.detectors import straggler

    frame = frames.load(job, config)
    if frame is None or len(frame.ranks) < 2:
        return []
    import numpy as np

    book, _ = straggler.ledger(job, frame, config)
    labels = [a for a in anomalies if a.kind in ("straggler", "hang")
              or (a.kind == "fail_slow" and not a.ranks)]

    def cells(anomaly: Anomaly):
        if not anomaly.ranks or anomaly.first_step is None or anomaly.last_step is None:
            return None
        rows = [frame.row(r) for r in anomaly.ranks if r in set(frame.ranks.tolist())]
        stalls = anomaly.evidence.get("stall_steps")
        if stalls:  # a pattern of stalls: its stall steps, not the steps between
            period = anomaly.evidence.get("period_steps")
            if period:  # (the evidence lists the first 50)
                stalls = range(int(stalls[0]), int(anomaly.last_step) + 1, int(period))
            cols = np.unique([frame.column(step) for step in stalls])
            later = anomaly.evidence.get("later")
            if later and later.get("pattern") == "lasting" and later.get("first_step") is not None:
                # (one label over its stalls and the later stretch it is slower on every step)
                cols = np.union1d(cols, np.flatnonzero(
                    (frame.steps >= later["first_step"]) & (frame.steps <= anomaly.last_step)))
        else:
            cols = np.flatnonzero((frame.steps >= frame.steps[frame.column(anomaly.first_step)])
                                  & (frame.steps <= anomaly.last_step))
        return (rows, cols) if rows and cols.size else None

    return ledgers.where_the_time_went(book, labels, cells, ledgers.phase_time(frame, book.run_ms))


def evidence_spans(job: JobData, anomaly: Anomaly, limit: int = 8) -> list[tuple[str, str]]:
    """Spans a person should open to see the anomaly: the kind's own spans on its
    ranks (hang dumps, failed steps) else the ranks' first affected step spans."""
    names = {"hang": [sc.SPAN_HANG], "error": [sc.SPAN_STEP, sc.SPAN_ERROR],
             "rank_missing": [sc.SPAN_HEARTBEAT, sc.SPAN_STEP]}.get(anomaly.kind, [sc.SPAN_STEP])
    first = anomaly.first_step
    table = job.spans(
        names, first_step=None if anomaly.kind in ("hang", "rank_missing", "error") else first,
        last_step=None if first is None or anomaly.kind in ("hang", "rank_missing", "error")
        else first + 2,
        ranks=anomaly.ranks or None, columns=["trace_id", "span_id", "start_ns"],
        status_code=2 if anomaly.kind == "error" else None,
    )
    if anomaly.kind == "rank_missing":
        table = table.slice(max(0, table.num_rows - limit))
    rows = table.slice(0, limit)
    out = [(t, s) for t, s in zip(rows["trace_id"].to_pylist(), rows["span_id"].to_pylist(), strict=False)
           if t and s]
    if anomaly.evidence.get("hotspots"):  # and the captured steps its line came from
        captured = job.spans([sc.SPAN_CAPTURE], first_step=anomaly.first_step, last_step=anomaly.last_step,
                             columns=["trace_id", "span_id", "rank"]).to_pylist()
        culprits = set(anomaly.ranks)
        captured.sort(key=lambda r: r["rank"] not in culprits)  # the culprit's first, then the peer's
        out += [(r["trace_id"], r["span_id"]) for r in captured[:CAPTURE_LINKS] if r["trace_id"] and r["span_id"]]
    return out


CAPTURE_LINKS = 4  # captured steps an anomaly span links to (culprit's first, then the peer's)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
