"""The plain-text report: a table a person reads in a terminal (colour only on a TTY)."""

from __future__ import annotations

import textwrap
import time

from flare.diagnostics.pipeline import Diagnosis
from flare.wire import semconv as sc

NATIVE_SHOWN = 4  # a hang's innermost native frames in the text report

_COLOURS = {"hang": "31", "error": "31", "rank_missing": "31", "straggler": "33",
            "fail_slow": "33", "regression": "35"}


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "all"
    text = ",".join(map(str, ranks[:8]))
    return text + (f",+{len(ranks) - 8}" if len(ranks) > 8 else "")


def _steps(first: int | None, last: int | None) -> str:
    if first is None:
        return "-"
    return f"{first}-" if last is None else (f"{first}" if first == last else f"{first}-{last}")


def at(callsite: str) -> str:
    """"at FILE:LINE …", or a captured line the rank was blocked on as it is ("waiting in
    FILE:LINE …"): seen, "at waiting in /tmp/x.py:24 in my_slow_sleep"."""
    return callsite if callsite.startswith(sc.CAPTURE_WAITING) else f"at {callsite}"


def unanswered_capture(capture: dict) -> str:
    """Why a label asked a capture of has no line (hotspots.CaptureRequests.unanswered)."""
    asked, window, last = capture["asked_at_step"], capture["window_steps"], capture.get("last_step")
    if not capture.get("ended_early", True):
        return (f"no line: its ranks were captured from step {asked}; no line of theirs took "
                "more time than their peer's")
    ran = f"the job ended at step {last}, " if last is not None else ""
    return (f"no line: its ranks were asked for a capture at step {asked}; {ran}before the "
            f"capture's {window} steps were done")


def render(diagnosis: Diagnosis, colour: bool = False, width: int = 100) -> str:
    steps = diagnosis.steps
    head = (f"Flare diagnosis of job {diagnosis.job} ({diagnosis.backend}), "
            + (f"steps {steps[0]}-{steps[1]}" if steps else "no steps recorded"))
    lines = [head]
    if diagnosis.baseline:
        from flare.diagnostics.fleet import describe_signature

        picked = diagnosis.baseline
        lines.append(f"Compared with job {picked['job']}" + (
            f", picked as the most recent earlier job with the same signature "
            f"({describe_signature(picked.get('signature'))})" if picked.get("picked") == "auto" else "") + "."
            + (f" Passed over for their labels: {', '.join(picked['passed_over'])}."
               if picked.get("passed_over") else "")
            + (" It carries labels of its own, as every earlier such job does: a faulty run is a poor "
               "baseline." if picked.get("labelled") else ""))
    unseen = diagnosis.steps_unseen
    if unseen:
        lines.append(f"Steps unseen: ranks {_ranks(unseen['ranks'])} trained for "
                     f"{unseen['trained_s']:g} s ({unseen['batches']} batches) and {unseen['note']}.")
    elif not steps:
        lines.append(f"(no train.step spans: is {diagnosis.job} a training job instrumented by "
                     "Flare, and has it finished a step yet?)")
    if diagnosis.detector_errors:  # said before any verdict: "no anomalies" would be false
        lines.append(f"PARTIAL REPORT: {diagnosis.partial_text()}")
    if not diagnosis.anomalies:
        lines.append("No anomalies found by the detectors that ran." if diagnosis.detector_errors
                     else "No anomalies found.")
        lines.extend(_host(diagnosis.host_contention))
        lines.extend(_wait_unknown(diagnosis.wait_unknown))
        lines.extend(_contention_unknown(diagnosis.contention_unknown))
        # the framework's phases every rank ran (an evaluation every N steps): time spent
        lines.extend(_time_table([r for r in diagnosis.time_lost if r["kind"] == "phase"]))
        lines.extend(_live(diagnosis.live_alerts))
        lines.extend(_withdrawn(diagnosis.withdrawn))
        return "\n".join(lines) + "\n"
    lines.append(f"{len(diagnosis.anomalies)} anomal{'y' if len(diagnosis.anomalies) == 1 else 'ies'}:")
    lines.append("")
    header = f"{'#':>2}  {'KIND':<16} {'RANKS':<12} {'CAUSE':<13} {'STEPS':<11} {'IMPACT':>6} {'CONF':>5}"
    lines.append(_bold(header, colour))
    for i, a in enumerate(diagnosis.anomalies, 1):
        kind = f"{a.kind:<16}"
        if colour and a.kind in _COLOURS:
            kind = f"\x1b[{_COLOURS[a.kind]}m{kind}\x1b[0m"
        lines.append(f"{i:>2}  {kind} {_ranks(a.ranks):<12} {a.cause:<13} "
                     f"{_steps(a.first_step, a.last_step):<11} {a.impact:>6.0%} {a.confidence:>5.2f}")
        for line in textwrap.wrap(a.summary, width=width - 6):
            lines.append("      " + line)
        if a.callsite and a.callsite not in a.summary:  # (an error's summary names it)
            lines.append(f"      {at(a.callsite)}")
        elif not a.callsite and a.evidence.get("capture"):
            lines.append(f"      {unanswered_capture(a.evidence['capture'])}")
        native = a.evidence.get("native_frames")
        if native:  # a hang's C/C++ frames (py-spy): where under the Python line it waits
            lines.append("      native: " + " < ".join(native[:NATIVE_SHOWN])
                         + (" < …" if len(native) > NATIVE_SHOWN else ""))
    lines.extend(_host(diagnosis.host_contention))
    lines.extend(_wait_unknown(diagnosis.wait_unknown))
    lines.extend(_contention_unknown(diagnosis.contention_unknown))
    lines.extend(_time_table(diagnosis.time_lost))
    lines.extend(_live(diagnosis.live_alerts))
    lines.extend(_withdrawn(diagnosis.withdrawn))
    lines.append("")
    lines.append("IMPACT: share of the run's time the problem cost; CONF: confidence (0-1). "
                 "Evidence per label: --format json or html.")
    return "\n".join(lines) + "\n"


