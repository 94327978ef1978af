"""One diagnosis: run every detector over one job, merge, order, attach evidence.

Detectors ask the backend for the same aggregates (the step summary above all);
`CachedJobData` answers repeated questions once, so a diagnosis costs one pass
over the job's step spans whatever the number of detectors.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

from flare.diagnostics import registry
from flare.diagnostics.columns import Table
from flare.diagnostics.model import (
    Anomaly,
    DiagnosisConfig,
    JobData,
    SpanQuery,
    SpanReader,
    job_source,
)
from flare.exporters import store as flare_store
from flare.instrumentation import semconv as sc

# Labels that, on the same ranks and cause as a straggler, describe the same problem.
_SUBSUMED_BY_STRAGGLER = {"dataloader_stall": "input", "gc_pause": "gc"}
_KIND_ORDER = {k: i for i, k in enumerate(
    ("hang", "error", "rank_missing", "straggler", "fail_slow", "regression", "collective_slow",
     "dataloader_stall", "gc_pause", "gpu_throttle", "kernel_slow", "launch_bound", "gpu_idle"))}


class CachedJobData(SpanReader):
    """A JobData that remembers answers (keyed by the call's arguments)."""

    def __init__(self, inner: JobData) -> None:
        self._inner = inner
        self.job = inner.job
        self.backend = inner.backend
        self._cache: dict[tuple, object] = {}

    def _cached(self, name: str, *args: object) -> object:
        key = (name, *(tuple(a) if isinstance(a, (list, tuple)) else a for a in args))
        if key not in self._cache:
            self._cache[key] = getattr(self._inner, name)(*args)
        return self._cache[key]

    def query(self, q: SpanQuery) -> Table:
        return self._cached("query", q)

    def step_summary(self, attributes: Sequence[str] = (), step_bucket: int = 1,
                     first_step: int | None = None, last_step: int | None = None) -> Table:
        return self._cached("step_summary", tuple(attributes), step_bucket, first_step, last_step)

    def steps_range(self) -> tuple[int, int] | None:
        numbers = self._step_numbers()
        return numbers[0] if numbers is not None else self._cached("steps_range")

    def _step_numbers(self) -> tuple[tuple[int, int] | None, int] | None:
        """Range and distinct count in one query, where the backend has it (ClickHouse:
        each is a scan of the job's step spans)."""
        if not callable(getattr(self._inner, "step_numbers", None)):
            return None
        return self._cached("step_numbers")

    def memo(self, key: tuple, build: Callable[[], object]) -> object:
        """A value derived from the job (the rank × step frame), built once per
        diagnosis for every detector that asks."""
        key = ("memo", *key)
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def step_count(self) -> int | None:
        numbers = self._step_numbers()
        if numbers is not None:
            return numbers[1]
        if not callable(getattr(self._inner, "step_count", None)):
            return None
        return self._cached("step_count")

    def ranks(self) -> list[int]:
        return self._cached("ranks")

    def world_size(self) -> int | None:
        return self._cached("world_size")

    def count(self, names: Sequence[str]) -> int:
        return self._cached("count", tuple(names))

    def rank_activity(self, names: Sequence[str]) -> Table:
        return self._cached("rank_activity", tuple(names))

    def rank_resources(self, names: Sequence[str]) -> Table:
        method = getattr(self._inner, "rank_resources", None)
        if not callable(method):
            return self._cached("spans", tuple(names), (), None, None, None, ("rank", "resource"),
                                None, None)
        return self._cached("rank_resources", tuple(names))

    def source(self) -> str | None:
        if ("source",) not in self._cache:
            self._cache[("source",)] = job_source(self._inner)
        return self._cache[("source",)]


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
    # reported beside the anomalies, not as one (see _host_contention).
    host_contention: list[dict] = dataclasses.field(default_factory=list)
    # Ranks with collectives Flare could not time (issued from C++ or a compiled graph):
    # their wait is unknown and inside compute; said once here and in the labels'
    # evidence (see _wait_unknown).
    wait_unknown: dict | None = None
    # Ranks whose host gives no scheduler statistics (no run-queue wait: not Linux, or a
    # container that hides /proc/thread-self/schedstat): said once (see _contention_unknown).
    contention_unknown: dict | None = None
    # Lasting straggler labels that cost under straggler_min_run_share of the whole run
    # (short episodes): not reported, kept to say why a live alert of one was withdrawn.
    blips: list[Anomaly] = dataclasses.field(default_factory=list)
    # Ranks that trained and ended no step Flare could see (their optimizer is not one it
    # times): the whole step is unaccounted for; said once (see _steps_unseen).
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
    anomalies, host = _host_contention(order(merge(found)))
    anomalies, blips = _short_episodes(anomalies, config, cached.steps_range())
    unknown = _wait_unknown(cached, config, anomalies)
    from flare.diagnostics import hotspots

    hotspots.attach(cached, anomalies)
    hotspots.name_phases(cached, anomalies)
    links = {a.key: evidence_spans(cached, a) for a in anomalies}
    for anomaly in anomalies:
        if not anomaly.trace_ids:
            anomaly.trace_ids = list(dict.fromkeys(t for t, _ in links[anomaly.key]))[:5]
    return Diagnosis(job.job, job.backend, cached.steps_range(), anomalies, links, errors, cached,
                     _time_lost(cached, config, anomalies + host),
                     host_contention=[_host_row(a) for a in host], wait_unknown=unknown,
                     contention_unknown=_contention_unknown(cached, config),
                     blips=blips, steps_unseen=_steps_unseen(cached))


def _short_episodes(anomalies: list[Anomaly], config: DiagnosisConfig,
                    steps: tuple[int, int] | None) -> tuple[list[Anomaly], list[Anomaly]]:
    """A lasting straggler over a short part of the run (under half its steps; not a
    periodic or intermittent stall: their thresholds are shares of the run already)
    that cost under `straggler_min_run_share` of the run: an episode in a long job,
    not a finding. A straggler over the whole run stays however small its share (a
    worker 400 ms slower in a 64-rank pipeline, its cost mostly hidden: 0.8 %). Kept
    apart, to say why a live alert of one was withdrawn."""
    if steps is None:
        return anomalies, []
    length = steps[1] - steps[0] + 1

    def short(a: Anomaly) -> bool:
        return (a.kind == "straggler" and "pattern" not in a.evidence
                and a.first_step is not None and a.last_step is not None
                and (a.last_step - a.first_step + 1) < 0.5 * length
                and a.impact < config.straggler_min_run_share)

    return [a for a in anomalies if not short(a)], [a for a in anomalies if short(a)]


STEPS_UNSEEN_TEXT = ("no step ended: steps end at a torch.optim optimizer's step() or a "
                     "flare.instrumentation.step() block, and this loop's optimizer is neither "
                     "(a framework Flare does not know). Unaccounted for: the whole step — its "
                     "compute, data loading, collective waits, phases — so no straggler, "
                     "fail-slow or regression can be told; hangs, errors and silent ranks still are")


def _steps_unseen(job: JobData) -> dict | None:
    """Ranks whose heartbeats say they trained (batches, backward passes) with no step
    ended (`flare.heartbeat.no_step_s`, sent once the watchdog has seen it for the hang
    limit): asked only of a job without one step, the report's one question then."""
    if job.steps_range() is not None:
        return None
    table = job.spans([sc.SPAN_HEARTBEAT], [sc.HEARTBEAT_NO_STEP_S, sc.HEARTBEAT_NO_STEP_BATCHES],
                      columns=["rank"])
    seconds: dict[int, float] = {}
    batches: dict[int, int] = {}
    for row in table.to_pylist():
        trained = row.get(sc.HEARTBEAT_NO_STEP_S)
        if row.get("rank") is None or trained is None:
            continue
        rank = int(row["rank"])
        seconds[rank] = max(seconds.get(rank, 0.0), float(trained))
        batches[rank] = max(batches.get(rank, 0), int(row.get(sc.HEARTBEAT_NO_STEP_BATCHES) or 0))
    if not seconds:
        return None
    return {"ranks": sorted(seconds), "trained_s": round(max(seconds.values()), 1),
            "batches": max(batches.values()), "note": STEPS_UNSEEN_TEXT}


CONTENTION_UNKNOWN_TEXT = ("report no run-queue wait (their host gives no scheduler statistics, "
                           "/proc/thread-self/schedstat): contention from other work on the host "
                           "cannot be told apart from the job's own there, and they are labelled "
                           "by their work alone")


def _contention_unknown(job: JobData, config: DiagnosisConfig) -> dict | None:
    """Ranks whose steps carry their training thread's CPU but never its run-queue wait.
    Without that wait a slowdown cannot be split into more work and a busy host, so
    no label of theirs is withdrawn as the host's (the rules need the wait to claim
    it): the report says so once rather than let "no host contention" read as measured."""
    import numpy as np

    from flare.diagnostics import frame as frames

    frame = frames.load(job, config)
    if frame is None or frame.thread_cpu is None:
        return None  # an older instrumentation, or no step summaries: nothing is claimed
    reported = np.isfinite(frame.thread_cpu).any(axis=1)
    waits = (np.isfinite(frame.runqueue).any(axis=1) if frame.runqueue is not None
             else np.zeros(len(frame.ranks), dtype=bool))
    blind = reported & ~waits
    if not blind.any():
        return None
    return {"ranks": [int(r) for r in frame.ranks[blind]], "note": CONTENTION_UNKNOWN_TEXT}


WAIT_UNKNOWN_TEXT = ("collective(s) per step that Flare could not time (issued from C++ code or a compiled "
                     "graph, not torch.distributed's Python API): their wait is unknown and "
                     "reads as compute")


def _wait_unknown(job: JobData, config: DiagnosisConfig, anomalies: list[Anomaly]) -> dict | None:
    """Ranks whose steps report collectives no wrapper timed (`flare.step.collective_untimed`).
    Their blocked time is inside compute, so a label that blames compute, or that was
    told culprit from victim by waits, may rest on it: such labels keep their ranks but
    their cause reads unknown, with the evidence, rather than a wrong claim."""
    import numpy as np

    from flare.diagnostics import frame as frames

    frame = frames.load(job, config)
    if frame is None or frame.untimed is None or not np.any(frame.untimed > 0):
        return None
    present = frame.untimed > 0
    ranks = [int(r) for r in frame.ranks[present.any(axis=1)]]
    per_step = float(np.nanmean(np.where(present, frame.untimed, np.nan)))
    steps = frame.steps[present.any(axis=0)]
    out = {"ranks": ranks, "collectives_per_step": round(per_step, 2),
           "first_step": int(steps.min()), "last_step": int(steps.max() + frame.bucket - 1),
           "note": WAIT_UNKNOWN_TEXT}
    for anomaly in anomalies:
        if anomaly.kind not in ("straggler", "fail_slow", "collective_slow"):
            continue
        anomaly.evidence["wait_unknown"] = {"ranks": ranks, "collectives_per_step": out["collectives_per_step"]}
        if anomaly.cause in ("compute", "communication"):
            anomaly.summary += (f" (cause not claimed: ranks {','.join(map(str, ranks))} ran "
                                f"{out['collectives_per_step']:g} {WAIT_UNKNOWN_TEXT}; the "
                                f"measured cause was {anomaly.cause})")
            anomaly.evidence["measured_cause"] = anomaly.cause
            anomaly.cause = "unknown"
            anomaly.confidence = min(anomaly.confidence, 0.5)
    return out


def _host_contention(anomalies: list[Anomaly]) -> tuple[list[Anomaly], list[Anomaly]]:
    """Stragglers the host starved of CPU (most of their excess was run-queue wait: other
    work on the machine) are the host's condition, not the job's fault: they leave the
    anomalies (with a fail-slow of the same ranks they explain) and are reported beside
    them. A busy shared node must not make a healthy job look broken; it is still said.
    One the job's own straggler names over the same steps is neither: that rank's extra
    run-queue wait came with its extra work and is counted there, once."""
    if not any(a.evidence.get("host_starved") for a in anomalies):
        return anomalies, []
    jobs = [a for a in anomalies if a.kind == "straggler" and not a.evidence.get("host_starved")]

    def covered(a: Anomaly) -> bool:
        return bool(a.ranks) and any(set(a.ranks) <= set(j.ranks) and _overlap(a, j) for j in jobs)

    host = [a for a in anomalies if a.evidence.get("host_starved") and not covered(a)]
    stragglers = [a for a in host if a.kind == "straggler"]
    starved = {r for a in stragglers for r in a.ranks}

    def explained(a: Anomaly) -> bool:  # a fail-slow of ranks a host-starved straggler covers
        return (a.kind == "fail_slow" and bool(a.ranks) and set(a.ranks) <= starved
                and any(_overlap(a, s) for s in stragglers))

    kept = [a for a in anomalies if not a.evidence.get("host_starved") and not explained(a)]
    return kept, [a for a in host if a.kind == "straggler" or not explained(a)]


def _host_row(anomaly: Anomaly) -> dict:
    ev = anomaly.evidence
    return {"ranks": sorted(anomaly.ranks), "first_step": anomaly.first_step,
            "last_step": anomaly.last_step, "runqueue_delta_ms": ev.get("runqueue_delta_ms"),
            "asleep_delta_ms": ev.get("asleep_delta_ms"),
            "excess_ms_per_step": ev.get("excess_ms_per_step"), "seconds": ev.get("lost_s"),
            "share": round(anomaly.impact, 4), "summary": anomaly.summary}


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


def live_alerts(alerted: Sequence[Anomaly], final: list[Anomaly]) -> list[dict]:
    """What the live monitor said, in order, each with whether this report keeps it
    (a label of its kind on the same ranks): the final report lists all of them."""
    return [{"kind": a.kind, "ranks": sorted(a.ranks), "cause": a.cause, "first_step": a.first_step,
             "kept": _kept(a, final)}
            for a in alerted]


def _kept(alert: Anomaly, final: list[Anomaly]) -> bool:
    """A label of the alert's kind on the same ranks, or one that carries it nested."""
    ranks = set(alert.ranks)
    return any((f.kind == alert.kind and set(f.ranks) == ranks) or nests(f, alert.kind, ranks)
               for f in final)


def _measured(job: JobData | None, config: DiagnosisConfig, ranks: set[int], first_step: int | None) -> str:
    """The figures behind "not confirmed": over the alert's steps to the end, the ranks'
    work (step time less collective wait) against their peers', and the peers' wait."""
    import numpy as np

    from flare.diagnostics import frame as frames

    frame = frames.load(job, config) if job is not None else None
    if frame is None or not ranks or len(frame.ranks) < 2:
        return ""
    mine = np.isin(frame.ranks, sorted(ranks))
    if not mine.any() or mine.all():
        return ""
    cols = frame.steps >= (first_step if first_step is not None else frame.steps.min())
    if not cols.any():
        return ""
    work = frame.duration - np.nan_to_num(frame.wait, nan=0.0)
    with np.errstate(all="ignore"):
        subject = float(np.nanmean(np.nanmedian(work[mine][:, cols], axis=0)))
        peers = float(np.nanmean(np.nanmedian(work[~mine][:, cols], axis=0)))
        waited = float(np.nanmean(np.nanmedian(frame.wait[~mine][:, cols], axis=0)))
    if not all(np.isfinite(v) for v in (subject, peers, waited)):
        return ""
    last = int(frame.steps[cols].max() + frame.bucket - 1)
    return (f" (steps {int(frame.steps[cols].min())}-{last}: its work {subject:.1f} ms/step against "
            f"its peers' {peers:.1f} ({subject - peers:+.1f}), the peers waiting {waited:.1f} ms/step)")


def withdrawn(alerted: Sequence[Anomaly], final: list[Anomaly], job: JobData | None = None,
              config: DiagnosisConfig | None = None, blips: Sequence[Anomaly] = ()) -> list[dict]:
    """The live alerts the final report does not keep, each with one line of why.

    An alert is kept when the final report has a label of its kind on the same ranks
    (its steps or figures may have moved as more steps came in), or carries it nested
    (a fail-slow inside the straggler behind it); one that a label of
    another kind or cause on the same ranks replaced says which; the rest were not
    confirmed once every step was in (a pass sees only the steps every rank has sent:
    a short burst can look persistent there)."""
    out = []
    for alert in alerted:
        ranks = set(alert.ranks)
        if _kept(alert, final):
            continue
        instead = next((a for a in final if ranks and ranks & set(a.ranks)), None)
        blip = next((b for b in blips if b.kind == alert.kind and set(b.ranks) == ranks), None)
        if blip is not None:
            why = (f"a short episode: steps {blip.first_step}-{blip.last_step} cost "
                   f"{blip.impact:.1%} of the run's time, under the "
                   f"{(config or DiagnosisConfig()).straggler_min_run_share:.0%} a label needs")
        elif instead is not None:
            why = (f"superseded by [{instead.kind}] ranks {','.join(map(str, instead.ranks))} "
                   f"cause {instead.cause} from step {instead.first_step}")
        else:
            why = ("not confirmed over the whole run: it did not persist once every step "
                   "was in" + _measured(job, config or DiagnosisConfig(), ranks, alert.first_step))
        out.append({"kind": alert.kind, "ranks": sorted(alert.ranks), "cause": alert.cause,
                    "first_step": alert.first_step, "reason": why})
    return out


# A job-wide slowdown that begins this few steps before a rank fails (an error, a hang,
# a rank gone) is the failure's approach or echo (the others waiting on the failing rank
# in its last steps), not a second problem. Twice the steps a slowdown must last
# (min_persist_steps): a stretch that short right before a failure is all the evidence
# there is of it (rank 2 hung at step 20 of a quiet run: `fail_slow [] communication`
# over steps 13-19 beside the hang, once in a fresh-clone run).
FAILURE_LEAD_STEPS = 10
_FAILURES = ("error", "hang", "rank_missing")


def _failure_behind(fail_slow: Anomaly, failures: list[Anomaly]) -> Anomaly | None:
    if fail_slow.ranks or fail_slow.cause not in ("communication", "unknown") or fail_slow.first_step is None:
        return None
    return next((f for f in failures if f.first_step is not None
                 and 0 <= f.first_step - fail_slow.first_step <= FAILURE_LEAD_STEPS), None)


# A phase that is the same work as a lasting slowdown's cause: an evaluation runs the
# model's forward, so a rank whose compute is slower evaluates slower too (the HF Trainer
# with a slow forward on rank 2: `straggler [2] evaluation` every 10 steps beside its
# `straggler [2] compute`, one finding).
_SAME_WORK = {"evaluation": ("compute", "cpu")}


def merge(anomalies: list[Anomaly]) -> list[Anomaly]:
    """Fold rank-level symptoms into the straggler label that already explains them."""
    stragglers = [a for a in anomalies if a.kind == "straggler"]
    failures = [a for a in anomalies if a.kind in _FAILURES]
    kept = []
    for anomaly in anomalies:
        cause = _SUBSUMED_BY_STRAGGLER.get(anomaly.kind)
        # A CPU-starved rank (a busy thread holding the GIL) stalls its data loader and
        # its collections too: symptoms of the same straggler, not separate problems.
        owner = next((s for s in stragglers
                      if cause is not None and s.cause in (cause, "cpu") and anomaly.cause == cause
                      and set(anomaly.ranks) <= set(s.ranks) and _overlap(s, anomaly)), None)
        if anomaly.kind == "collective_slow":
            # The least wait of a step is the straggler's own: a slow rank's collectives
            # look slow too. With a straggler at the same time, it is the explanation.
            owner = next((s for s in stragglers if s.cause != "communication"
                          and _overlap(s, anomaly)), None)
        failure = _failure_behind(anomaly, failures) if anomaly.kind == "fail_slow" else None
        if failure is not None:
            # (a 2-rank job whose rank 1 raised at step 20: fail_slow [] communication @16
            # beside the error, once in a quiet fresh-clone run)
            failure.evidence.setdefault("also", []).append(anomaly.summary)
            continue
        if anomaly.kind == "fail_slow" and not anomaly.ranks:
            _blame_straggler(anomaly, stragglers)
            if not anomaly.ranks and anomaly.cause == "unknown" and not anomaly.evidence.get("host_starved"):
                # A whole-job slowdown with no rank and no part to blame is what a busier
                # shared host looks like; Flare cannot see that host, so it says nothing.
                continue
        elif anomaly.kind == "fail_slow":
            _agree_with_straggler(anomaly, stragglers)
        if anomaly.kind == "fail_slow" and anomaly.ranks:
            hosts = _stragglers_behind(anomaly, stragglers)
            if hosts:
                # The job's slowdown over the same steps is what the straggler(s) cost
                # it: one finding, one label, the change point as its evidence.
                for straggler_label in hosts:
                    _nest_slowdown(straggler_label, anomaly)
                continue
        if anomaly.kind == "straggler" and anomaly.evidence.get("pattern"):
            # A rank's stalls of the same cause inside its own lasting slowdown are how
            # that slowdown shows (a slow loader stalling every other step), not a
            # second straggler: they become its evidence. So are a member's inside its
            # group's (one rank of a slowed pipeline stage arriving last in bursts, on a
            # loaded host, seen as a second label beside the stage's).
            owner = next((s for s in stragglers if s is not anomaly and not s.evidence.get("pattern")
                          and set(anomaly.ranks) <= set(s.ranks)
                          and s.cause in (anomaly.cause, *_SAME_WORK.get(anomaly.cause, ()))
                          and _covers(s, anomaly)), None)
            if owner is not None:
                ev = anomaly.evidence
                owner.evidence["stalls"] = {k: ev[k] for k in ("pattern", "period_steps", "stall_ms")
                                            if k in ev}
                owner.evidence["stalls"]["cause"] = anomaly.cause
                if set(anomaly.ranks) != set(owner.ranks):
                    owner.evidence["stalls"]["ranks"] = list(anomaly.ranks)
                if ev.get("period_steps"):
                    owner.summary += (f"; it stalls every {ev['period_steps']} steps"
                                      if anomaly.cause == owner.cause else
                                      f"; its {anomaly.cause} every {ev['period_steps']} steps "
                                      "is slower too")
                continue
        if owner is None:
            kept.append(anomaly)
        else:
            owner.evidence.setdefault("also", []).append(anomaly.summary)
    return _one_per_stretch(kept)


def _one_per_stretch(anomalies: list[Anomaly]) -> list[Anomaly]:
    """One label per rank set and cause over any stretch of steps: a straggler that
    begins inside an earlier one of the same ranks and cause (a rank's periodic stalls,
    then from some step slower on every step as well, seen on a loaded host:
    `straggler [0] compute` every 8 steps from step 8 and again from step 47) is that
    label's later evidence, not a second finding; the label spans both."""
    kept: list[Anomaly] = []
    for anomaly in sorted(anomalies, key=lambda a: (a.first_step is None, a.first_step or 0)):
        owner = next((s for s in kept if anomaly.kind == "straggler" and s.kind == "straggler"
                      and sorted(s.ranks) == sorted(anomaly.ranks) and s.cause == anomaly.cause
                      and _overlap(s, anomaly)), None)
        if owner is None:
            kept.append(anomaly)
            continue
        if owner.last_step is not None:
            owner.last_step = None if anomaly.last_step is None else max(owner.last_step, anomaly.last_step)
        owner.impact = max(owner.impact, anomaly.impact)  # (their losses share steps: not a sum)
        owner.confidence = max(owner.confidence, anomaly.confidence)
        owner.evidence["later"] = {"first_step": anomaly.first_step, "last_step": anomaly.last_step,
                                   "pattern": anomaly.evidence.get("pattern", "lasting"),
                                   "impact": round(anomaly.impact, 4)}
        owner.evidence.setdefault("also", []).append(anomaly.summary)
        period = anomaly.evidence.get("period_steps")
        owner.summary += (f"; from step {anomaly.first_step} it also stalls every {period} steps" if period
                          else f"; from step {anomaly.first_step} it is slower on every step too"
                          if "pattern" not in anomaly.evidence
                          else f"; from step {anomaly.first_step} it also stalls now and then")
    order_of = {id(a): i for i, a in enumerate(anomalies)}
    return sorted(kept, key=lambda a: order_of[id(a)])


def _stragglers_behind(fail_slow: Anomaly, stragglers: list[Anomaly]) -> list[Anomaly]:
    """The stragglers a rank-level fail-slow only restates: of its cause, inside its
    ranks, over overlapping steps, and together naming all of its ranks (two slow
    ranks of four: one fail-slow of both, one straggler each). A straggler the host
    starved is not one: that pair is the host's, reported beside the anomalies."""
    ranks = set(fail_slow.ranks)
    hosts = [s for s in stragglers if not s.evidence.get("pattern")
             and not s.evidence.get("host_starved") and set(s.ranks) <= ranks and _overlap(s, fail_slow)]
    covered = {r for s in hosts for r in s.ranks}
    # Of its cause; or two faults at once (rank 1's compute, rank 2's collections), a
    # straggler each, and the fail-slow's cause, the larger part of the mix, one of theirs.
    return hosts if covered == ranks and fail_slow.cause in {s.cause for s in hosts} else []


def _nest_slowdown(straggler_label: Anomaly, fail_slow: Anomaly) -> None:
    ev = fail_slow.evidence
    straggler_label.evidence["job_slowdown"] = {
        "ranks": sorted(fail_slow.ranks), "first_step": fail_slow.first_step,
        **{k: ev[k] for k in ("step_ms_before", "step_ms_after", "shift", "noise_units",
                              "consistency") if k in ev}}
    if "step_ms_before" in ev and "step_ms_after" in ev and not straggler_label.evidence.get("hidden_behind"):
        straggler_label.summary += (
            f"; the job's step went from {ev['step_ms_before']:.1f} to {ev['step_ms_after']:.1f} ms "
            f"(+{ev.get('shift', 0):.0%}) from step {fail_slow.first_step}")
    straggler_label.confidence = max(straggler_label.confidence, fail_slow.confidence)


def nests(label: Anomaly, kind: str, ranks: set[int]) -> bool:
    """Whether `label` carries a finding of `kind` on `ranks` as its evidence (a
    fail-slow nested in the straggler(s) behind it)."""
    nested = label.evidence.get("job_slowdown") if kind == "fail_slow" else None
    return bool(nested) and set(label.ranks) <= ranks and ranks == set(nested.get("ranks") or ())


def _blame_straggler(fail_slow: Anomaly, stragglers: list[Anomaly]) -> None:
    """A job-wide slowdown that starts with a straggler is that straggler's doing (the
    others' extra wait is what slowed the job), not the fabric's."""
    onset = fail_slow.first_step or 0
    near = [s for s in stragglers if abs((s.first_step or 0) - onset) <= 5]
    if near:
        culprit = max(near, key=lambda s: s.impact)
        fail_slow.ranks = list(culprit.ranks)
        fail_slow.evidence.pop("host_starved", None)  # the straggler's doing, not the host's
        fail_slow.cause = culprit.cause
        # The job's step time crosses its midpoint a little after the culprit slowed.
        fail_slow.first_step = min(onset, culprit.first_step or onset)
        fail_slow.evidence["onset_step"] = fail_slow.first_step
        ev = fail_slow.evidence
        fail_slow.summary = (
            f"the job slowed down by {ev.get('shift', 0):.0%} from step {fail_slow.first_step} "
            f"({ev.get('step_ms_before', 0):.1f} → {ev.get('step_ms_after', 0):.1f} ms/step): rank "
            f"{', '.join(map(str, culprit.ranks))}, the straggler from step {culprit.first_step}, "
            f"makes the others wait (cause {culprit.cause})")


def _agree_with_straggler(fail_slow: Anomaly, stragglers: list[Anomaly]) -> None:
    """One rank's slowdown gets one cause. The straggler's (the rank against its peers in
    the same steps) holds when the fail-slow's (the rank against its own earlier steps)
    differs: a change in the host's load between the two periods skews only the latter."""
    same = next((s for s in stragglers if s.ranks == fail_slow.ranks and s.cause != "unknown"
                 and _overlap(s, fail_slow)), None)
    if same is not None and same.cause != fail_slow.cause:
        fail_slow.evidence["own_history_cause"] = fail_slow.cause
        fail_slow.cause = same.cause


def _covers(outer: Anomaly, inner: Anomaly, share: float = 0.8) -> bool:
    """Whether `outer`'s steps span at least `share` of `inner`'s (a lasting slowdown and
    its own stalls over the same stretch; not a short burst inside a long pattern)."""
    if inner.first_step is None or inner.last_step is None or outer.first_step is None:
        return _overlap(outer, inner)
    last = outer.last_step if outer.last_step is not None else inner.last_step
    common = min(last, inner.last_step) - max(outer.first_step, inner.first_step) + 1
    return common >= share * (inner.last_step - inner.first_step + 1)


def _overlap(a: Anomaly, b: Anomaly) -> bool:
    lo_a, hi_a = a.first_step or 0, a.last_step if a.last_step is not None else 1 << 62
    lo_b, hi_b = b.first_step or 0, b.last_step if b.last_step is not None else 1 << 62
    return lo_a <= hi_b and lo_b <= hi_a


def order(anomalies: list[Anomaly]) -> list[Anomaly]:
    return sorted(anomalies, key=lambda a: (_KIND_ORDER.get(a.kind, 99), -a.impact, a.ranks))


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
