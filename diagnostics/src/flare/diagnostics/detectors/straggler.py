"""Straggler: the ranks the others wait for — the culprits, not their victims.

Collectives equalise step durations, so duration cannot tell culprit from victim.
The time-lost ledger (ledger.py) gives every step its culprit set (the ranks that
arrived within the job's noise of the last) and what the step lost. A rank is a
straggler when it is in the culprit set of most steps over a persistent run and its
own time really exceeds its peers'. Ranks that are culprits together and form a
group of the job's topology (a node, a host, a process group such as a pipeline
stage's) are one label naming the group; unrelated slow ranks get one label each.

A rank that stalls everyone in a minority of steps (a garbage collection, a
checkpoint or an evaluation every N steps) but loses a real share of the run's time is
labelled too, with `pattern` "periodic" (and its period) or "intermittent".

Scores are scale-free: the culprit's own time against the best peers (relative) and
against its own past (individual), as in NVIDIA's resiliency straggler detector.
`impact` is the share of the whole run's time the label cost (its part of each
step's loss, from the ledger).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics import ledger as ledgers
from flare.diagnostics import topology as topologies
from flare.diagnostics.causes import (
    WORK_GREW_FLOOR_MS,
    attribute,
    dating_series,
    host_starved,
    means,
    medians,
    work_grew,
)
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import first_rise, leave_one_out_medians, nanmedian, period, runs

# Members of a group must be slow over the same steps: their runs overlap this much,
# or they begin within GROUP_ONSET_SLACK steps of each other (one episode: on a loaded
# host one member of a slowed pipeline stage stopped arriving last 17 steps before the
# other, and the stage split into two labels, seen).
GROUP_MIN_OVERLAP = 0.6
GROUP_ONSET_SLACK = 3
# An intermittent stall: a step whose loss is at least this share of the median step
# (and NOISE_UNITS of the job's noise), in at least MIN_STALLS steps, costing at least
# straggler_min_impact of the run if periodic, twice that if not.
STALL_MIN_SHARE = 0.25
STALL_NOISE_UNITS = 4.0
# ...and at least this share of the typical one of its STALL_REFERENCE largest losses.
STALL_OF_LARGEST = 0.3
STALL_REFERENCE = 3
MIN_STALLS = 3
MIN_PERIODIC_STALLS = 4
# Inside a persistent run of the same rank, a stall is a loss this many times the run's.
STALL_ABOVE_RUN = 2.0
# ...and each stall lasts this long at least: a loaded host deschedules a rank for a
# scheduler slice or two (a few ms to ~24 ms: CFS's latency target), now and then, on
# any job; a collection, a checkpoint or an evaluation that matters lasts longer.
STALL_MIN_MS = 30.0
# The job's noise is at least this share of its median step.
NOISE_FLOOR_SHARE = 0.02
# Periodic (stats.period): this share of the gaps between stalls within PERIOD_TOLERANCE
# of the median gap, or of the stalls and of the period's steps on one lattice.
PERIODIC_MIN_REGULAR = 0.75
PERIOD_TOLERANCE = 0.15


def min_density(ranks: int) -> float:
    """The share of a run's steps a rank must be the culprit of. Chance makes each of R
    ranks the last to arrive in ~1/R of the steps, so two ranks need 0.7; from three on,
    half is well clear of chance. A CPU-starved rank on a loaded host (its busy thread
    and three other ranks on two cores) arrived last in 61-64 % of its slowed steps,
    its own time slower in nearly all: with 0.7 it went unlabelled, or was labelled 27
    steps late."""
    return 0.7 if ranks <= 2 else 0.5


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    frame = frames.load(job, config)
    if frame is None or len(frame.ranks) < 2:
        return []
    return find(frame, config, lambda: topologies.load(job, frame.ranks.tolist()), ledger(job, frame, config))


def ledger(job: JobData, frame: frames.StepFrame, config: DiagnosisConfig
           ) -> tuple[ledgers.Ledger, np.ndarray]:
    """`prepare`, once per diagnosis where the job data remembers it (the report's time
    table reads the same ledger)."""
    memo = getattr(job, "memo", None)
    build = functools.partial(prepare, frame, config)
    return memo(("ledger", frame.bucket), build) if callable(memo) else build()


def prepare(frame: frames.StepFrame, config: DiagnosisConfig) -> tuple[ledgers.Ledger, np.ndarray]:
    """The job's ledger and each rank's own-time deviation from its step's median."""
    work = frame.work.astype(np.float64)
    deviation = work - nanmedian(work, axis=0)[None, :]
    warm = frames.warm_mask(frame, config)
    noise = ledgers.noise_ms(deviation[:, warm])
    # Floored at a small share of the step: on a quiet stretch the step-to-step noise can
    # read 0.2 ms on a 10 ms step, and then a host that deschedules a rank for a few
    # steps (another process burning a core) passes every noise test.
    typical = nanmedian(frame.duration[:, warm].astype(np.float64)) if warm.any() else math.nan
    if math.isfinite(typical):
        noise = max(noise, NOISE_FLOOR_SHARE * float(typical))
    return ledgers.build(frame, config, noise), deviation