def _wait_unknown(row: dict | None) -> list[str]:
    if not row:
        return []
    return ["", f"Wait unknown: ranks {_ranks(row['ranks'])} steps "
                f"{_steps(row['first_step'], row['last_step'])} ran "
                f"{row['collectives_per_step']:g} {row['note']}."]


def _contention_unknown(row: dict | None) -> list[str]:
    if not row:
        return []
    return ["", f"Host contention unknown: ranks {_ranks(row['ranks'])} {row['note']}."]


def _host(rows: list[dict]) -> list[str]:
    """Ranks the host starved of CPU: the machine's condition, not the job's fault."""
    if not rows:
        return []
    out = ["", "The host, not the job (ranks waiting for a CPU while other work ran):"]
    for row in rows:
        who = f"ranks {_ranks(row['ranks'])}" if row["ranks"] else "all ranks"
        out.append(f"    {who} steps {_steps(row['first_step'], row['last_step'])}: "
                   f"+{row['runqueue_delta_ms'] or 0:.1f} ms/step waiting for a CPU, "
                   + (f"+{row['asleep_delta_ms']:.1f} ms/step asleep, " if row.get("asleep_delta_ms") else "")
                   + f"{row['share']:.0%} of the run's time")
    return out


def _live(alerts: list[dict]) -> list[str]:
    """What the live monitor said, against this report: one line."""
    if not alerts:
        return []
    kept = sum(1 for a in alerts if a["kept"])
    return ["", f"Live alerts: {len(alerts)} said while the job ran, {kept} kept in this report"
                + ("." if kept == len(alerts) else " (the others are withdrawn, below).")]


def _withdrawn(alerts: list[dict]) -> list[str]:
    """Live alerts the final report does not keep: said, never silently dropped."""
    if not alerts:
        return []
    out = ["", "Withdrawn live alerts:"]
    for alert in alerts:
        since = f" from step {alert['first_step']}" if alert["first_step"] is not None else ""
        out.append(f"    [{alert['kind']}] ranks {_ranks(alert['ranks'])} cause {alert['cause']}"
                   f"{since}: {alert['reason']}")
    return out


def _time_table(rows: list[dict]) -> list[str]:
    """Where the time went: seconds and share of the run per culprit and cause."""
    if not rows or not any(r["seconds"] > 0 for r in rows):
        return []
    # Each half of the heading only over rows it describes (seen: the phase half over a
    # table without a phase row).
    said = []
    if any(r["kind"] != "phase" for r in rows):
        said.append("time the other ranks waited, by culprit")
    if any(r["kind"] == "phase" for r in rows):
        said.append("time every rank spent, by framework phase")
    # as wide as the widest cause (seen: "hang (software)" pushed its row's figures
    # one column right of the heading's)
    width = max(13, *(len(str(r["cause"])) for r in rows))
    out = ["", f"Where the time went ({'; '.join(said)}):",
           f"    {'WHO':<36} {'CAUSE':<{width}} {'SECONDS':>8} {'SHARE':>6}"]
    for row in rows:
        out.append(f"    {row['who'][:36]:<36} {row['cause']:<{width}} {row['seconds']:>8.2f} "
                   f"{row['share']:>6.1%}")
    return out


def _bold(text: str, colour: bool) -> str:
    return f"\x1b[1m{text}\x1b[0m" if colour else text


def live_alert_line(job: str, anomaly) -> str:
    """A live alert as `flare run` and `--follow` print it: the time, then the alert."""
    return f"{time.strftime('%H:%M:%S')} {alert_line(job, anomaly)}"


def alert_line(job: str, anomaly) -> str:
    """One line for a live alert while the job runs."""
    where = (f" {at(anomaly.callsite)}"
             if anomaly.callsite and anomaly.callsite not in anomaly.summary else "")
    since = f" from step {anomaly.first_step}" if anomaly.first_step is not None else ""
    return (f"flare: [{anomaly.kind}] ranks {_ranks(anomaly.ranks)} cause {anomaly.cause}"
            f"{since}{where}: {anomaly.summary}")
