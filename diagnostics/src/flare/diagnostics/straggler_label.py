"""A straggler label's figures and words: the named ranks' cause against their peers
(median and mean parts, the CPU they burnt, their run-queue wait), what it cost, and
the summary a person reads. Shared by the persistent labels (`detectors/straggler.py`)
and the periodic and intermittent stalls (`stalls.py`)."""

from __future__ import annotations

import math

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics import ledger as ledgers
from flare.diagnostics.causes import (
    WORK_GREW_FLOOR_MS,
    attribute,
    host_starved,
    means,
    medians,
    waits_without_work,
    work_grew,
)
from flare.diagnostics.model import Anomaly, DiagnosisConfig
from flare.diagnostics.stats import nanmedian


def label(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
           rows: list[int], peers: list[int], cols: np.ndarray, mask: np.ndarray,
           group: str | None, pattern: dict | None = None) -> Anomaly:
    ranks = [int(frame.ranks[r]) for r in rows]
    mine, my_work = medians(frame, rows, cols)
    theirs, their_work = medians(frame, peers, cols)
    my_means, their_means = means(frame, rows, cols), means(frame, peers, cols)
    why = attribute(mine, theirs, config.cause_min_share, my_work, their_work,
                    my_means, their_means)
    lost_per_step = book.lost_by(rows, cols) / max(1, frame.step_count(cols[mask[cols]]))
    burnt_median = median_burnt(frame, rows, peers, cols)

    def grew_beyond(excess_ms: float) -> bool:
        # More work in most of its steps: a CPU burst in a few (its own periodic
        # collection) raises the mean alone, and must not make a starved rank the job's.
        return work_grew(my_means, their_means, excess_ms) and (
            burnt_median is None or burnt_median >= WORK_GREW_FLOOR_MS)

    grew = grew_beyond(lost_per_step)
    # Busier in most steps (its threads' CPU in the median step), its own time not: the
    # delay falls outside its steps (straggler.find); a CPU burst now and then (a
    # periodic collection) is neither.
    busier = (grew and burnt_median is not None
              and burnt_median >= config.straggler_min_noise_units * book.noise_ms)
    if busier and why.excess_ms < config.straggler_min_noise_units * book.noise_ms:
        # An excess in some steps only (the median hides it): its parts' means tell it.
        parts = list(frame.parts)
        why = attribute({k: my_means[k] for k in parts}, {k: their_means[k] for k in parts},
                        config.cause_min_share, sum(my_means[k] for k in parts),
                        sum(their_means[k] for k in parts), my_means, their_means)
    other_cpu_delta = my_means["other_cpu"] - their_means["other_cpu"]
    thread_cpu_delta = my_means["thread_cpu"] - their_means["thread_cpu"]
    burnt = [d for d in (other_cpu_delta, thread_cpu_delta) if math.isfinite(d)]
    runqueue_delta = my_means["runqueue"] - their_means["runqueue"]
    # Most of the excess spent runnable but waiting for a CPU, without burning more of
    # it: the host starved the rank (other work on the machine), not its own code or
    # threads (a GIL holder's victim sleeps on the GIL; that is not run-queue time).
    starved = host_starved(my_means, their_means, why.excess_ms, grew_beyond(why.excess_ms))
    density = float(mask[cols].mean())
    step_share = float(np.mean(book.share()[cols]))
    lost_ms = book.lost_by(rows, cols)
    impact = book.impact(rows, cols)
    first, last = frame.step_of(int(cols[0])), frame.last_step_of(int(cols[-1]))
    before = np.arange(0, int(cols[0]))
    before = before[frames.warm_mask(frame, config)[before]]
    individual = None
    if before.size >= 2:
        _, past_work = medians(frame, rows, before)
        individual = past_work / my_work if my_work > 0 else None
    relative = their_work / my_work if my_work > 0 else None
    persist_factor = min(1.0, len(cols) / (2 * max(1, config.min_persist_steps / frame.bucket)))
    if pattern is not None:
        density = 1.0  # the stalls are the label's steps
    confidence = density * (0.5 + 0.5 * persist_factor) * (1.0 if why.cause != "unknown" else 0.8)
    others = len(frame.ranks) - len(rows)
    cause_text = describe_cause(why.cause, other_cpu_delta)
    if waits_without_work(frame, why.cause, my_means, their_means, why.excess_ms):
        cause_text += " without burning more CPU: it waits (a sleep, blocking I/O or a lock)"
    if len(rows) > 1:
        cause_text = cause_text.replace("its ", "their ").replace("it pauses", "they pause")
    who = (f"rank {ranks[0]}" if len(ranks) == 1
           else f"ranks {','.join(map(str, ranks))}" + (f" ({group})" if group else ""))
    victims = "the other rank" if others == 1 else f"the other {others} ranks"
    counted = frame.step_count(cols[mask[cols]]) if pattern is None else frame.step_count(cols)
    evidence = {
        "culprit_steps": counted,
        "steps_in_run": frame.step_count(cols),
        "excess_ms_per_step": round(why.excess_ms, 3),
        "component_delta_ms": {k: round(v, 3) for k, v in why.deltas_ms.items()},
        "component_ratio": {k: round(v, 3) for k, v in why.ratios.items()},
        "cause_share": round(why.share, 3),
        "other_threads_cpu_delta_ms": (round(other_cpu_delta, 3)
                                       if math.isfinite(other_cpu_delta) else None),
        "cpu_burnt_delta_ms": round(sum(burnt), 3) if burnt else None,
        "cpu_burnt_median_delta_ms": burnt_median,
        "work_grew": grew,
        "relative_score": None if relative is None else round(relative, 3),
        "individual_score": None if individual is None else round(individual, 3),
        "lost_s": round(lost_ms / 1e3, 3),
        "step_share": round(step_share, 4),
    }
    if math.isfinite(runqueue_delta):
        evidence["runqueue_delta_ms"] = round(runqueue_delta, 3)
    if starved:
        evidence["host_starved"] = True
        cause_text = (f"{'it' if len(rows) == 1 else 'they'} waited for a CPU "
                      f"(+{runqueue_delta:.1f} ms/step runnable but not running: the host is "
                      "busy with other work)")
    if group:
        evidence["group"] = group
    if len(rows) > 1:
        evidence["member_excess_ms"] = {
            str(int(frame.ranks[r])): round(medians(frame, [r], cols)[1] - their_work, 3) for r in rows}
    outside = ""
    if busier and why.excess_ms < config.straggler_min_noise_units * book.noise_ms:
        outside = ": the rest of its delay falls between its steps, in no step's time"
    if pattern is None:
        summary = (f"{who} make{'s' if len(rows) == 1 else ''} {victims} wait {step_share:.0%} of "
                   f"each step from step {first} to {last}: {cause_text} "
                   f"(+{why.excess_ms:.1f} ms/step over {'its' if len(rows) == 1 else 'their'} "
                   f"peers{outside}); {impact:.0%} of the run's time")
    else:
        evidence.update(pattern)
        every = (f"every {pattern['period_steps']} steps" if pattern["pattern"] == "periodic"
                 else "now and then")
        doing = PHASE_DOING.get(why.cause)
        if doing:  # a framework phase: what it does, and what each time costs
            summary = (f"{who} {doing[0 if len(rows) == 1 else 1]} {every} "
                       f"(+{pattern['stall_ms'] / 1e3:.1f} s each, {counted} times from step "
                       f"{first} to {last}) while {victims} wait; {impact:.0%} of the run's time")
        else:
            summary = (f"{who} stall{'s' if len(rows) == 1 else ''} {victims} {every} "
                       f"({counted} times from step {first} to {last}, "
                       f"{pattern['stall_ms']:.0f} ms each): {cause_text}; "
                       f"{impact:.0%} of the run's time")
    return Anomaly(
        kind="straggler", ranks=ranks, cause=why.cause, first_step=first, last_step=last,
        impact=impact, confidence=min(confidence, 0.99), summary=summary, evidence=evidence,
    )


