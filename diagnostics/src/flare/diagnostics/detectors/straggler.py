"""Straggler: the rank the others wait for — the culprit, not its victims.

Collectives equalise step durations, so duration cannot tell culprit from victim.
The culprit of a step is the rank with the *least* collective wait (it arrived
last); the time lost is how much longer the typical rank waited than the culprit.
A rank is labelled when it is the culprit of most steps over a persistent run and
the loss is a real share of the step. Scores are scale-free: the culprit's own time
against the best peers (relative) and against its own past (individual), as in
NVIDIA's resiliency straggler detector.
"""

from __future__ import annotations

import math

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.causes import attribute, means, medians
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import first_rise, mad, nanmedian, runs


def min_density(ranks: int) -> float:
    """The share of a run's steps a rank must be the culprit of. Chance makes each of R
    ranks the last to arrive in ~1/R of the steps, so two ranks need 0.7; from three on,
    half is well clear of chance. A CPU-starved rank on a loaded host (its busy thread
    and three other ranks on two cores) arrived last in 61-64 % of its slowed steps,
    its own time slower in nearly all: with 0.7 it went unlabelled, or was labelled 27
    steps late."""
    return 0.7 if ranks <= 2 else 0.5


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    frame = frames.load(job, config)
    if frame is None or len(frame.ranks) < 2:
        return []
    return find(frame, config)


def step_losses(frame: frames.StepFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: the culprit row, the ms lost by the typical rank, the median duration."""
    wait = frame.wait.astype(np.float64)
    filled = np.where(np.isnan(wait), np.inf, wait)
    culprit_row = np.argmin(filled, axis=0)
    least = filled[culprit_row, np.arange(wait.shape[1])]
    lost = nanmedian(wait, axis=0) - least
    lost = np.where(np.isfinite(lost), lost, 0.0)
    duration = nanmedian(frame.duration.astype(np.float64), axis=0)
    return culprit_row, lost, duration


def find(frame: frames.StepFrame, config: DiagnosisConfig) -> list[Anomaly]:
    culprit_row, lost, duration = step_losses(frame)
    warm = np.asarray(frame.steps) >= frame.steps[0] + config.warmup_steps
    share = np.where(duration > 0, lost / duration, 0.0)
    significant = warm & (share >= config.straggler_min_impact)
    persist = max(2, math.ceil(config.straggler_min_steps / frame.bucket))
    work = frame.work.astype(np.float64)
    deviation = work - nanmedian(work, axis=0)[None, :]
    noise_ms = _noise_ms(deviation[:, warm])
    anomalies = []
    density = min_density(len(frame.ranks))
    for row in np.unique(culprit_row[significant]):
        mask = significant & (culprit_row == row)
        # Persistence counts the steps the rank was the culprit, not the run's length.
        spans = [(a, b) for a, b in _dense_runs(mask, persist, density)
                 if mask[a:b + 1].sum() >= persist and mask[a:b + 1].mean() >= density]
        if not spans:
            continue
        first_warm = int(np.argmax(warm)) if warm.any() else 0
        cols = np.concatenate([_trim(deviation[row], a, b) for a, b in spans])
        cols = cols[cols >= _onset(deviation[row], first_warm, int(cols[0]), int(cols[-1]), persist)]
        anomaly = _label(frame, config, int(row), cols, mask, share)
        # Arriving last by chance (a descheduled process, noise) is not being slower:
        # the rank's own time must really exceed its peers', beyond the job's noise —
        # judged over the run where its own excess is established, before any re-dating.
        relative = anomaly.evidence["relative_score"]
        excess = anomaly.evidence["excess_ms_per_step"]
        if not (relative is not None and relative <= config.straggler_max_relative_score
                and excess >= config.straggler_min_noise_units * noise_ms):
            continue
        # The onset of the named cause is sharper than that of the whole step: place
        # first_step where that component of the rank's step jumped.
        # Searched from where the rank began to arrive last, not from the trimmed start:
        # on a loaded host a busy thread's toll on the step can be patchy for a while
        # after it starts, so the step's own rise dates late (step 32 for a fault from
        # 20, seen), while that thread's CPU jumps the step it starts.
        series = frame.cause_series(anomaly.cause)
        if series is not None:
            part = series.astype(np.float64)
            part_deviation = part - nanmedian(part, axis=0)[None, :]
            start = _onset(part_deviation[row], first_warm, min(spans[0][0], int(cols[0])),
                           int(cols[-1]), persist, fallback=int(cols[0]))
            if start != int(cols[0]):
                cols = np.arange(start, int(cols[-1]) + 1)
                anomaly = _label(frame, config, int(row), cols, mask, share)
        anomaly.evidence["job_noise_ms"] = round(noise_ms, 3)
        anomalies.append(anomaly)
    return anomalies


def _dense_runs(mask: np.ndarray, max_join: int, density: float) -> list[tuple[int, int]]:
    """The culprit's runs (gaps of up to 2 steps bridged), neighbours joined while the
    joined run stays dense. On a loaded host a CPU-starved rank is still the last to
    arrive in most steps, but another rank's hiccup takes a few of them: bridging only
    2-step gaps split one 40-step fault into runs each too short or too sparse to count
    (no straggler at all in one CI run, a 13-step late onset in others). A join spans at
    most `max_join` steps of gap, so two separate episodes stay two labels."""
    joined: list[tuple[int, int]] = []
    for a, b in runs(mask, max_gap=2):
        if joined:
            first, last = joined[-1]
            if a - last - 1 <= max_join and mask[first:b + 1].mean() >= density:
                joined[-1] = (first, b)
                continue
        joined.append((a, b))
    return joined


def _noise_ms(deviation: np.ndarray) -> float:
    """The job's rank-to-rank noise: the MAD of each rank's time around its step's
    median. With two ranks that median is their mean, so a straggler's own excess is
    half of every deviation and would count as noise; there the noise is read from how
    the two ranks' difference moves from step to step instead (a lasting shift does not
    move it), scaled to one rank's deviation."""
    if deviation.shape[0] != 2:
        return mad(deviation)
    steps = deviation[0][np.isfinite(deviation[0])]
    if steps.size < 3:
        return mad(deviation)
    return mad(np.diff(steps)) / math.sqrt(2)