def find(frame: frames.StepFrame, config: DiagnosisConfig,
         topology: Callable[[], topologies.Topology] | None = None,
         prepared: tuple[ledgers.Ledger, np.ndarray] | None = None) -> list[Anomaly]:
    """`topology` gives the job's groups, read only when two ranks or more are slow;
    `prepared` is `prepare(frame, config)` when already made."""
    book, deviation = prepared if prepared is not None else prepare(frame, config)
    if not book.has_wait:
        return []
    persist = max(2, math.ceil(config.straggler_min_steps / frame.bucket))
    density = min_density(len(frame.ranks))
    first_warm = int(np.argmax(book.warm)) if book.warm.any() else 0
    runs_of: dict[int, tuple[np.ndarray, list[tuple[int, int]], np.ndarray]] = {}
    for row in range(len(frame.ranks)):
        mask = book.significant & book.culprits[row]
        if mask.sum() < persist:
            continue
        # Persistence counts the steps the rank was a culprit, not the run's length.
        spans = [(a, b) for a, b in _dense_runs(mask, persist, density)
                 if mask[a:b + 1].sum() >= persist and mask[a:b + 1].mean() >= density]
        if not spans:
            continue
        cols = np.concatenate([_trim(deviation[row], a, b) for a, b in spans])
        cols = cols[cols >= _onset(deviation[row], first_warm, int(cols[0]), int(cols[-1]), persist)]
        runs_of[row] = (mask, spans, cols)

    slow = set(runs_of)
    if topology is not None:
        topology = functools.cache(topology)
    anomalies = []
    made: dict[int, tuple[list[int], np.ndarray, np.ndarray]] = {}  # id(label): rows, mask, cols
    for rows, group in _grouped(frame, runs_of, topology):
        mask = np.logical_or.reduce([runs_of[r][0] for r in rows])
        spans = sorted(s for r in rows for s in runs_of[r][1])
        cols = np.unique(np.concatenate([runs_of[r][2] for r in rows]))
        peers = [r for r in range(len(frame.ranks)) if r not in slow] or \
            [r for r in range(len(frame.ranks)) if r not in rows]
        anomaly = _label(frame, config, book, rows, peers, cols, mask, group)
        # Arriving last by chance (a descheduled process, noise) is not being slower:
        # the rank's own time must really exceed its peers', beyond the job's noise —
        # judged over the run where its own excess is established, before any re-dating.
        # Or its threads burnt more CPU than its peers' by a clear margin: a thread of its
        # own holding the GIL now and then gives the training thread the GIL back late as
        # a step's last collective returns, so its next step begins late and the delay is
        # in no step's time: its median own time can equal its peers' while it arrives
        # last in most steps (loaded host: +0.05 ms median own time, +19.6 ms of
        # other-thread CPU, 8 ms of every step lost by the others).
        relative = anomaly.evidence["relative_score"]
        excess = anomaly.evidence["excess_ms_per_step"]
        # Burnt in most of its steps (the median step), not in a few: a collection every
        # 10 steps raises the mean CPU of every step without making the rank busier in
        # most of them (a periodic GC was read as a persistent straggler from step 3, loaded).
        burnt = anomaly.evidence.get("cpu_burnt_median_delta_ms")
        slower = (relative is not None and relative <= config.straggler_max_relative_score
                  and excess >= config.straggler_min_noise_units * book.noise_ms)
        busier = (anomaly.evidence.get("work_grew", False) and burnt is not None
                  and burnt >= config.straggler_min_noise_units * book.noise_ms)
        if not (slower or busier):
            continue
        # The onset of the named cause is sharper than that of the whole step: place
        # first_step where that component of the rank's step jumped.
        # Searched from where the rank began to arrive last, not from the trimmed start:
        # on a loaded host a busy thread's toll on the step can be patchy for a while
        # after it starts, so the step's own rise dates late (step 32 for a fault from
        # 20, seen), while that thread's CPU jumps the step it starts.
        series = dating_series(frame, anomaly.cause, rows, cols,
                               anomaly.evidence["excess_ms_per_step"], peers=peers)
        if series is not None:
            part = series.astype(np.float64)
            part_deviation = part - nanmedian(part, axis=0)[None, :]
            own = nanmedian(part_deviation[rows], axis=0) if len(rows) > 1 else part_deviation[rows[0]]
            # A busy thread's CPU is the fault itself, not its toll: it dates the start
            # wherever it jumped, though its toll on the others can stay below the
            # culprit density for a while (a GIL holder on a loaded host from step 40:
            # rank 2 last in 28-48 % of steps 40-200, then 65-82 %; dated 200 before).
            direct = anomaly.cause == "cpu" and series is frame.other_cpu
            lowest = first_warm if direct else min(spans[0][0], int(cols[0]))
            start = _onset(own, first_warm, lowest, int(cols[-1]), persist, fallback=int(cols[0]))
            if start != int(cols[0]):
                cols = np.arange(start, int(cols[-1]) + 1)
                anomaly = _label(frame, config, book, rows, peers, cols, mask, group)
        anomaly.evidence["job_noise_ms"] = round(book.noise_ms, 3)
        anomalies.append(anomaly)
        made[id(anomaly)] = (rows, mask, cols)
    hidden = _hidden(frame, config, book, deviation, set(runs_of), anomalies, persist,
                     density, first_warm)
    if hidden and topology is not None:
        anomalies, hidden = _whole_groups(frame, config, book, topology(), slow, anomalies, made, hidden)
    anomalies.extend(a for a, _, _, _ in hidden)
    anomalies.extend(_stalls(frame, config, book, anomalies))
    return anomalies