def describe_cause(cause: str, other_cpu_delta: float) -> str:
    """What the cause says of one rank ("its compute is slower")."""
    return {
        "compute": "its compute is slower", "input": "its data loading is slower",
        "gc": "it pauses in garbage collection", "cpu": "its Python side is starved of CPU "
        + (f"(its other threads burn +{other_cpu_delta:.1f} ms of CPU per step, as a "
           "GIL-holding thread does)" if math.isfinite(other_cpu_delta) and other_cpu_delta > 0
           else "(every part of its step is slower, as with a GIL-holding thread)"),
        "communication": "its communication is slower", "unknown": "the cause is unclear",
        "checkpoint": "its checkpoint saves take longer",
        "evaluation": "its evaluation takes longer",
    }.get(cause, cause)


# How a periodic label of a framework phase reads: "rank 0 saves a checkpoint every 10
# steps (+0.4 s each, …)" (one rank, several ranks).
PHASE_DOING = {"checkpoint": ("saves a checkpoint", "save a checkpoint"),
               "evaluation": ("evaluates", "evaluate")}


def median_burnt(frame: frames.StepFrame, rows: list[int], peers: list[int], cols: np.ndarray) -> float | None:
    """The CPU the rows' threads (training and others) burnt over their peers' in the
    median step of `cols`; None where neither figure is reported."""
    parts = [m for m in (frame.thread_cpu, frame.other_cpu) if m is not None and np.isfinite(m).any()]
    if not parts:
        return None
    burnt = sum(np.nan_to_num(m.astype(np.float64)) for m in parts)
    mine = nanmedian(burnt[np.asarray(rows)][:, cols], axis=0)
    theirs = nanmedian(burnt[np.asarray(peers)][:, cols], axis=0)
    value = nanmedian(mine - theirs)
    return round(float(value), 3) if np.isfinite(value) else None
