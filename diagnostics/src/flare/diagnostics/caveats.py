"""What a report says once about what Flare could not measure on some ranks: no
step ended (`steps_unseen`), no run-queue wait (`contention_unknown`), collectives
it could not time (`wait_unknown`, which also withdraws the cause such labels claim).
"""

from __future__ import annotations

from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import semconv as sc

STEPS_UNSEEN_TEXT = ("no step ended: steps end at a torch.optim optimizer's step() or a "
                     "flare.instrumentation.step() block, and this loop's optimizer is neither "
                     "(a framework Flare does not know). Unaccounted for: the whole step — its "
                     "compute, data loading, collective waits, phases — so no straggler, "
                     "fail-slow or regression can be told; hangs, errors and silent ranks still are")


def steps_unseen(job: JobData) -> dict | None:
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


def contention_unknown(job: JobData, config: DiagnosisConfig) -> dict | None:
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


def wait_unknown(job: JobData, config: DiagnosisConfig, anomalies: list[Anomaly]) -> dict | None:
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