def _whole_groups(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
                  topology: topologies.Topology, slow: set[int], anomalies: list[Anomaly],
                  made: dict, hidden: list) -> tuple[list[Anomaly], list]:
    """A straggler and the ranks hidden behind it that together make up a group of the
    topology, slowed from the same step (within GROUP_ONSET_SLACK) for the same cause,
    are one label of the group: a pipeline stage whose members slowed unequally on a
    loaded host (rank 2 +62 ms/step, rank 3 +44 ms/step, from step 20, seen) has the job
    wait for the slower member only, and the other was named `hidden behind rank 2`.
    Hidden ranks of another cause or onset keep their own labels (two faults at once)."""
    present = set(frame.ranks.tolist())
    sets = sorted({members for members in topology.groups.values()}, key=len)
    out, used = [], set()
    for anomaly in anomalies:
        if id(anomaly) not in made or anomaly.evidence.get("pattern"):
            out.append(anomaly)
            continue
        mine = set(anomaly.ranks)
        alike = {int(frame.ranks[row]): (h, row, mask, cols) for h, row, mask, cols in hidden
                 if id(h) not in used and h.cause == anomaly.cause
                 and mine <= set(h.evidence["hidden_behind"])
                 and abs(h.first_step - anomaly.first_step) <= GROUP_ONSET_SLACK}
        members = next((m for m in sets if mine < set(m) <= mine | set(alike) and set(m) <= present), None)
        if members is None:
            out.append(anomaly)
            continue
        rows, mask, cols = made[id(anomaly)]
        joined = [alike[r] for r in members if r not in mine]
        rows = sorted([*rows, *(row for _, row, _, _ in joined)])
        mask = np.logical_or.reduce([mask, *(m for _, _, m, _ in joined)])
        cols = np.unique(np.concatenate([cols, *(c for _, _, _, c in joined)]))
        peers = [r for r in range(len(frame.ranks)) if r not in slow and r not in rows] or \
            [r for r in range(len(frame.ranks)) if r not in rows]
        merged = _label(frame, config, book, rows, peers, cols, mask, topology.describe(members))
        merged.evidence["job_noise_ms"] = round(book.noise_ms, 3)
        out.append(merged)
        used |= {id(h) for h, _, _, _ in joined}
    return out, [entry for entry in hidden if id(entry[0]) not in used]


