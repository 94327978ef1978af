"""From a label to the line: where the culprit's time goes that its peers' does not.

Captured steps (`flare.capture` children, `flare.instrumentation.stack_capture`) hold,
per rank and step, the lines its training thread was sampled on. For a label with ranks,
each line's time per captured step is compared between the label's ranks (the culprit)
and the other ranks captured over the same steps (the peer): the lines the culprit
spends more on, in ms per step, are the label's `hotspots`, and the first is its
`callsite` ("examples/train_ddp.py:155 in burn_compute: +58 ms/step (culprit 61 ms,
peer 3 ms)"). Lines the culprit was blocked on ("waiting in …") never come before a
line it worked on. Without a captured peer the culprit's own lines are listed, peer 0.
The rank's DataLoader workers, recorded over the capture (`flare.capture.window_steps`
steps, lines marked `[DataLoader worker]`), count per step of that window beside them:
an input-bound rank's line is then the worker's (`__getitem__`, the collate function),
not its training thread's wait for the batch.
`flames` gives the same comparison as whole stacks, for the HTML report's culprit-vs-peer
flame graph.
"""

from __future__ import annotations

import math

from flare.diagnostics.model import Anomaly, JobData
from flare.wire import semconv as sc

TOP = 5
MIN_DELTA_MS = 1.0
# A line worked on leads the lines waited on when it holds at least this share of the
# largest extra wait: a rank that waits +39 ms in its all_reduce and works +38 ms in its
# extra function is given the function; +3 ms of work beside +58 ms asleep is noise.
WORK_LEADS_SHARE = 0.25


def attach(job: JobData, anomalies: list[Anomaly]) -> None:
    """Add `hotspots` (and a `callsite` where none is set) to labels with captures."""
    with_ranks = [a for a in anomalies if a.ranks and a.kind != "hang" and a.kind != "error"]
    if not with_ranks or not job.count([sc.SPAN_CAPTURE]):
        return
    table = job.spans([sc.SPAN_CAPTURE], attributes=[sc.CAPTURE_FRAMES, sc.CAPTURE_SAMPLES,
                                                     sc.CAPTURE_INTERVAL_MS, sc.CAPTURE_WINDOW_STEPS,
                                                     sc.CAPTURE_WORKERS],
                      columns=["rank", "step"])
    rows = [r for r in table.to_pylist() if isinstance(r.get(sc.CAPTURE_FRAMES), list)
            and isinstance(r.get(sc.CAPTURE_SAMPLES), list) and r.get("rank") is not None]
    for anomaly in with_ranks:
        hotspots = _compare(rows, set(anomaly.ranks), anomaly.first_step, anomaly.last_step)
        if not hotspots:
            continue
        anomaly.evidence["hotspots"] = hotspots
        if _workers_pending(rows, set(anomaly.ranks)):
            # its workers' lines come when the capture ends: this line may not be the last
            anomaly.evidence["capture_pending"] = "DataLoader workers"
        top = hotspots[0]
        if anomaly.callsite is None:
            anomaly.callsite = (f"{top['frame']}: +{top['delta_ms']:.0f} ms/step (culprit "
                                f"{top['culprit_ms']:.0f} ms, peer {top['peer_ms']:.0f} ms)")


