"""Hang: ranks stopped making progress; name the one the others are waiting for.

The watchdog on each rank emits `flare.hang` when an operation runs past its limit,
with what was in flight and every thread's stack. Ranks stuck *inside a collective*
are victims; the culprit is the rank that is not where the others are — stuck in
its own code (no collective in flight), behind on the group's sequence number, or
silent altogether (no dump from it while its peers wait). Its call site comes from
its own stack.
"""

from __future__ import annotations

from flare.diagnostics.callsite import user_callsite, user_frames
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import pyspy_dump
from flare.wire import semconv as sc

_ATTRS = (sc.HANG_OPERATION, sc.HANG_STACKS, sc.HANG_PG, sc.HANG_SEQ, sc.HANG_COLL_OP,
          sc.HANG_ELAPSED_S, sc.HANG_TIMEOUT_S, sc.CODE_CALLSITE, sc.HANG_NATIVE_STACKS, sc.HANG_THREAD,
          sc.HANG_LOADER_WORKERS, sc.HANG_LOADER_STACKS)
NATIVE_FRAMES = 40  # of the culprit's blocked thread, innermost first


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    dumps = job.spans([sc.SPAN_HANG], _ATTRS)
    dumps = dumps.filter(dumps["rank"].is_valid())
    if dumps.num_rows == 0:
        return []
    latest: dict[int, dict] = {}  # rank → its latest dump
    for row in dumps.to_pylist():
        if row["rank"] not in latest or row["start_ns"] >= latest[row["rank"]]["start_ns"]:
            latest[row["rank"]] = row
    in_collective = {r for r, d in latest.items() if _collective_of(d) is not None}
    stuck_in_own_code = sorted(set(latest) - in_collective)
    world = set(job.ranks())
    size = job.world_size()
    if size:
        world |= set(range(size))
    missing = world - set(latest)
    if (not stuck_in_own_code and missing and not _behind_on_sequence(latest)
            and not _waited_long_enough(job, latest)):
        # Everyone who spoke is a victim inside a collective and some ranks have not
        # spoken yet: their own dumps are likely still on the way. Naming them "never
        # joined" now would often name the wrong rank; wait for their watchdogs.
        return []
    if stuck_in_own_code:
        culprits, cause = stuck_in_own_code, "software"
    else:
        culprits = _behind_on_sequence(latest) or sorted(world - set(latest))
        cause = "communication" if not culprits else "software"
        if not culprits:  # everyone is inside the same collective: the fabric, not a rank
            culprits = sorted(latest)
    victims = sorted(set(latest) - set(culprits))
    culprit_dump = next((latest[r] for r in culprits if r in latest), None)
    callsite = None
    frames: list[str] = []
    if culprit_dump is not None:
        callsite = culprit_dump.get(sc.CODE_CALLSITE) or user_callsite(culprit_dump.get(sc.HANG_STACKS))
        frames = user_frames(culprit_dump.get(sc.HANG_STACKS))
    steps = [d["step"] for d in latest.values() if d["step"] is not None]
    first_step = (culprit_dump or {}).get("step")
    if first_step is None and steps:
        first_step = min(steps)
    # Victims may wait in different collectives (a sub-group's, the world's): each
    # collective is named with its own ranks.
    waiting_on: dict[tuple, list[int]] = {}
    for rank in victims:
        if rank in in_collective:
            waiting_on.setdefault(_collective_of(latest[rank]), []).append(rank)
    stuck_alone = culprit_dump is not None and culprit_dump["rank"] in stuck_in_own_code
    # a culprit waiting on its DataLoader's worker processes: the time is theirs, and the
    # line is the worker's (its dataset's code), not the loop's `for batch in ...`
    workers = list(culprit_dump.get(sc.HANG_LOADER_WORKERS) or []) if stuck_alone else []
    worker_stacks = culprit_dump.get(sc.HANG_LOADER_STACKS) if workers else None
    if workers:
        cause = "input"
        callsite = user_callsite(worker_stacks) or callsite
    function = callsite.rsplit(" in ", 1)[-1] if callsite else None
    culprit_text = ", ".join(map(str, culprits))
    if workers:
        pids = ", ".join(map(str, workers))
        what = (f"rank {culprit_text} waits on its DataLoader worker{'s' if len(workers) > 1 else ''} "
                f"(pid {pids})" + (f", stuck in {function} ({callsite})" if worker_stacks
                                   else " (no worker stack: py-spy is not installed or may not run)"))
    elif stuck_alone:
        what = f"rank {culprit_text} is stuck in {function or 'its own code'}" + (
            f" ({callsite})" if callsite else "")
    elif culprits and set(culprits) != set(latest):
        what = f"rank{'s' if len(culprits) > 1 else ''} {culprit_text} never joined"
    else:
        what = f"ranks {culprit_text} are all stuck in the same collective"
    if victims:
        what += "; " + _victims_text(victims, waiting_on)
    elapsed = max(max((d.get(sc.HANG_ELAPSED_S) or 0.0) for d in latest.values()),
                  _still_stuck_s(job, latest))
    evidence = {
        "stuck_ranks": sorted(latest), "victims": victims,
        "operations": {str(r): d.get(sc.HANG_OPERATION) for r, d in sorted(latest.items())},
        "culprit_frames": frames, "elapsed_s": elapsed,
    }
    if workers:
        evidence["loader_workers"] = workers
        evidence["worker_frames"] = user_frames(worker_stacks)
    if culprit_dump is not None and culprit_dump.get(sc.HANG_NATIVE_STACKS):
        # py-spy's C/C++ frames under the Python ones, where the rank could run it
        evidence["native_frames"] = pyspy_dump.thread_frames(
            culprit_dump[sc.HANG_NATIVE_STACKS], culprit_dump.get(sc.HANG_THREAD))[:NATIVE_FRAMES]
    return [Anomaly(
        kind="hang", ranks=culprits, cause=cause, first_step=first_step, last_step=None,
        impact=1.0, confidence=0.95 if stuck_in_own_code else 0.8,
        summary=f"hang at step {first_step}{_numbering(first_step)}: {what}", callsite=callsite,
        evidence=evidence,
    )]