def _hidden(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
            deviation: np.ndarray, slow: set[int], labelled: list[Anomaly], persist: int,
            density: float, first_warm: int) -> list[tuple[Anomaly, int, np.ndarray, np.ndarray]]:
    """Ranks whose own time exceeds their healthy peers' over a lasting stretch in which
    a slower rank's label already stands: the job waits for the slower one first, so
    the ledger gives them no loss and no culprit step — but fixing the slower rank
    alone leaves the job waiting for them. Two faults at once (rank 1's compute +40
    ms/step behind rank 2's garbage collection +70 ms, seen): rank 1 went unnamed in
    3 of 4 runs. It must have become slower than its own past as well (the peers of a
    pipeline's ranks do other work by design). Each such rank is a straggler of its own, over the healthy peers,
    with `hidden_behind` the ranks it hides behind and impact 0 (it has cost nothing
    yet); `would_cost` is the share of the run its excess would take. Each with its row,
    its mask of steps in excess and its columns."""
    lasting = [a for a in labelled if not a.evidence.get("pattern") and not a.evidence.get("host_starved")
               and a.first_step is not None and a.last_step is not None]
    healthy = [r for r in range(len(frame.ranks)) if r not in slow]
    if not lasting or len(healthy) < 3:  # the candidate and two healthy peers at least
        return []
    work = frame.work.astype(np.float64)
    # each healthy rank against the others (one sort, not one median per rank)
    others = leave_one_out_medians(work[healthy])
    threshold = config.straggler_min_noise_units * book.noise_ms
    found = []
    for index, row in enumerate(healthy):
        excess = work[row] - others[index]
        mask = book.warm & (np.nan_to_num(excess, nan=-np.inf) >= threshold)
        if mask.sum() < persist:
            continue
        peers = [r for r in healthy if r != row]
        spans = [(a, b) for a, b in _dense_runs(mask, persist, density)
                 if mask[a:b + 1].sum() >= persist and mask[a:b + 1].mean() >= density]
        if not spans:
            continue
        cols = np.concatenate([_trim(excess, a, b) for a, b in spans])
        cols = cols[cols >= _onset(excess, first_warm, int(cols[0]), int(cols[-1]), persist)]
        first, last = frame.step_of(int(cols[0])), frame.last_step_of(int(cols[-1]))
        behind = [a for a in lasting if a.first_step <= last and first <= a.last_step]
        if not behind:
            continue
        anomaly = _label(frame, config, book, [row], peers, cols, mask, None)
        ev = anomaly.evidence
        relative, individual = ev["relative_score"], ev["individual_score"]
        if not (relative is not None and relative <= config.straggler_max_relative_score
                and ev["excess_ms_per_step"] >= threshold and ev["work_grew"]
                and not ev.get("host_starved")):
            continue  # slower without doing more: a victim of the host, not a culprit
        if not (individual is not None and individual <= config.straggler_max_relative_score):
            # Slower than its own past too: a rank whose work differs by design (a
            # pipeline's last stage computes the loss) is that way from the start.
            continue
        hides = sorted({r for a in behind for r in a.ranks})
        would = ev["excess_ms_per_step"] * frame.step_count(cols) / max(book.run_ms, 1e-9)
        ev.update(hidden_behind=hides, would_cost=round(would, 4), job_noise_ms=round(book.noise_ms, 3))
        them = f"rank {hides[0]}" if len(hides) == 1 else f"ranks {','.join(map(str, hides))}"
        cause = _cause_text(anomaly.cause, ev["other_threads_cpu_delta_ms"] or math.nan)
        anomaly.impact = 0.0
        anomaly.summary = (
            f"rank {int(frame.ranks[row])} is slower than its healthy peers from step {first} to "
            f"{last}: {cause} (+{ev['excess_ms_per_step']:.1f} ms/step), hidden behind {them}, "
            f"whom the job waits for first; with {them} fixed it would cost ~{would:.0%} of the "
            "run's time")
        found.append((anomaly, row, mask, cols))
    return found


