"""Rank missing: a rank went silent while its peers kept reporting.

Every rank sends a heartbeat span from a background thread, so even a rank blocked
in a collective keeps talking; one whose heartbeats stop has died or is wedged below
Python. A rank that never reported at all (world size says it exists) is missing
from the start. Ranks whose failure the error detector explains are left to it.
"""

from __future__ import annotations

from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.instrumentation import semconv as sc

_DEFAULT_INTERVAL_S = 10.0


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    beats = job.spans([sc.SPAN_HEARTBEAT], [sc.HEARTBEAT_INTERVAL_S, sc.HEARTBEAT_LAST_STEP],
                      columns=["rank", "end_ns"])
    last_seen: dict[int, tuple[int, int | None]] = {}
    intervals = []
    for rank, end_ns, interval, step in zip(
            beats["rank"].to_pylist(), beats["end_ns"].to_pylist(),
            beats[sc.HEARTBEAT_INTERVAL_S].to_pylist(), beats[sc.HEARTBEAT_LAST_STEP].to_pylist(), strict=False):
        if rank is None or end_ns is None:
            continue
        if interval:
            intervals.append(interval)
        if rank not in last_seen or end_ns >= last_seen[rank][0]:
            last_seen[rank] = (end_ns, step)
    anomalies = []
    failed = set(job.spans([sc.SPAN_STEP, sc.SPAN_ERROR], columns=["rank"], status_code=2)["rank"].to_pylist())
    if len(last_seen) >= 2:
        interval_s = max(intervals) if intervals else _DEFAULT_INTERVAL_S
        newest = max(t for t, _ in last_seen.values())
        limit_ns = config.silent_heartbeats * interval_s * 1e9
        silent = sorted(r for r, (t, _) in last_seen.items() if newest - t > limit_ns and r not in failed)
        # Only while the rest still talk: when everyone stops, the job ended.
        if silent and len(silent) < len(last_seen):
            last_steps = [last_seen[r][1] for r in silent if last_seen[r][1] is not None]
            quiet_s = min((newest - last_seen[r][0]) / 1e9 for r in silent)
            who = ", ".join(map(str, silent))
            anomalies.append(Anomaly(
                kind="rank_missing", ranks=silent, cause="unknown",
                first_step=max(last_steps) if last_steps else None, last_step=None,
                impact=1.0, confidence=0.9,
                summary=f"rank{'s' if len(silent) > 1 else ''} {who} went silent: no heartbeat "
                        f"for {quiet_s:.0f} s while the other ranks still report",
                evidence={"silent_for_s": round(quiet_s, 1), "heartbeat_interval_s": interval_s},
            ))
    size = job.world_size()
    if size:
        never = sorted(set(range(size)) - set(job.ranks()))
        if never and len(never) < size:
            anomalies.append(Anomaly(
                kind="rank_missing", ranks=never, cause="unknown", first_step=None, last_step=None,
                impact=len(never) / size, confidence=0.9,
                summary=f"{len(never)} of {size} ranks never reported "
                        f"({', '.join(map(str, never[:16]))}{' …' if len(never) > 16 else ''})",
                evidence={"world_size": size, "never_reported": never},
            ))
    return anomalies