def _numbering(step: int | None) -> str:
    """How Flare numbers steps, said where a user compares it with their loop's counter:
    a step ends when the optimizer step returns, so code after `optimizer.step()` in the
    loop's iteration N-1 (logging, a checkpoint, the next batch) is in step N."""
    if step is None or step < 1:
        return ""
    return f" (steps end at optimizer.step(): step {step} began when step {step - 1}'s returned)"


def _victims_text(victims: list[int], waiting_on: dict[tuple, list[int]]) -> str:
    def ranks(group: list[int]) -> str:
        return f"rank{'s' if len(group) > 1 else ''} {', '.join(map(str, group))}"

    if len(waiting_on) <= 1:
        where = ""
        if waiting_on:
            (op, pg, seq), _ = next(iter(waiting_on.items()))
            where = f" in {op} (process group {pg}, seq {seq})"
        return f"{ranks(victims)} wait{'' if len(victims) > 1 else 's'} for it{where}"
    parts = [f"{ranks(group)} wait{'' if len(group) > 1 else 's'} in {op} (process group {pg}, seq {seq})"
             for (op, pg, seq), group in sorted(waiting_on.items(), key=lambda kv: (-len(kv[1]), kv[1]))]
    elsewhere = [r for r in victims if not any(r in group for group in waiting_on.values())]
    if elsewhere:
        parts.append(f"{ranks(elsewhere)} wait{'' if len(elsewhere) > 1 else 's'} too")
    return "; ".join(parts)


def _collective_of(dump: dict) -> tuple[str, str, int] | None:
    operation = dump.get(sc.HANG_OPERATION) or ""
    op = dump.get(sc.HANG_COLL_OP)
    if op is None and operation.startswith(sc.SPAN_COLLECTIVE_PREFIX):
        op = operation[len(sc.SPAN_COLLECTIVE_PREFIX):]
    if op is None:
        return None
    return str(op), str(dump.get(sc.HANG_PG)), dump.get(sc.HANG_SEQ)


def _still_stuck_s(job: JobData, latest: dict[int, dict]) -> float:
    """How long the stuck ranks' step had been open by their last heartbeat after their
    dump: the hang goes on after the watchdog's dump, until the job is stopped (a
    hang of ~29 s, stopped by Ctrl-C, read 14.3 s — the dump's figure; `flare nodes`
    charges hosts with it)."""
    beats = job.spans([sc.SPAN_HEARTBEAT], [sc.HEARTBEAT_STEP_OPEN_S], ranks=sorted(latest),
                      columns=["rank", "step", "start_ns"])
    if beats.num_rows == 0:
        return 0.0
    longest = 0.0
    for rank, step, start_ns, open_s in zip(
            beats["rank"].to_pylist(), beats["step"].to_pylist(), beats["start_ns"].to_pylist(),
            beats[sc.HEARTBEAT_STEP_OPEN_S].to_pylist(), strict=True):
        dump = latest.get(rank)
        if (dump is None or open_s is None or start_ns is None or start_ns < dump["start_ns"]
                or (step is not None and dump.get("step") is not None and step != dump["step"])):
            continue  # (a later step of a rank that recovered is no part of this hang)
        longest = max(longest, float(open_s))
    return longest


def _behind_on_sequence(latest: dict[int, dict]) -> list[int]:
    """Within one process group, a rank waiting at a lower seq than its peers is the
    one that fell behind (the others already passed that collective)."""
    by_pg: dict[str, dict[int, int]] = {}
    for rank, dump in latest.items():
        where = _collective_of(dump)
        if where and where[2] is not None:
            by_pg.setdefault(where[1], {})[rank] = int(where[2])
    behind: set[int] = set()
    for seqs in by_pg.values():
        if len(set(seqs.values())) > 1:
            low = min(seqs.values())
            behind |= {r for r, s in seqs.items() if s == low}
    return sorted(behind)


def _waited_long_enough(job: JobData, latest: dict[int, dict]) -> bool:
    """True once the job's own clock (its newest heartbeat or dump) has run a full hang
    timeout past the first dump: any rank with a live watchdog would have dumped by then."""
    first_dump = min(d["start_ns"] for d in latest.values())
    timeout_s = max((d.get(sc.HANG_TIMEOUT_S) or 0.0) for d in latest.values()) or 10.0
    activity = job.rank_activity([sc.SPAN_HEARTBEAT, sc.SPAN_HANG])
    newest = max((t for t in activity["last_end_ns"].to_pylist() if t is not None), default=first_dump)
    return newest - first_dump >= timeout_s * 1e9