def _trim(deviation: np.ndarray, first: int, last: int) -> np.ndarray:
    """The run's columns, without leading/trailing steps where the rank was not yet (or
    no longer) clearly slower — so first_step is the onset, not a noisy lead-in."""
    values = deviation[first:last + 1]
    level = 0.5 * float(np.nanmedian(values)) if np.isfinite(values).any() else 0.0
    strong = np.flatnonzero(np.nan_to_num(values, nan=-np.inf) >= level)
    if level <= 0 or strong.size == 0:
        return np.arange(first, last + 1)
    return np.arange(first + int(strong[0]), first + int(strong[-1]) + 1)


def _onset(deviation: np.ndarray, first_warm: int, first: int, last: int, persist: int,
           fallback: int | None = None) -> int:
    """Where the rank's own excess really began: the change point of its deviation from
    the step median, from warm-up to the end of the run. Being the last to arrive can
    start early by chance (one slow step bridging into the run); the level shift of the
    rank's own time cannot. Falls back to `fallback`, by default the run's start."""
    fallback = first if fallback is None else fallback
    level = float(np.nanmedian(deviation[first:last + 1]))
    if not level > 0:
        return fallback
    rise = first_rise(deviation[first_warm:last + 1], persist, 0.25 * level)
    if rise is None:
        return fallback
    start = first_warm + rise
    return start if first - 3 <= start <= last else fallback


def _label(frame: frames.StepFrame, config: DiagnosisConfig, row: int, cols: np.ndarray,
           mask: np.ndarray, share: np.ndarray) -> Anomaly:
    rank = int(frame.ranks[row])
    peers = [r for r in range(len(frame.ranks)) if r != row]
    mine, my_work = medians(frame, [row], cols)
    theirs, their_work = medians(frame, peers, cols)
    my_means, their_means = means(frame, [row], cols), means(frame, peers, cols)
    why = attribute(mine, theirs, config.cause_min_share, my_work, their_work,
                    my_means, their_means)
    other_cpu_delta = my_means["other_cpu"] - their_means["other_cpu"]
    density = float(mask[cols].mean())
    impact = float(np.mean(share[cols]))
    first, last = frame.step_of(int(cols[0])), frame.last_step_of(int(cols[-1]))
    before = np.arange(0, int(cols[0]))
    before = before[frame.steps[before] >= frame.steps[0] + config.warmup_steps]
    individual = None
    if before.size >= 2:
        _, past_work = medians(frame, [row], before)
        individual = past_work / my_work if my_work > 0 else None
    relative = their_work / my_work if my_work > 0 else None
    persist_factor = min(1.0, len(cols) / (2 * max(1, config.min_persist_steps / frame.bucket)))
    confidence = density * (0.5 + 0.5 * persist_factor) * (1.0 if why.cause != "unknown" else 0.8)
    others = len(frame.ranks) - 1
    cause_text = {
        "compute": "its compute is slower", "input": "its data loading is slower",
        "gc": "it pauses in garbage collection", "cpu": "its Python side is starved of CPU "
        + (f"(its other threads burn +{other_cpu_delta:.1f} ms of CPU per step, as a "
           "GIL-holding thread does)" if math.isfinite(other_cpu_delta) and other_cpu_delta > 0
           else "(every part of its step is slower, as with a GIL-holding thread)"),
        "communication": "its communication is slower", "unknown": "the cause is unclear",
    }.get(why.cause, why.cause)
    summary = (
        f"rank {rank} makes {'the other rank' if others == 1 else f'the other {others} ranks'} wait "
        f"{impact:.0%} of each step from step {first} to {last}: {cause_text} "
        f"(+{why.excess_ms:.1f} ms/step over its peers)"
    )
    return Anomaly(
        kind="straggler", ranks=[rank], cause=why.cause, first_step=first, last_step=last,
        impact=impact, confidence=min(confidence, 0.99), summary=summary,
        evidence={
            "culprit_steps": int(mask[cols].sum() * frame.bucket),
            "steps_in_run": int(len(cols) * frame.bucket),
            "excess_ms_per_step": round(why.excess_ms, 3),
            "component_delta_ms": {k: round(v, 3) for k, v in why.deltas_ms.items()},
            "component_ratio": {k: round(v, 3) for k, v in why.ratios.items()},
            "cause_share": round(why.share, 3),
            "other_threads_cpu_delta_ms": (round(other_cpu_delta, 3)
                                           if math.isfinite(other_cpu_delta) else None),
            "relative_score": None if relative is None else round(relative, 3),
            "individual_score": None if individual is None else round(individual, 3),
        },
    )