def name_phases(job: JobData, anomalies: list[Anomaly]) -> None:
    """A label of a framework phase (cause `checkpoint` or `evaluation`) names the phase's
    function, the one its ranks spent the most time in over the label's steps (the
    `python.call` spans with `flare.phase`): `evidence.phase_function`, and in the
    summary — "rank 0 saves a checkpoint (transformers.trainer.Trainer._save_checkpoint)
    every 10 steps"."""
    for anomaly in anomalies:
        if anomaly.cause not in (sc.PHASE_CHECKPOINT, sc.PHASE_EVALUATION) or not anomaly.ranks:
            continue
        table = job.spans([sc.SPAN_PYTHON_CALL], attributes=[sc.PHASE, sc.CODE_FUNCTION],
                          first_step=anomaly.first_step, last_step=anomaly.last_step,
                          ranks=anomaly.ranks, columns=["duration_ns"])
        spent: dict[str, int] = {}
        for row in table.to_pylist():
            if row.get(sc.PHASE) == anomaly.cause and isinstance(row.get(sc.CODE_FUNCTION), str):
                spent[row[sc.CODE_FUNCTION]] = spent.get(row[sc.CODE_FUNCTION], 0) + int(row["duration_ns"] or 0)
        if not spent:
            continue
        function = max(spent, key=spent.__getitem__)
        anomaly.evidence["phase_function"] = function
        from flare.diagnostics.straggler_label import PHASE_DOING  # (the label's own words)

        for words in PHASE_DOING[anomaly.cause]:
            if f" {words} " in anomaly.summary:
                anomaly.summary = anomaly.summary.replace(f" {words} ", f" {words} ({function}) ", 1)
                break


def _compare(rows: list[dict], culprits: set[int], first: int | None, last: int | None) -> list[dict]:
    rows = [r for r in rows if _within(r, first, last)]
    windows = [r for r in rows if _window(r)]  # the workers' recordings: per step of their own
    rows = [r for r in rows if not _window(r)]
    # Like against like: where culprit and peer were both captured over some of the same
    # steps, only those steps are compared (a culprit captured over 12 steps against a peer
    # over 40 compares different phases of the run: its wait in a collective came first).
    steps = {side: {r.get("step") for r in rows if (int(r["rank"]) in culprits) == side} for side in (True, False)}
    common = steps[True] & steps[False] - {None}
    if common:
        rows = [r for r in rows if r.get("step") in common]
    sides: dict[bool, tuple[dict[str, float], set]] = {True: ({}, set()), False: ({}, set())}
    for row in rows:
        step = row.get("step")
        ms, steps = sides[int(row["rank"]) in culprits]
        steps.add((row["rank"], step))
        interval = float(row.get(sc.CAPTURE_INTERVAL_MS) or 10.0)
        for frame, count in zip(row[sc.CAPTURE_FRAMES], row[sc.CAPTURE_SAMPLES], strict=False):
            ms[frame] = ms.get(frame, 0.0) + float(count) * interval
    culprit_steps, peer_steps = sides[True][1], sides[False][1]
    if not culprit_steps:
        return []
    per_step = {side: {frame: total / len(steps) for frame, total in ms.items()} if steps else {}
                for side, (ms, steps) in sides.items()}
    for side, extra in _per_window_step(windows, culprits).items():
        for frame, value in extra.items():
            per_step[side][frame] = per_step[side].get(frame, 0.0) + value
    out = []
    for frame, mine in per_step[True].items():
        theirs = per_step[False].get(frame, 0.0)
        if mine - theirs >= MIN_DELTA_MS:
            out.append({"frame": frame, "culprit_ms": round(mine, 1), "peer_ms": round(theirs, 1),
                        "delta_ms": round(mine - theirs, 1), "culprit_steps": len(culprit_steps),
                        "peer_steps": len(peer_steps)})
    # The work first: a line the culprit was blocked on (sc.CAPTURE_WAITING: in a
    # collective, a queue, a lock, sleep or I/O) follows every line it worked on for a
    # real part of that wait (WORK_LEADS_SHARE), and leads only when the extra time is
    # all waiting (a data loader that sleeps in I/O: a few ms of noise elsewhere, on a
    # loaded host, must not take its place).
    top_wait = max((h["delta_ms"] for h in out if h["frame"].startswith(sc.CAPTURE_WAITING)), default=0.0)

    def order(h: dict) -> tuple[bool, float]:
        work = not h["frame"].startswith(sc.CAPTURE_WAITING) and h["delta_ms"] >= WORK_LEADS_SHARE * top_wait
        return (not work, -h["delta_ms"])

    out.sort(key=order)
    return out[:TOP]


