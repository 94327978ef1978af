"""launch_bound: the CPU cannot keep the GPU fed.

When the host issues work slower than the GPU runs it, the GPU queue drains: each
activity starts as soon as its launch call returns and the GPU idles in between. Two
signals, both from the sampled kernel windows:
- host-wait share: idle time that ended only when the host finally issued the next
  activity (`gpu_metrics.host_wait_ns`), as a share of the step's GPU window;
- a shift of the issue-latency distribution (GPU start − CPU launch) towards zero: a
  rank whose median sits far below its peers' (its queue is empty while theirs is not),
  or below its own earlier steps.
Labelled when the host-wait share is at least `MIN_HOST_WAIT_SHARE` persistently, with
the issue-latency shift as supporting evidence (it raises confidence).
"""

from __future__ import annotations

import numpy as np

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import semconv as sc

MIN_HOST_WAIT_SHARE = 0.20
SHIFT_FACTOR = 4.0  # median issue latency 4x below peers' (or own earlier) median


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    table = gm.detector_activities(job)
    if table.num_rows == 0:
        return []
    ranks = table.column("rank").to_numpy(zero_copy_only=False)
    starts = table.column("start_ns").to_numpy(zero_copy_only=False)
    ends = table.column("end_ns").to_numpy(zero_copy_only=False)
    launches = table.column(sc.KERNEL_LAUNCH_NS).to_numpy(zero_copy_only=False).astype(float)
    durs = table.column(sc.KERNEL_LAUNCH_DUR_US).to_numpy(zero_copy_only=False).astype(float)
    latency = table.column(sc.KERNEL_ISSUE_LATENCY_US).to_numpy(zero_copy_only=False).astype(float)
    windows = gm.step_windows(table)
    p50 = {int(r): gm.percentile(latency[ranks == r], 50) for r in np.unique(ranks)}
    anomalies = []
    for rank, rank_windows in windows.items():
        mask = ranks == rank
        gap_end, wait = gm.host_wait_ns(starts[mask], ends[mask], launches[mask], durs[mask])
        bounds = np.array([(w[1], w[2]) for w in rank_windows], dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(wait[np.argsort(gap_end)])])
        ordered_end = np.sort(gap_end)
        lo = np.searchsorted(ordered_end, bounds[:, 0], side="right")
        hi = np.searchsorted(ordered_end, bounds[:, 1], side="right")
        length = np.maximum(bounds[:, 1] - bounds[:, 0], 1)
        share = (cum[hi] - cum[lo]) / length
        high = share >= MIN_HOST_WAIT_SHARE
        if not high.any() or high.sum() < min(config.min_persist_steps, len(share)):
            continue
        steps = np.array([w[0] for w in rank_windows])
        peers = [v for r, v in p50.items() if r != rank and not np.isnan(v)]
        peer_median = float(np.median(peers)) if peers else float("nan")
        shifted_vs_peers = bool(peers) and p50[rank] * SHIFT_FACTOR <= peer_median
        rank_latency = latency[mask]
        rank_steps = table.column("step").to_numpy(zero_copy_only=False)[mask]
        early = rank_latency[rank_steps == steps[0]] if len(steps) > 2 else np.array([])
        shifted_vs_self = len(early) > 0 and gm.percentile(
            rank_latency[rank_steps >= steps[high][0]], 50) * SHIFT_FACTOR <= gm.percentile(early, 50)
        confidence = 0.6 + (0.3 if shifted_vs_peers or shifted_vs_self else 0.0) + \
            0.09 * float(np.mean(high))
        median_share = float(np.median(share[high]))
        anomalies.append(Anomaly(
            kind="launch_bound", ranks=[rank], cause="cpu",
            first_step=int(steps[high].min()), last_step=int(steps[high].max()),
            impact=median_share, confidence=min(0.99, confidence),
            summary=(f"rank {rank}'s GPU waited {median_share:.0%} of each sampled step for the "
                     f"CPU to launch work (median issue latency {p50[rank]:.0f} µs"
                     + (f" vs {peer_median:.0f} µs on peers" if peers else "") + ")"),
            evidence={
                "host_wait_share_median": round(median_share, 4),
                "steps_flagged": int(high.sum()),
                "issue_latency_p50_us": round(p50[rank], 3),
                "issue_latency_p90_us": round(gm.percentile(rank_latency, 90), 3),
                "peer_issue_latency_p50_us": None if np.isnan(peer_median) else round(peer_median, 3),
                "shifted_vs_peers": shifted_vs_peers, "shifted_vs_own_start": bool(shifted_vs_self),
            },
            trace_ids=gm.trace_ids_of(table, mask),
        ))
    return anomalies
