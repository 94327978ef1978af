"""From the detectors' findings to the report's labels.

`merge` folds rank-level symptoms into the label that already explains them (one
label per problem, one per stretch of steps); `host_contention` and `short_episodes`
set apart what is not the job's finding (the host's starved ranks, a short episode
in a long run) to be reported beside the anomalies; `order` puts the rest in the
order a report lists them.
"""

from __future__ import annotations

from flare.diagnostics.model import Anomaly, DiagnosisConfig

# Labels that, on the same ranks and cause as a straggler, describe the same problem.
_SUBSUMED_BY_STRAGGLER = {"dataloader_stall": "input", "gc_pause": "gc"}
_KIND_ORDER = {k: i for i, k in enumerate(
    ("hang", "error", "rank_missing", "straggler", "fail_slow", "regression", "collective_slow",
     "dataloader_stall", "gc_pause", "gpu_throttle", "kernel_slow", "launch_bound", "gpu_idle"))}

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
    # a regression against the baseline, over the labels that stayed labels
    for regression in [a for a in kept if a.kind == "regression"]:
        cause_of = _explained_regression(regression, kept)
        if cause_of is not None:
            cause_of.evidence["regression"] = regression.summary
            cause_of.summary += f"; against the baseline: {regression.summary}"
            kept.remove(regression)
    return _one_per_stretch(kept)


# A regression against the baseline is what the job's own slowdown cost it when that
# slowdown's impact is at least this share of the regression's.
_REGRESSION_EXPLAINED = 0.8


def _explained_regression(regression: Anomaly, anomalies: list[Anomaly]) -> Anomaly | None:
    """The lasting straggler or fail-slow of this job that the regression against its
    baseline only repeats: its impact ≥ 80 % of the regression's. A new user's rank that
    slept from step 20 read as a straggler (78 % of the run) and as "regression all
    compute 0-149" (88 %) on top: one problem counted twice, past 100 %."""
    own = [a for a in anomalies if a.kind in ("straggler", "fail_slow")
           and not a.evidence.get("pattern") and _overlap(a, regression)]
    largest = max(own, key=lambda a: a.impact, default=None)
    if largest is None or largest.impact < _REGRESSION_EXPLAINED * regression.impact:
        return None
    return largest


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


def host_contention(anomalies: list[Anomaly]) -> tuple[list[Anomaly], list[Anomaly]]:
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


def host_row(anomaly: Anomaly) -> dict:
    ev = anomaly.evidence
    return {"ranks": sorted(anomaly.ranks), "first_step": anomaly.first_step,
            "last_step": anomaly.last_step, "runqueue_delta_ms": ev.get("runqueue_delta_ms"),
            "asleep_delta_ms": ev.get("asleep_delta_ms"),
            "excess_ms_per_step": ev.get("excess_ms_per_step"), "seconds": ev.get("lost_s"),
            "share": round(anomaly.impact, 4), "summary": anomaly.summary}


def short_episodes(anomalies: list[Anomaly], config: DiagnosisConfig,
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
