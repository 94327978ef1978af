"""gpu_throttle: a GPU running below its clocks, joined to the rank the others wait for.

Input: the NVML state the instrumentation attaches to `train.step` spans when it
changes (`flare.step.gpu.clock.sm`, `flare.step.gpu.throttle_reasons`), carried forward
per rank. A step is throttled on a rank when NVML reports a harmful reason (power cap,
HW slowdown, thermal, power brake) or its SM clock is under `CLOCK_DROP` of the fastest
rank's clock in that step. Joined to the straggler signal: the rank with the least
collective wait in a step is the one the others waited for; a throttled rank that is
also that culprit gets a high confidence and an impact equal to the others' extra wait.
"""

from __future__ import annotations

import numpy as np

from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.instrumentation import kernel_taxonomy as taxonomy
from flare.instrumentation import semconv as sc

CLOCK_DROP = 0.85


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    table = job.spans([sc.SPAN_STEP], attributes=[
        sc.STEP_GPU_SM_CLOCK_MHZ, sc.STEP_GPU_THROTTLE, sc.STEP_COLLECTIVE_WAIT_MS],
        columns=["rank", "step", "duration_ns", "trace_id"])
    if table.num_rows == 0:
        return []
    clocks = table.column(sc.STEP_GPU_SM_CLOCK_MHZ).to_numpy(zero_copy_only=False).astype(float)
    reasons = table.column(sc.STEP_GPU_THROTTLE).to_numpy(zero_copy_only=False).astype(float)
    if np.all(np.isnan(clocks)) and np.all(np.isnan(reasons)):
        return []
    ranks_col = table.column("rank").to_numpy(zero_copy_only=False)
    steps_col = table.column("step").to_numpy(zero_copy_only=False)
    ranks = sorted(int(r) for r in np.unique(ranks_col) if r is not None)
    steps = sorted(int(s) for s in np.unique(steps_col) if s is not None)
    rank_index = {r: i for i, r in enumerate(ranks)}
    step_index = {s: i for i, s in enumerate(steps)}
    shape = (len(ranks), len(steps))
    clock = np.full(shape, np.nan)
    reason = np.full(shape, np.nan)
    wait = np.full(shape, np.nan)
    duration = np.full(shape, np.nan)
    waits = table.column(sc.STEP_COLLECTIVE_WAIT_MS).to_numpy(zero_copy_only=False).astype(float)
    durations = table.column("duration_ns").to_numpy(zero_copy_only=False).astype(float) / 1e6
    trace_ids = table.column("trace_id").to_pylist()
    trace_at: dict[tuple[int, int], str] = {}
    for i in range(table.num_rows):
        r, s = rank_index[int(ranks_col[i])], step_index[int(steps_col[i])]
        clock[r, s], reason[r, s] = clocks[i], reasons[i]
        wait[r, s], duration[r, s] = waits[i], durations[i]
        trace_at[(r, s)] = trace_ids[i]
    clock, reason = _carry_forward(clock), _carry_forward(reason)
    harmful = (np.nan_to_num(reason).astype(np.int64) & taxonomy.HARMFUL_THROTTLE_MASK) != 0
    fastest = np.nanmax(np.where(np.isnan(clock), -np.inf, clock), axis=0)
    slow_clock = clock < CLOCK_DROP * fastest
    throttled = harmful | slow_clock
    has_wait = ~np.all(np.isnan(wait), axis=0)
    culprit = np.where(has_wait, np.argmin(np.where(np.isnan(wait), np.inf, wait), axis=0), -1)
    anomalies = []
    for r, rank in enumerate(ranks):
        hit = throttled[r]
        if hit.sum() < min(config.min_persist_steps, len(steps)) or not hit.any():
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
            first_step=steps[cols[0]], last_step=steps[cols[-1]],
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
                "steps_throttled": len(cols), "culprit_share": round(culprit_share, 4),
            },
            trace_ids=[trace_at[(r, c)] for c in cols[:5] if (r, c) in trace_at],
        ))
    return anomalies


def _carry_forward(values: np.ndarray) -> np.ndarray:
    """NVML state is attached only when it changes: a missing step keeps the last value."""
    out = values.copy()
    for row in out:
        last = np.nan
        for i, value in enumerate(row):
            if np.isnan(value):
                row[i] = last
            else:
                last = value
    return out