def _grouped(frame: frames.StepFrame, runs_of: dict,
             read_topology: Callable[[], topologies.Topology] | None):
    """The labels to make: a group of the topology whose members are all persistent
    culprits, slow over the same steps, is one label; every other rank its own."""
    done: set[int] = set()
    out: list[tuple[list[int], str | None]] = []
    if read_topology is not None and len(runs_of) >= 2:
        topology = read_topology()
        sets = sorted({members for members in topology.groups.values()}, key=len)
        for members in sets:
            rows = [frame.row(r) for r in members if r in set(frame.ranks.tolist())]
            if len(rows) != len(members) or not all(r in runs_of for r in rows) or done & set(rows):
                continue
            # Their runs must cover the same steps: on a loaded host two slowed ranks of
            # one node take turns arriving last (24 of 47 culprit steps together, seen),
            # but each is slow over the same stretch.
            spans = [set(runs_of[r][2].tolist()) for r in rows]
            together = len(set.intersection(*spans))
            either = len(set.union(*spans))
            starts = [int(frame.steps[int(runs_of[r][2][0])]) for r in rows]
            if either and (together >= GROUP_MIN_OVERLAP * either
                           or (together and max(starts) - min(starts) <= GROUP_ONSET_SLACK)):
                out.append((sorted(rows), topology.describe(members)))
                done |= set(rows)
    out.extend(([row], None) for row in sorted(runs_of) if row not in done)
    return out


def _dense_runs(mask: np.ndarray, max_join: int, density: float) -> list[tuple[int, int]]:
    """The culprit's runs (gaps of up to 2 steps bridged), neighbours joined while the
    joined run stays dense. On a loaded host a CPU-starved rank is still the last to
    arrive in most steps, but another rank's hiccup takes a few of them: bridging only
    2-step gaps split one 40-step fault into runs each too short or too sparse to count
    (no straggler at all in one CI run, a 13-step late onset in others). A join spans at
    most `max_join` steps of gap, so two separate episodes stay two labels."""
    joined: list[tuple[int, int]] = []
    for a, b in runs(mask, max_gap=2):
        if joined:
            first, last = joined[-1]
            if a - last - 1 <= max_join and mask[first:b + 1].mean() >= density:
                joined[-1] = (first, b)
                continue
        joined.append((a, b))
    return joined


