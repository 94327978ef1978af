"""gpu_idle: steps in which the GPU sits idle — no kernel, copy or memset on any stream.

Void share (the paper's void percentage) per step and rank, over the GPU window of the
step (`flare.diagnostics.gpu_metrics`). Labelled when it stays at or above
`MIN_VOID_SHARE` over a persistent run of the sampled steps. A rank idling clearly more
than its peers gets its own label (it is the one starving); ranks that idle alike share
one job-wide label. Cause: `input` when the data loader explains the idle time, else
`cpu` (the host did not issue work: Python, launches, synchronisation).
"""

from __future__ import annotations

import numpy as np

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import semconv as sc

MIN_VOID_SHARE = 0.40  # GPU idle for at least 40% of a step
PEER_EXCESS = 0.15  # a rank idling 15 points above the median rank stands out
INPUT_EXPLAINS = 0.5  # data-loader time covering half of the idle time names `input`


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    table = gm.detector_activities(job)
    if table.num_rows == 0:
        return []
    shares = gm.void_shares(table)
    flagged: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    medians: dict[int, float] = {}
    for rank, rows in shares.items():
        steps = np.array([r[0] for r in rows])
        values = np.array([r[1] for r in rows])
        windows = np.array([r[2] for r in rows], dtype=float)
        medians[rank] = float(np.median(values))
        high = values >= MIN_VOID_SHARE
        if high.sum() >= min(config.min_persist_steps, len(values)) and high.any():
            flagged[rank] = (steps[high], values[high], windows[high])
    if not flagged:
        return []
    job_median = float(np.median(list(medians.values())))
    outliers = [r for r in flagged if len(medians) > 1 and medians[r] - job_median >= PEER_EXCESS]
    groups = [[r] for r in outliers]
    rest = sorted(r for r in flagged if r not in outliers)
    if rest:
        groups.append(rest)
    loader = _dataloader_ms(job)
    anomalies = []
    for ranks in groups:
        steps = np.concatenate([flagged[r][0] for r in ranks])
        values = np.concatenate([flagged[r][1] for r in ranks])
        windows = np.concatenate([flagged[r][2] for r in ranks])
        idle_ms = float((values * windows).sum() / 1e6)
        loader_ms = sum(loader.get((r, int(s)), 0.0) for r in ranks for s in flagged[r][0])
        cause = "input" if idle_ms > 0 and loader_ms >= INPUT_EXPLAINS * idle_ms else "cpu"
        share = float(np.median(values))
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks"
        standout = f" (its peers' median is {job_median:.0%})" if ranks[0] in outliers else ""
        mask = np.isin(table.column("rank").to_numpy(zero_copy_only=False), ranks)
        anomalies.append(Anomaly(
            kind="gpu_idle", ranks=ranks, cause=cause,
            first_step=int(steps.min()), last_step=int(steps.max()),
            impact=share, confidence=min(0.99, 0.6 + 0.4 * float(np.mean(values >= MIN_VOID_SHARE))),
            summary=(f"GPU of {who} idle {share:.0%} of each sampled step (no kernel on any "
                     f"stream){standout}; the host did not issue work fast enough"
                     + (" — the data loader accounts for it" if cause == "input" else "")),
            evidence={
                "void_share_median_by_rank": {str(r): round(medians[r], 4) for r in ranks},
                "job_median_void_share": round(job_median, 4),
                "steps_flagged": len(steps), "idle_ms": round(idle_ms, 3),
                "dataloader_ms": round(loader_ms, 3), "threshold": MIN_VOID_SHARE,
            },
            trace_ids=gm.trace_ids_of(table, mask),
        ))
    return anomalies


def _dataloader_ms(job: JobData) -> dict[tuple[int, int], float]:
    steps = job.spans([sc.SPAN_STEP], attributes=[sc.STEP_DATALOADER_MS],
                      columns=["rank", "step"])
    if steps.num_rows == 0:
        return {}
    out = {}
    for rank, step, value in zip(steps.column("rank").to_pylist(), steps.column("step").to_pylist(),
                                 steps.column(sc.STEP_DATALOADER_MS).to_pylist(), strict=True):
        if rank is not None and step is not None and value is not None:
            out[(int(rank), int(step))] = float(value)
    return out
