"""gpu_throttle: a GPU running below its clocks, joined to the rank the others wait for.

Input: the NVML state the instrumentation attaches to `train.step` spans when it
changes (`flare.step.gpu.clock.sm`, `flare.step.gpu.throttle_reasons`), taken from the
shared pushed-down step summary (mean clock and OR of the masks per step bucket) and
carried forward per rank. A step is throttled on a rank when NVML reports a harmful reason (power cap,
HW slowdown, thermal, power brake) or its SM clock is under `CLOCK_DROP` of the fastest
rank's clock in that step. Joined to the straggler signal: the rank with the least
collective wait in a step is the one the others waited for; a throttled rank that is
also that culprit gets a high confidence and an impact equal to the others' extra wait.
"""

from __future__ import annotations

import numpy as np

from flare.diagnostics import frame as step_frame
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import kernel_taxonomy as taxonomy

CLOCK_DROP = 0.85


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    # The shared per-step summary (pushed down, bucketed to at most max_step_columns)
    # already carries the NVML columns: no step span is read into Python here.
    frame = step_frame.load(job, config)
    if frame is None:
        return []
    if np.all(np.isnan(frame.sm_clock_mhz)) and np.all(np.isnan(frame.throttle_reasons)):
        return []
    ranks = [int(r) for r in frame.ranks]
    steps = [int(s) for s in frame.steps]
    clock = _carry_forward(frame.sm_clock_mhz.astype(np.float64))
    reason = _carry_forward(frame.throttle_reasons)
    wait = frame.wait.astype(np.float64)
    duration = frame.duration.astype(np.float64)
    harmful = (np.nan_to_num(reason).astype(np.int64) & taxonomy.HARMFUL_THROTTLE_MASK) != 0
    fastest = np.nanmax(np.where(np.isnan(clock), -np.inf, clock), axis=0)
    with np.errstate(invalid="ignore"):
        slow_clock = clock < CLOCK_DROP * fastest
    throttled = harmful | slow_clock
    has_wait = ~np.all(np.isnan(wait), axis=0)
    culprit = np.where(has_wait, np.argmin(np.where(np.isnan(wait), np.inf, wait), axis=0), -1)
    # Persistence counts steps, not buckets: a bucket stands for `bucket` steps.
    min_columns = max(1, -(-min(config.min_persist_steps, len(steps) * frame.bucket) // frame.bucket))
    anomalies = []
    for r, rank in enumerate(ranks):
        hit = throttled[r]
        if hit.sum() < min_columns or not hit.any():
            continue
        cols = np.flatnonzero(hit)
        is_culprit = culprit[cols] == r
        others = np.delete(wait[:, cols], r, axis=0) if len(ranks) > 1 else np.empty((0, len(cols)))
        lost = (np.nanmedian(others, axis=0) - wait[r, cols]) if others.size else np.zeros(len(cols))
        lost = np.where(np.isfinite(lost), np.clip(lost, 0, None), 0.0)
        step_ms = np.nanmedian(duration[:, cols], axis=0)
        impact = float(np.nanmedian(np.where(step_ms > 0, lost / step_ms, 0.0))) if len(cols) else 0.0
        if not is_culprit.any():
            clock_ratio = clock[r, cols] / fastest[cols]
            impact = float(np.nanmedian(1 - clock_ratio)) if np.isfinite(clock_ratio).any() else 0.0
        mask = int(np.bitwise_or.reduce(np.nan_to_num(reason[r, cols]).astype(np.int64)))
        names = taxonomy.throttle_reason_names(mask & ~0x1)
        culprit_share = float(is_culprit.mean()) if has_wait[cols].any() else 0.0
        anomalies.append(Anomaly(
            kind="gpu_throttle", ranks=[rank], cause="hardware",
            first_step=frame.step_of(cols[0]), last_step=frame.last_step_of(cols[-1]),
            impact=max(0.0, min(1.0, impact)),
            confidence=min(0.99, 0.55 + 0.44 * culprit_share),
            summary=(f"rank {rank}'s GPU is throttled ({', '.join(names) or 'low SM clock'}, "
                     f"SM clock {np.nanmin(clock[r, cols]):.0f} MHz vs {np.nanmax(fastest[cols]):.0f} "
                     f"MHz on the fastest rank)"
                     + (f" and the other ranks wait for it in {culprit_share:.0%} of those steps"
                        if culprit_share > 0 else "")),
            evidence={
                "throttle_reasons": names, "throttle_mask": mask,
                "sm_clock_mhz_min": float(np.nanmin(clock[r, cols])),
                "fastest_sm_clock_mhz": float(np.nanmax(fastest[cols])),
                "steps_throttled": len(cols) * frame.bucket,
                "culprit_share": round(culprit_share, 4),
            },
        ))
    return anomalies


def _carry_forward(values: np.ndarray) -> np.ndarray:
    """NVML state is attached only when it changes: a missing step keeps the last value."""
    columns = np.arange(values.shape[1])
    last_seen = np.maximum.accumulate(np.where(np.isnan(values), -1, columns), axis=1)
    out = np.take_along_axis(values, np.clip(last_seen, 0, None), axis=1)
    out[last_seen < 0] = np.nan
    return out