def _trim(deviation: np.ndarray, first: int, last: int) -> np.ndarray:
    """The run's columns, without leading/trailing steps where the rank was not yet (or
    no longer) clearly slower — so first_step is the onset, not a noisy lead-in."""
    values = deviation[first:last + 1]
    level = 0.5 * float(np.nanmedian(values)) if np.isfinite(values).any() else 0.0
    strong = np.flatnonzero(np.nan_to_num(values, nan=-np.inf) >= level)
    if level <= 0 or strong.size == 0:
        return np.arange(first, last + 1)
    return np.arange(first + int(strong[0]), first + int(strong[-1]) + 1)


def _onset(deviation: np.ndarray, first_warm: int, first: int, last: int, persist: int,
           fallback: int | None = None) -> int:
    """Where the rank's own excess really began: the change point of its deviation from
    the step median, from warm-up to the end of the run. Being the last to arrive can
    start early by chance (one slow step bridging into the run); the level shift of the
    rank's own time cannot. Falls back to `fallback`, by default the run's start."""
    fallback = first if fallback is None else fallback
    level = float(np.nanmedian(deviation[first:last + 1]))
    if not level > 0:
        return fallback
    rise = first_rise(deviation[first_warm:last + 1], persist, 0.25 * level)
    if rise is None:
        return fallback
    start = first_warm + rise
    return start if first - 3 <= start <= last else fallback


def _label(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
           rows: list[int], peers: list[int], cols: np.ndarray, mask: np.ndarray,
           group: str | None, pattern: dict | None = None) -> Anomaly:
    ranks = [int(frame.ranks[r]) for r in rows]
    mine, my_work = medians(frame, rows, cols)
    theirs, their_work = medians(frame, peers, cols)
    my_means, their_means = means(frame, rows, cols), means(frame, peers, cols)
    why = attribute(mine, theirs, config.cause_min_share, my_work, their_work,
                    my_means, their_means)
    lost_per_step = book.lost_by(rows, cols) / max(1, frame.step_count(cols[mask[cols]]))
    burnt_median = _median_burnt(frame, rows, peers, cols)

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
    cause_text = _cause_text(why.cause, other_cpu_delta)
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


def _cause_text(cause: str, other_cpu_delta: float) -> str:
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


def _median_burnt(frame: frames.StepFrame, rows: list[int], peers: list[int], cols: np.ndarray) -> float | None:
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


