"""Fail-slow: the job got slower within the run — a change point, with its onset.

The job's step time (median across ranks) is split at its single most significant
mean shift; a slowdown of at least `fail_slow_min_shift` that stands well above the
noise and persists is labelled. The ranks are those whose *own* time (step minus
collective wait) shifted at the same place; when none did, the slowdown is
job-wide and the pure communication time (the least wait of any rank) is checked.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.causes import (
    attribute,
    cpu_only_idle,
    dating_series,
    host_busy,
    host_starved,
    means,
    medians,
    waits_without_work,
    work_grew,
)
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import ChangePoint, change_point, first_rise, mad, nanmedian

_ONSET_TOLERANCE = 3  # a rank's own change point may sit this many columns off the job's
_SHARE_OF_SLOWEST = 0.5  # a rank named beside another grew by at least this share of its growth


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    frame = frames.load(job, config)
    if frame is None:
        return []
    return find(frame, config)


def find(frame: frames.StepFrame, config: DiagnosisConfig) -> list[Anomaly]:
    warm = np.flatnonzero(frames.warm_mask(frame, config))
    persist = max(2, math.ceil(config.min_persist_steps / frame.bucket))
    if warm.size < 2 * persist:
        return []
    job_time = nanmedian(frame.duration[:, warm].astype(np.float64), axis=0)
    point = change_point(job_time, persist)
    by_ranks = not significant(point, config)
    if by_ranks:
        # The job's step time can be too noisy to split cleanly while one rank's own
        # time shows the change plainly; then that rank's onset dates the slowdown.
        point = _from_ranks(frame, config, warm, job_time, persist)
        if point is None:
            return []
    point = _settled(point, job_time, persist)
    if point is None or frame.wall_ms(warm[point.index:]) < config.min_persist_s * 1e3:
        return []
    onset = int(warm[point.index])
    before, after = warm[warm < onset], warm[warm >= onset]
    ranks = _ranks_that_changed(frame, config, warm, point.index, persist)
    rows = [frame.row(r) for r in ranks] if ranks else list(range(len(frame.ranks)))
    now, now_work = medians(frame, rows, after)
    past, past_work = medians(frame, rows, before)
    if ranks and now_work - past_work < config.cause_min_share * (point.after - point.before):
        # Those ranks' own growth is a small part of the job's: the job slowed as a whole.
        ranks, rows = [], list(range(len(frame.ranks)))
        now, now_work = medians(frame, rows, after)
        past, past_work = medians(frame, rows, before)
    if not ranks:
        ranks = _ranks_that_burnt_it(frame, before, after, point.after - point.before)
        if ranks:
            rows = [frame.row(r) for r in ranks]
            now, now_work = medians(frame, rows, after)
            past, past_work = medians(frame, rows, before)
    if by_ranks and not ranks:
        # Dated by some ranks' own change, the job's own split not significant, and then
        # no rank drove it: nothing stands behind a job-wide slowdown (a healthy compiled
        # job at 2 busy processes per core: "fail_slow [] communication" at 2.5 noise
        # units, 67 % consistent).
        return []
    if not ranks:  # job-wide: everyone's own time is unchanged, look at communication
        now["wait"] = _comm_ms(frame, after)
        past["wait"] = _comm_ms(frame, before)
        now_work += now["wait"]
        past_work += past["wait"]
    mean_now, mean_past = means(frame, rows, after), means(frame, rows, before)
    # Job-wide too: every rank waiting longer for a CPU without more work is the host
    # (other processes on it), never compute or communication.
    slowdown_ms = (now_work - past_work) if ranks else point.after - point.before
    starved = host_starved(mean_now, mean_past, slowdown_ms)
    why = attribute(now, past, config.cause_min_share, now_work, past_work, mean_now, mean_past)
    # Compute that grew while the ranks' CPU did no more work is no compute of the job's:
    # the host's, though the run queue shows only a part of it (causes.cpu_only_idle) —
    # on every rank, or on the ranks that slowed (a healthy 2-rank job beside three busy
    # test workers: "fail_slow [0] compute" over its last 8 steps).
    asleep = (not starved and why.cause in ("compute", "cpu")
              and cpu_only_idle(frame, mean_now, mean_past, slowdown_ms))
    starved = starved or asleep
    if not ranks and why.cause == "communication" and not np.nanmedian(frame.bytes) > 0:
        # Without byte counts a longer least wait may be a slower fabric or a busier
        # host (descheduled ranks): not enough to name communication.
        why.cause = "unknown"
    if (not ranks and why.cause == "communication" and not starved
            and host_busy(frame, after, point.after - point.before)):
        # every rank's collectives slowed while the host kept the ranks waiting for a CPU
        # as long: not enough to name communication (causes.host_busy)
        why.cause = "unknown"
    excess = (now_work - past_work) if ranks else point.after - point.before
    onset = _cause_onset(frame, rows, warm, persist, onset,
                         dating_series(frame, why.cause, rows, after, excess,
                                       peers=[r for r in range(len(frame.ranks)) if r not in rows],
                                       before=before))
    first = frame.step_of(onset)
    last = frame.last_step_of(int(warm[-1]))
    who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
           else "all ranks")
    grew = max(why.deltas_ms, key=lambda k: why.deltas_ms[k])
    summary = (
        f"the job slowed down by {point.shift:.0%} from step {first} "
        f"({point.before:.1f} → {point.after:.1f} ms/step), driven by {who}"
        + (f": {grew} time grew by {why.deltas_ms[grew]:.1f} ms/step" if why.cause != "unknown" else "")
        + _starved_text(why.cause, mean_now, mean_past)
        + _waiting_text(frame, why.cause, mean_now, mean_past, slowdown_ms)
    )
    runqueue_delta = mean_now["runqueue"] - mean_past["runqueue"]
    if starved:
        summary = (f"the job slowed down by {point.shift:.0%} from step {first} "
                   f"({point.before:.1f} → {point.after:.1f} ms/step): {who} waited "
                   f"+{runqueue_delta:.1f} ms/step for a CPU "
                   + ("and slept the rest " if asleep else "")
                   + "without doing more work (the host is busy with other work)")
    # Impact: what the slower steps cost over the whole run (seconds lost / seconds run).
    step_ms = nanmedian(frame.duration.astype(np.float64), axis=0)
    counts = np.ones(len(frame.steps)) * frame.bucket if frame.step_counts is None else frame.step_counts
    later = np.arange(frame.column(first), len(frame.steps))
    lost_ms = float(np.nansum(np.clip(step_ms[later] - point.before, 0, None) * counts[later]))
    run_ms = float(np.nansum(step_ms * counts))
    confidence = min(0.99, (1 - math.exp(-point.score / config.fail_slow_min_score)) *
                     min(1.0, len(after) / (2 * persist)) * (1.0 if why.cause != "unknown" else 0.8))
    return [Anomaly(
        kind="fail_slow", ranks=ranks, cause=why.cause, first_step=first, last_step=last,
        impact=min(1.0, lost_ms / run_ms) if run_ms > 0 else 0.0, confidence=confidence,
        summary=summary,
        evidence={
            "onset_step": first, "lost_s": round(lost_ms / 1e3, 3),
            **({"host_starved": True, "runqueue_delta_ms": round(runqueue_delta, 3)}
               if starved else {}),
            **({"asleep_delta_ms": round(slowdown_ms - max(runqueue_delta, 0.0), 3)}
               if asleep else {}),
            "step_ms_before": round(point.before, 3), "step_ms_after": round(point.after, 3),
            "shift": round(point.shift, 4), "noise_units": round(point.score, 2),
            "consistency": round(point.consistency, 3),
            "component_delta_ms": {k: round(v, 3) for k, v in why.deltas_ms.items()},
            "cause_share": round(why.share, 3),
        },
    )]




def _settled(point: ChangePoint, series: np.ndarray, persist: int) -> ChangePoint | None:
    """The change point moved to the first step of its later segment that is on the new
    level's side of the midpoint; None while fewer than `persist` steps are there.

    The split must leave `persist` points after it. While the job follows a slowdown
    that is only two steps old, the best split takes normal steps into the later segment
    and dates the onset early (step 38 for a fault from 40, seen in live following).
    Labels written live are never rewritten, so a slowdown waits until it has lasted
    `persist` steps."""
    new_side = point.on_new_side(series[point.index:])
    if not new_side.any():
        return None
    first = int(np.argmax(new_side))
    if int(new_side[first:].sum()) < persist:
        return None
    if first == 0:
        return point
    index = point.index + first
    before = float(np.nanmedian(series[:index]))
    after = float(np.nanmedian(series[index:]))
    noise = abs(point.after - point.before) / point.score if point.score > 0 else 0.0
    return dataclasses.replace(
        point, index=index, before=before, after=after,
        shift=after / before - 1 if before > 0 else 0.0,
        score=abs(after - before) / noise if noise > 0 else point.score)


def _ranks_that_burnt_it(frame: frames.StepFrame, before: np.ndarray, after: np.ndarray,
                         slowdown_ms: float) -> list[int]:
    """The ranks behind a slowdown every rank's step shows as waiting: those whose work
    (`work_grew`: training-thread and other-thread CPU against their own past) grew by
    a real share of it, when the others' did not. A GIL-holding thread that burns more
    on a loaded host (+11 ms/step of its rank's other-thread CPU from step 177, seen)
    blocks its rank's training thread without showing in that thread's time, and every
    rank waits the same for it: the slowdown is that rank's, never the job's
    communication."""
    driving = [row for row in range(len(frame.ranks)) if slowdown_ms > 0 and work_grew(
        means(frame, [row], after), means(frame, [row], before), slowdown_ms)]
    if not driving or len(driving) > len(frame.ranks) // 2:
        return []
    return sorted(int(frame.ranks[row]) for row in driving)


def _cause_onset(frame: frames.StepFrame, rows: list[int], warm: np.ndarray,
                 persist: int, onset: int, matrix: np.ndarray | None) -> int:
    """Date the slowdown by the named cause's own component when it jumps nearby: it is
    sharper than the step time, which noise can move a few steps early. A fault that
    worsens in stages is dated from its first, smaller rise, however early. When some
    ranks drove it, their component is read as their excess over the other ranks': a
    rise every rank shares (a loaded host) is not theirs to date. `matrix` is the series
    that dates the cause (causes.dating_series: for compute that carried more work, the
    training threads' CPU)."""
    if matrix is None:
        return onset
    values = matrix[:, warm].astype(np.float64)
    series = nanmedian(values[rows], axis=0)
    chosen = set(rows)
    peers = [row for row in range(values.shape[0]) if row not in chosen]
    if peers:
        series = series - nanmedian(values[peers], axis=0)
    after = series[warm >= onset]
    level = float(np.nanmedian(after)) if np.isfinite(after).any() else 0.0
    if not level > 0:
        return onset
    rise = first_rise(series, persist, 0.25 * level)
    if rise is None:
        return onset
    candidate = int(warm[rise])
    return candidate if candidate - onset <= _ONSET_TOLERANCE else onset


def _waiting_text(frame: frames.StepFrame, cause: str, mean_now: dict[str, float],
                  mean_past: dict[str, float], slowdown_ms: float) -> str:
    """Compute that grew while the ranks burnt no more CPU, and no busy host behind it
    (causes.cpu_only_idle): the step waits in the job's own code."""
    if not waits_without_work(frame, cause, mean_now, mean_past, slowdown_ms):
        return ""
    return ", burning no more CPU: the step waits (a sleep, blocking I/O or a lock in its code)"


def _starved_text(cause: str, mean_now: dict[str, float], mean_past: dict[str, float]) -> str:
    """The `cpu` cause's own sign: the Python side starved of CPU, and by what."""
    if cause != "cpu":
        return ""
    other = mean_now.get("other_cpu", math.nan) - mean_past.get("other_cpu", math.nan)
    if math.isfinite(other) and other > 0:
        return (f", as its Python side is starved of CPU (other threads burn +{other:.1f} ms "
                "of CPU per step)")
    return ", as its Python side is starved of CPU"


def significant(point: ChangePoint | None, config: DiagnosisConfig) -> bool:
    """A slowdown that is large, above the noise and consistent — or, when the earlier
    regime is noisy (a loaded host), half as far above the noise but almost perfectly
    consistent (measured: injected faults 0.93–0.98, load bursts ≤ 0.70)."""
    if point is None or point.shift < config.fail_slow_min_shift:
        return False
    if point.score >= config.fail_slow_min_score and point.consistency >= config.change_min_consistency:
        return True
    return point.score >= config.fail_slow_min_score / 2 and point.consistency >= 0.9


def _own_change(series: np.ndarray, persist: int, config: DiagnosisConfig) -> ChangePoint | None:
    """A rank's own significant change that holds: at least `persist` of its later steps
    on the new level's side of the midpoint, the rule `_settled` keeps for the job's.
    Near a job's end the later segment is only a few steps long and a bump of three
    steps is half of it (a healthy Lightning job, rank 1's own time 9 → 12.6, 14.6,
    12.9 ms around rank 0's checkpoint save at step 50, then back: "fail_slow input @49"
    over its last six steps)."""
    point = change_point(series, persist)
    if not significant(point, config):
        return None
    return point if int(point.on_new_side(series[point.index:]).sum()) >= persist else None


def _from_ranks(frame: frames.StepFrame, config: DiagnosisConfig, warm: np.ndarray,
                job_time: np.ndarray, persist: int) -> ChangePoint | None:
    work = frame.work[:, warm].astype(np.float64)
    onsets = []
    for row in range(len(frame.ranks)):
        own = _own_change(work[row], persist, config)
        if own is not None:
            onsets.append(own.index)
    if not onsets or len(onsets) > len(frame.ranks) / 2:
        return None
    index = int(np.median(onsets))
    before, after = job_time[:index], job_time[index:]
    if before.size < persist or after.size < persist:
        return None
    level_before, level_after = float(np.nanmedian(before)), float(np.nanmedian(after))
    if level_before <= 0 or level_after / level_before - 1 < config.fail_slow_min_shift:
        return None
    noise = max(mad(before), 0.02 * level_before, 1e-9)
    return ChangePoint(index=index, before=level_before, after=level_after,
                       shift=level_after / level_before - 1, score=(level_after - level_before) / noise,
                       consistency=float(np.mean(after > (level_before + level_after) / 2)))


def _ranks_that_changed(frame: frames.StepFrame, config: DiagnosisConfig, warm: np.ndarray,
                        job_index: int, persist: int) -> list[int]:
    changed: dict[int, float] = {}
    work = frame.work[:, warm].astype(np.float64)
    for row in range(len(frame.ranks)):
        point = _own_change(work[row], persist, config)
        if point is not None and abs(point.index - job_index) <= _ONSET_TOLERANCE:
            changed[int(frame.ranks[row])] = point.after - point.before
    # A slowdown every rank shares is the job's, not a few ranks'.
    if len(changed) > len(frame.ranks) / 2:
        return []
    # A rank whose own time grew by a fraction of the slowest one's still waits for it:
    # it slowed nothing (rank 2 +60 ms of compute, rank 1's starved loader +8 ms).
    most = max(changed.values(), default=0.0)
    return [rank for rank, grew in changed.items() if grew >= _SHARE_OF_SLOWEST * most]


def _comm_ms(frame: frames.StepFrame, cols: np.ndarray) -> float:
    least = frames.least_wait(frame, cols)
    least = least[np.isfinite(least)]
    return float(np.median(least)) if least.size else 0.0
