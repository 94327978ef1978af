"""Error: a rank failed; name the first failure, not its echoes.

When one rank raises, its peers fail moments later (a closed connection, a signal
from the launcher): those are consequences. The root cause is the earliest error
that is not such a consequence; its exception and call site are reported, and the
other ranks' failures are listed as evidence, not as separate anomalies.
"""

from __future__ import annotations

import json
import re

from flare.diagnostics.callsite import user_callsite, user_frames
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import semconv as sc

# Failures that a peer's death causes (gloo/NCCL transport errors, launcher signals).
_CONSEQUENCE = re.compile(
    r"Connection (closed|reset)|connection reset|Broken pipe|DistBackendError|NCCL communicator"
    r"|ProcessGroup.*(abort|timeout|shutdown)|SIGTERM|SIGKILL|Signals\.SIG|received signal"
    r"|Terminated|KeyboardInterrupt|SystemExit|Socket Timeout|Timed out|peer", re.I)


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    failed = job.spans([sc.SPAN_STEP, sc.SPAN_ERROR, "python.*", "dataloader.*"],
                       [sc.CODE_CALLSITE, sc.ERROR_SIGNAL, sc.ERROR_TYPE, sc.ERROR_MESSAGE,
                        sc.ERROR_STACKTRACE], status_code=2)
    if failed.num_rows == 0:
        return []
    errors = [_describe(row) for row in failed.to_pylist() if row["rank"] is not None]
    if not errors:
        return []
    errors.sort(key=lambda e: e["time_ns"])
    primary = [e for e in errors if not e["consequence"]]
    if not primary and config.stopped_by_user:
        return []  # the signals and interrupts of the user's own stop
    if not primary:
        vanished = _vanished(job, errors)
        if vanished is not None:
            return [vanished]
    primary = primary or errors
    root = primary[0]
    others = [e for e in errors if e["rank"] != root["rank"]]
    others_text = ""
    if others:
        ranks = sorted({e["rank"] for e in others})
        others_text = f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed after it"
    where = f" at {root['callsite']}" if root["callsite"] else ""
    return [Anomaly(
        kind="error", ranks=[root["rank"]], cause="software", first_step=root["step"],
        last_step=root["step"], impact=1.0, confidence=0.95 if not root["consequence"] else 0.6,
        summary=f"rank {root['rank']} failed first at step {root['step']}: "
                f"{root['type']}: {root['message']}{where}{others_text}",
        callsite=root["callsite"],
        evidence={
            "exception_type": root["type"], "exception_message": root["message"],
            "frames": root["frames"],
            "consequences": [{"rank": e["rank"], "step": e["step"], "type": e["type"],
                              "message": e["message"][:200]} for e in others][:32],
        },
        trace_ids=[root["trace_id"]] if root["trace_id"] else [],
    )]


def _vanished(job: JobData, errors: list[dict]) -> Anomaly | None:
    """Every error is an echo (lost connections, signals): the rank they echo is one
    that reported no error at all and went quiet before the first of them. Killed by
    SIGKILL (the OOM killer) or crashing below Python, it sends nothing as it dies;
    naming the first peer to lose its connection to it would blame a victim."""
    errored = {e["rank"] for e in errors}
    activity = {row["rank"]: row for row in job.rank_activity(
        [sc.SPAN_STEP, sc.SPAN_HEARTBEAT]).to_pylist() if row["rank"] is not None}
    first_error_ns = errors[0]["time_ns"]
    quiet = sorted((row["last_end_ns"], rank) for rank, row in activity.items()
                   if rank not in errored and row["last_end_ns"] is not None
                   and row["last_end_ns"] < first_error_ns)
    if not quiet:
        return None
    ranks = sorted(rank for _, rank in quiet)
    step = min((e["step"] for e in errors if e["step"] is not None), default=None)
    last_steps = {rank: activity[rank]["last_step"] for rank in ranks}
    victims = sorted(errored)
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return Anomaly(
        kind="rank_missing", ranks=ranks, cause="unknown", first_step=step, last_step=step,
        impact=1.0, confidence=0.85,
        summary=f"{who} died without an error"
                + (f" at step {step}" if step is not None else "")
                + ": killed by a signal (SIGKILL, the OOM killer) or crashed below Python; "
                f"rank{'s' if len(victims) > 1 else ''} {', '.join(map(str, victims))} then "
                f"failed, losing {'their' if len(victims) > 1 else 'its'} connection to it "
                f"({errors[0]['type']}: {_clip(errors[0]['message'], 120)})",
        evidence={
            "last_reported_step": last_steps,
            "quiet_before_first_error_s": round((first_error_ns - quiet[-1][0]) / 1e9, 3),
            "consequences": [{"rank": e["rank"], "step": e["step"], "type": e["type"],
                              "message": e["message"][:200]} for e in errors][:32],
        },
        trace_ids=[errors[0]["trace_id"]] if errors[0]["trace_id"] else [],
    )


def _describe(row: dict) -> dict:
    exception = {}
    try:
        for event in json.loads(row.get("events") or "[]"):
            if event.get("name") == "exception":
                exception = event.get("attributes") or {}
                break
    except ValueError:
        exception = {}
    exc_type = exception.get(sc.ERROR_TYPE) or row.get(sc.ERROR_TYPE) or "error"
    message = exception.get(sc.ERROR_MESSAGE) or row.get(sc.ERROR_MESSAGE) or row.get("status_message") or ""
    stack = exception.get(sc.ERROR_STACKTRACE) or row.get(sc.ERROR_STACKTRACE)
    signal = row.get(sc.ERROR_SIGNAL)
    # the innermost frame of the user's code in the stack, where the span's own call
    # site may be a library's (a transport error raised inside autograd's engine)
    callsite = user_callsite(stack) or row.get(sc.CODE_CALLSITE)
    text = f"{exc_type}: {message}"
    return {
        "rank": int(row["rank"]), "step": row["step"], "time_ns": row["end_ns"] or row["start_ns"] or 0,
        "type": exc_type, "message": str(message).strip().splitlines()[0] if message else "",
        "callsite": callsite, "frames": user_frames(stack),
        "consequence": signal is not None or bool(_CONSEQUENCE.search(text)),
        "trace_id": row.get("trace_id"),
    }


def _clip(text: str, limit: int) -> str:
    """`text` on one line, cut at a word's end within `limit` characters and marked as
    cut (a summary read "…Connection reset by )", cut mid-word with no sign of it)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0] if " " in text[limit // 2:limit] else text[:limit]
    return cut.rstrip() + " …"