def _within(row: dict, first: int | None, last: int | None) -> bool:
    """Whether a capture falls in the label's steps. A workers' recording is dated by the
    step it ended in and spans `window_steps` before it: it counts where that span meets
    the label's steps. (A live label ends at the last step every rank has sent, which
    can be before the step the culprit's recording ended in: read as outside, its worker
    line was left out while its arrival said the capture was complete, and the live line
    was the training thread's wait for its batches, seen on a loaded host.)"""
    step = row.get("step")
    if step is None:
        return True
    start = step - math.ceil(_window(row))
    return (first is None or step >= first) and (last is None or start <= last)


def _workers_pending(rows: list[dict], culprits: set[int]) -> bool:
    """Whether a culprit rank's workers were being recorded and their capture is not in."""
    recorded = {r["rank"] for r in rows if int(r["rank"]) in culprits and _count(r.get(sc.CAPTURE_WORKERS)) > 0}
    arrived = {r["rank"] for r in rows if int(r["rank"]) in culprits and _window(r)}
    return bool(recorded - arrived)


def _count(value) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):  # a backend that gives the attribute untyped and odd
        return 0.0


def _window(row: dict) -> float:
    """The steps a workers' recording spanned (0: a captured step of its own)."""
    try:
        return max(0.0, float(row.get(sc.CAPTURE_WINDOW_STEPS) or 0.0))
    except (TypeError, ValueError):
        return 0.0


def _per_window_step(windows: list[dict], culprits: set[int]) -> dict[bool, dict[str, float]]:
    """Each side's worker lines in ms per step of their recordings, per rank: the
    recording's samples over the steps it spanned, averaged over the side's ranks."""
    sums: dict[bool, dict[str, float]] = {True: {}, False: {}}
    ranks: dict[bool, set] = {True: set(), False: set()}
    for row in windows:
        side = int(row["rank"]) in culprits
        ranks[side].add(row["rank"])
        interval = float(row.get(sc.CAPTURE_INTERVAL_MS) or 10.0)
        for frame, count in zip(row[sc.CAPTURE_FRAMES], row[sc.CAPTURE_SAMPLES], strict=False):
            sums[side][frame] = sums[side].get(frame, 0.0) + float(count) * interval / _window(row)
    return {side: {frame: ms / len(ranks[side]) for frame, ms in frames.items()}
            for side, frames in sums.items() if ranks[side]}


def flames(job: JobData, anomaly: Anomaly) -> tuple[dict, dict] | None:
    """The culprit's and the peer's sampled stacks over the label's steps as two trees
    (`{"name", "ms", "children"}`, ms per captured step), or None without captures."""
    if not anomaly.evidence.get("hotspots"):
        return None
    rows = job.spans([sc.SPAN_CAPTURE], attributes=[sc.CAPTURE_STACKS, sc.CAPTURE_STACK_SAMPLES,
                                                    sc.CAPTURE_INTERVAL_MS, sc.CAPTURE_WINDOW_STEPS],
                     first_step=anomaly.first_step, last_step=anomaly.last_step,
                     columns=["rank", "step"]).to_pylist()
    rows = [r for r in rows if isinstance(r.get(sc.CAPTURE_STACKS), list)
            and isinstance(r.get(sc.CAPTURE_STACK_SAMPLES), list) and r.get("rank") is not None]
    culprits = set(anomaly.ranks)
    trees = {True: {"name": "all", "ms": 0.0, "children": {}}, False: {"name": "all", "ms": 0.0, "children": {}}}
    steps: dict[bool, set] = {True: set(), False: set()}
    for row in rows:
        if not _window(row):
            steps[int(row["rank"]) in culprits].add((row["rank"], row.get("step")))
    if not steps[True]:
        return None
    # a workers' recording counts per step of its window, per rank of its side: scaled
    # here so that the common division by the side's captured steps below gives that
    worker_ranks = {side: {r["rank"] for r in rows if _window(r) and (int(r["rank"]) in culprits) == side}
                    for side in (True, False)}
    for row in rows:
        side = int(row["rank"]) in culprits
        scale = (max(1, len(steps[side])) / (_window(row) * len(worker_ranks[side]))
                 if _window(row) else 1.0)
        interval = float(row.get(sc.CAPTURE_INTERVAL_MS) or 10.0)
        for stack, count in zip(row[sc.CAPTURE_STACKS], row[sc.CAPTURE_STACK_SAMPLES], strict=False):
            ms = float(count) * interval * scale
            node = trees[side]
            node["ms"] += ms
            for name in str(stack).split(";"):
                node = node["children"].setdefault(name, {"name": name, "ms": 0.0, "children": {}})
                node["ms"] += ms

    def per_step(node: dict, n: int) -> dict:
        return {"name": node["name"], "ms": node["ms"] / n,
                "children": sorted((per_step(c, n) for c in node["children"].values()), key=lambda c: -c["ms"])}

    return per_step(trees[True], len(steps[True])), per_step(trees[False], max(1, len(steps[False])))