def _stalls(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
            persistent: list[Anomaly]) -> list[Anomaly]:
    """Ranks that stall everyone in a minority of steps but cost a real share of the run."""
    big = book.significant & (book.lost_ms >= np.maximum.reduce([
        STALL_MIN_SHARE * book.step_ms, np.full_like(book.step_ms, STALL_NOISE_UNITS * book.noise_ms),
        np.full_like(book.step_ms, STALL_MIN_MS)]))
    out = []
    for row in range(len(frame.ranks)):
        rank = int(frame.ranks[row])
        stalls = big & book.culprits[row]
        if stalls.any():
            # The stalls are what stands out among this rank's losses: on short steps
            # ordinary jitter also clears the thresholds above (8 ms lost of a 15 ms
            # step, beside 130 ms collections) and would break the period.
            top = np.sort(book.lost_ms[stalls])[-STALL_REFERENCE:]
            stalls &= book.lost_ms >= STALL_OF_LARGEST * float(np.median(top))
        for anomaly in persistent:
            if rank in anomaly.ranks:
                # Inside the rank's persistent run its every step is a loss: only a step
                # that stands out above the run's own level is a stall there too (a GC
                # every 10 steps stays periodic across a stretch where the rank was slow).
                lo, hi = frame.column(anomaly.first_step), frame.column(anomaly.last_step)
                level = float(np.median(book.lost_ms[lo:hi + 1]))
                inside = stalls[lo:hi + 1]
                stalls[lo:hi + 1] = inside & (book.lost_ms[lo:hi + 1] >= STALL_ABOVE_RUN * level)
        cols = np.flatnonzero(stalls)
        if cols.size < MIN_STALLS:
            continue
        pattern, on = _pattern(frame.steps[cols])
        if pattern["pattern"] == "periodic":
            # a step off the period is another loss of the rank's (a loaded host's
            # hiccup), not one of these stalls
            stalls[cols[~on]] = False
            cols = cols[on]
            cols = _settling_stalls(frame, config, book, row, cols, pattern["period_steps"])
            stalls[cols] = True
        impact = book.impact([row], cols)
        needed = config.straggler_min_impact * (1 if pattern["pattern"] == "periodic" else 2)
        if impact < needed or (pattern["pattern"] == "periodic" and cols.size < MIN_PERIODIC_STALLS):
            continue
        peers = [r for r in range(len(frame.ranks)) if r != row]
        pattern["stall_ms"] = float(np.median(book.lost_ms[cols]))
        pattern["stall_steps"] = [int(s) for s in frame.steps[cols][:50]]
        anomaly = _label(frame, config, book, [row], peers, cols, stalls, None, pattern)
        if anomaly.evidence["excess_ms_per_step"] < STALL_NOISE_UNITS * book.noise_ms:
            continue
        anomaly.evidence["job_noise_ms"] = round(book.noise_ms, 3)
        # A stall step's whole excess over the job's typical step is the stall's: what
        # the job's own step times say it cost. (The wait-based loss under-reads it on a
        # loaded host, where the victims are late themselves now and then: 0.25 against
        # 0.35 measured, seen.)
        typical = float(np.nanmedian(book.step_ms[book.warm])) if book.warm.any() else 0.0
        whole = float(np.sum(np.clip(book.step_ms[cols] - typical, 0, None) * book.steps[cols]))
        anomaly.evidence["lost_s"] = round(whole / 1e3, 3)
        anomaly.impact = min(1.0, whole / book.run_ms) if book.run_ms > 0 else 0.0
        anomaly.summary = anomaly.summary.rsplit("; ", 1)[0] + f"; {anomaly.impact:.0%} of the run's time"
        anomaly.confidence = min(0.99, 0.5 + 0.5 * min(1.0, cols.size / 8)) * (
            1.0 if anomaly.cause != "unknown" else 0.8)
        out.append(anomaly)
    return out


def _settling_stalls(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
                     row: int, cols: np.ndarray, period: int) -> np.ndarray:
    """A periodic stall's first occurrences inside the job's settling steps (past the
    fixed warm-up, but slow enough that the ledger leaves them out of its baselines): a
    step one period before the first stall found, where the same rank held everyone up
    by as much as its stalls do, is a stall of the pattern too, and the label's onset is
    there (a checkpoint every 8 steps from step 8, on a job still settling until step 11,
    read from step 16 otherwise)."""
    threshold = STALL_OF_LARGEST * float(np.median(np.sort(book.lost_ms[cols])[-STALL_REFERENCE:]))
    first_allowed = frame.steps[0] + config.warmup_steps
    earlier = []
    step = int(frame.steps[cols[0]]) - period
    while step >= first_allowed:
        col = frame.column(step)
        if (int(frame.steps[col]) != step or book.warm[col] or not book.culprits[row, col]
                or not book.lost_ms[col] >= threshold):
            break
        earlier.append(col)
        step -= period
    return np.concatenate([np.asarray(earlier[::-1], dtype=cols.dtype), cols]) if earlier else cols


def _pattern(steps: np.ndarray) -> tuple[dict, np.ndarray]:
    """Periodic (with its period in steps) when the stalls keep one (stats.period), and
    which of them keep it; intermittent otherwise."""
    every, on = period(steps, MIN_PERIODIC_STALLS, PERIOD_TOLERANCE, PERIODIC_MIN_REGULAR)
    if every is None:
        return {"pattern": "intermittent"}, np.ones(np.shape(steps), dtype=bool)
    return {"pattern": "periodic", "period_steps": every}, on
