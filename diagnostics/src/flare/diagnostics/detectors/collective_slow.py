"""Collective slow: communication itself got slower than it usually is in this job.

The pure transfer time of a step's collectives is the wait of the rank that arrived
last (it waited for nobody), so waiting for stragglers is excluded. Divided into
the bytes moved, it is the job's effective bandwidth; a persistent drop against the
job's own earlier steps (a change point) is labelled with cause `communication`.
"""

from __future__ import annotations

import math

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import change_point, nanmedian

_MIN_SHIFT = 0.25  # transfer time per byte up by at least this much
_MIN_COMM_SHARE = 0.05  # and communication a visible share of the step


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    frame = frames.load(job, config)
    if frame is None or len(frame.ranks) < 2:
        return []
    warm = np.flatnonzero(frame.steps >= frame.steps[0] + config.warmup_steps)
    persist = max(2, math.ceil(config.min_persist_steps / frame.bucket))
    if warm.size < 2 * persist:
        return []
    wait = frame.wait[:, warm].astype(np.float64)
    transfer_ms = np.nanmin(np.where(np.isnan(wait), np.inf, wait), axis=0)
    transfer_ms = np.where(np.isfinite(transfer_ms), transfer_ms, np.nan)
    moved = nanmedian(frame.bytes[:, warm].astype(np.float64), axis=0)
    per_byte = np.isfinite(moved) & (moved > 0)
    cost = np.where(per_byte, transfer_ms / np.where(per_byte, moved, 1.0), transfer_ms) \
        if per_byte.mean() > 0.9 else transfer_ms
    point = change_point(cost, persist)
    if point is None or point.shift < _MIN_SHIFT or point.score < config.fail_slow_min_score:
        return []
    onset = int(warm[point.index])
    after = warm >= onset
    step_ms = nanmedian(frame.duration[:, warm].astype(np.float64), axis=0)
    comm_after = float(np.nanmedian(transfer_ms[after]))
    comm_before = float(np.nanmedian(transfer_ms[~after]))
    share = (comm_after - comm_before) / float(np.nanmedian(step_ms[after]))
    if share < _MIN_COMM_SHARE:
        return []
    first = frame.step_of(onset)
    bandwidth = None
    if per_byte.mean() > 0.9:
        mb = float(np.nanmedian(moved)) / 1e6
        bandwidth = {"before_mb_per_s": round(mb / (comm_before / 1e3), 2) if comm_before > 0 else None,
                     "after_mb_per_s": round(mb / (comm_after / 1e3), 2) if comm_after > 0 else None}
    return [Anomaly(
        kind="collective_slow", ranks=[], cause="communication", first_step=first,
        last_step=frame.last_step_of(int(warm[-1])), impact=min(share, 1.0),
        confidence=min(0.99, 1 - math.exp(-point.score / config.fail_slow_min_score)),
        summary=f"collectives slowed from step {first}: transfer time "
                f"{comm_before:.1f} → {comm_after:.1f} ms per step "
                f"({point.shift:+.0%} per byte), {share:.0%} of each step",
        evidence={"transfer_ms_before": round(comm_before, 3), "transfer_ms_after": round(comm_after, 3),
                  "shift": round(point.shift, 4), "bandwidth": bandwidth},
    )]