class CaptureRequests:
    """Asks the ranks of each new label, and one healthy peer (the lowest rank no label
    names), for a targeted capture (`flare.instrumentation.stack_capture`) through a
    collector's OpAMP server: `ask(job, ranks, steps)` returns its answer
    (`{"asked": [...], "unknown": [...]}`; `flare run` calls its embedded collector,
    `flare diagnose --follow --collector URL` POSTs /flare/v1/capture). A rank is asked
    once; one whose agent the collector does not know yet is asked again with the next
    label."""

    KINDS = ("straggler", "fail_slow", "dataloader_stall", "gc_pause", "collective_slow")

    def __init__(self, ask, job: str | None, steps: int = 20) -> None:
        self.ask = ask
        self.job = job
        self.steps = steps
        self.asked: set[int] = set()
        self.requests: list[tuple[list[int], int | None]] = []  # (culprits, peer)
        self.asked_at: dict[int, int] = {}  # rank → the job's last step when it was asked

    def on_alert(self, anomaly: Anomaly, diagnosis) -> None:
        culprits = sorted(int(r) for r in anomaly.ranks)
        if anomaly.kind not in self.KINDS or not culprits or set(culprits) <= self.asked:
            return
        labelled = {int(r) for a in diagnosis.anomalies for r in a.ranks}
        ranks = diagnosis.job_data.ranks() if diagnosis.job_data is not None else []
        peer = next((int(r) for r in sorted(ranks) if int(r) not in labelled), None)
        wanted = [*culprits, *([] if peer is None or peer in self.asked else [peer])]
        result = self.ask(self.job or diagnosis.job, wanted, self.steps)
        asked = result.get("asked", [])
        self.asked.update(asked)
        last = diagnosis.steps[1] if diagnosis.steps else None
        if last is not None:
            for rank in asked:
                self.asked_at.setdefault(int(rank), int(last))
        self.requests.append((culprits, peer))

    def unanswered(self, anomalies: list[Anomaly], steps: tuple[int, int] | None) -> None:
        """Say, on each label whose ranks were asked for a capture and that still has no
        line, when it was asked and why no line came (seen: an alert 6 s before the job
        ended, then a report with no line and no word of the capture): evidence
        `capture` = {"asked_at_step", "window_steps", "last_step"}."""
        last = steps[1] if steps else None
        for anomaly in anomalies:
            if anomaly.callsite is not None or anomaly.kind not in self.KINDS:
                continue
            at = [self.asked_at[int(r)] for r in anomaly.ranks if int(r) in self.asked_at]
            if at:
                # ended before the window closed, or captured with no line standing out
                anomaly.evidence["capture"] = {
                    "asked_at_step": min(at), "window_steps": self.steps, "last_step": last,
                    "ended_early": last is None or last - min(at) < self.steps}
