"""Collective slow: communication itself got slower than it usually is in this job.

The pure transfer time of a collective is the time of the rank that arrived last (it
waited for nobody), so waiting for stragglers is excluded. Divided into the bytes
moved, it is an effective bandwidth; a persistent drop against the group's own
earlier collectives (a change point) is labelled with cause `communication`.

Two views: per process group from the sampled `collective.*` detail spans (matched
across ranks by (pg, seq); the group's bandwidth over its own history), and for the
whole job from the always-on step summary (the least collective wait of each step).
"""

from __future__ import annotations

import math

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.causes import host_busy
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import change_point, nanmedian
from flare.wire import semconv as sc

_MIN_SHIFT = 0.25  # transfer time per byte up by at least this much
_MIN_COMM_SHARE = 0.05  # and communication a visible share of the step


_GROUP_MIN_SEGMENT = 3  # detail collectives are sampled: a few points per regime suffice


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    found = _per_group(job, config)
    return found or _whole_job(job, config)


def _per_group(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    spans = job.spans(["collective.*"], [sc.COLL_PG, sc.COLL_SEQ, sc.COLL_BYTES, sc.COLL_OP,
                                         sc.COLL_SOURCE, sc.COLL_BUSBW_GBPS],
                      columns=["rank", "step", "start_ns", "duration_ns"])
    if spans.num_rows == 0:
        return []
    # Past warm-up only: a job's first collectives (a model's parameters broadcast at
    # set-up, FSDP's first all-gathers) move differently sized tensors at varying speed
    # within a step or two; read as a slowdown they gave a false label, "steps 0-0",
    # impact 0.78, beside a straggler (FSDP2 job, quiet, seen once).
    first_warm = _first_warm_step(job, config)
    # (pg, seq) → the last arrival's time (the least duration) and the bytes moved.
    by_call: dict[tuple[str, int], list] = {}
    for rank, step, start, duration, pg, seq, size, op, source, busbw in zip(
            spans["rank"].to_pylist(), spans["step"].to_pylist(), spans["start_ns"].to_pylist(),
            spans["duration_ns"].to_pylist(),
            spans[sc.COLL_PG].to_pylist(), spans[sc.COLL_SEQ].to_pylist(),
            spans[sc.COLL_BYTES].to_pylist(), spans[sc.COLL_OP].to_pylist(),
            spans[sc.COLL_SOURCE].to_pylist(), spans[sc.COLL_BUSBW_GBPS].to_pylist(),
            strict=False):
        if pg is None or seq is None or not duration or not size:
            continue
        if step is not None and first_warm is not None and step < first_warm:
            continue
        if source == "flight_recorder" and busbw is None:
            # no completion recorded (gloo): the span ends with the enclosing backward,
            # so its length is the rest of the backward's compute, not a transfer time
            continue
        entry = by_call.setdefault((pg, seq), [duration, size, step, op, set(), 0])
        entry[0] = min(entry[0], duration)
        entry[4].add(rank)
        if start is not None:
            entry[5] = max(entry[5], start + duration)
    groups: dict[str, list[tuple[int, float, int | None, str | None, int, int]]] = {}
    for (pg, seq), (duration, size, step, op, ranks, end) in by_call.items():
        if len(ranks) >= 2:
            groups.setdefault(pg, []).append((seq, size / (duration / 1e9) / 1e9, step, op,
                                              len(ranks), end))
    anomalies = []
    for pg, calls in sorted(groups.items()):
        calls.sort()
        gbps = np.array([c[1] for c in calls])
        point = change_point(1.0 / gbps, _GROUP_MIN_SEGMENT)
        if (point is None or point.shift < _MIN_SHIFT or point.score < config.fail_slow_min_score
                or point.consistency < config.change_min_consistency):
            continue
        stepped = [c[2] for c in calls if c[2] is not None]
        if stepped and len({c[2] for c in calls[point.index:] if c[2] is not None}) < 2:
            continue  # a change within one step is no lasting slowdown
        since, until = calls[point.index - 1][5], calls[-1][5]
        if since and until and (until - since) / 1e9 < config.min_persist_s:
            continue  # nor one shorter than a host's hiccup (DiagnosisConfig.min_persist_s)
        before = float(np.median(gbps[:point.index]))
        after = float(np.median(gbps[point.index:]))
        first_step = next((c[2] for c in calls[point.index:] if c[2] is not None), None)
        since = (f"step {first_step}" if first_step is not None
                 else f"collective #{calls[point.index][0]}")
        anomalies.append(Anomaly(
            kind="collective_slow", ranks=[], cause="communication", first_step=first_step,
            last_step=calls[-1][2], impact=min(1.0, 1 - after / before),
            confidence=min(0.99, 1 - math.exp(-point.score / config.fail_slow_min_score)),
            summary=f"process group {pg} runs its collectives at {after:.2f} GB/s from {since}, "
                    f"down from its usual {before:.2f} GB/s ({after / before - 1:+.0%})",
            evidence={"pg": pg, "gbps_before": round(before, 4), "gbps_after": round(after, 4),
                      "first_seq": calls[point.index][0], "collectives": len(calls),
                      "group_size": max(c[4] for c in calls)},
        ))
    return anomalies


def _first_warm_step(job: JobData, config: DiagnosisConfig) -> int | None:
    """The first step past warm-up (frame.warm_mask); None without step data."""
    frame = frames.load(job, config)
    if frame is None:
        return None
    warm = frames.warm_mask(frame, config)
    return int(frame.steps[int(np.argmax(warm))]) if warm.any() else int(frame.steps[-1]) + 1


def _whole_job(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    frame = frames.load(job, config)
    if frame is None or len(frame.ranks) < 2:
        return []
    warm = np.flatnonzero(frames.warm_mask(frame, config))
    persist = max(2, math.ceil(config.min_persist_steps / frame.bucket))
    if warm.size < 2 * persist:
        return []
    transfer_ms = frames.least_wait(frame, warm)
    warm, transfer_ms = warm[np.isfinite(transfer_ms)], transfer_ms[np.isfinite(transfer_ms)]
    if warm.size < 2 * persist:
        return []
    moved = nanmedian(frame.bytes[:, warm].astype(np.float64), axis=0)
    per_byte = np.isfinite(moved) & (moved > 0)
    if per_byte.mean() <= 0.9:
        # Without bytes, a longer least wait is no evidence of a slower fabric: more data,
        # or (on a shared CPU host) a descheduled rank, look the same.
        return []
    cost = np.where(per_byte, transfer_ms / np.where(per_byte, moved, 1.0), np.nan)
    point = change_point(cost, persist)
    if (point is None or point.shift < _MIN_SHIFT or point.score < config.fail_slow_min_score
            or point.consistency < config.change_min_consistency):
        return []
    if frame.wall_ms(warm[point.index:]) < config.min_persist_s * 1e3:
        return []
    onset = int(warm[point.index])
    after = warm >= onset
    step_ms = nanmedian(frame.duration[:, warm].astype(np.float64), axis=0)
    comm_after = float(np.nanmedian(transfer_ms[after]))
    comm_before = float(np.nanmedian(transfer_ms[~after]))
    share = (comm_after - comm_before) / float(np.nanmedian(step_ms[after]))
    if share < _MIN_COMM_SHARE or host_busy(frame, warm[after], comm_after - comm_before):
        return []  # (or a busy host's descheduled collective threads: causes.host_busy)
    first = frame.step_of(onset)
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
