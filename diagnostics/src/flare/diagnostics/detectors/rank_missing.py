"""Rank missing: a rank went silent while its peers kept reporting.

Every rank sends a heartbeat span from a background thread, so even a rank blocked
in a collective keeps talking; one whose heartbeats stop has died or is wedged below
Python. A rank that never reported at all (world size says it exists) is missing
from the start. Ranks whose failure the error detector explains are left to it. Imported traces
(`flare.source` = "kineto") are not live jobs and never get this label.
"""

from __future__ import annotations

from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData, is_imported
from flare.wire import semconv as sc

_DEFAULT_INTERVAL_S = 10.0


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    # An imported trace is a recording of some ranks, not a running job: it has no
    # heartbeats, and ranks nobody imported did not go missing.
    if is_imported(job):
        return []
    anomalies = []
    beats = job.rank_activity([sc.SPAN_HEARTBEAT]).to_pylist()
    if len(beats) >= 2:
        sample = job.spans([sc.SPAN_HEARTBEAT], [sc.HEARTBEAT_INTERVAL_S], columns=["rank"], limit=64)
        intervals = [v for v in sample[sc.HEARTBEAT_INTERVAL_S].to_pylist() if v]
        interval_s = max(intervals) if intervals else _DEFAULT_INTERVAL_S
        newest = max(b["last_end_ns"] for b in beats)
        limit_ns = config.silent_heartbeats * interval_s * 1e9
        quiet = {b["rank"]: newest - b["last_end_ns"] for b in beats if newest - b["last_end_ns"] > limit_ns}
        if quiet:
            failed = set(job.spans([sc.SPAN_STEP, sc.SPAN_ERROR], columns=["rank"], status_code=2)["rank"].to_pylist())
            quiet = {r: q for r, q in quiet.items() if r not in failed}
        # Only while the rest still talk: when everyone stops, the job ended.
        if quiet and len(quiet) < len(beats):
            silent = sorted(quiet)
            steps = {s["rank"]: s["last_step"] for s in job.rank_activity([sc.SPAN_STEP]).to_pylist()}
            last_steps = [steps[r] for r in silent if steps.get(r) is not None]
            quiet_s = min(quiet.values()) / 1e9
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
