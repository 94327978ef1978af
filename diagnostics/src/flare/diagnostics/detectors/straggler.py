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
from flare.diagnostics import stalls
from flare.diagnostics import topology as topologies
from flare.diagnostics.causes import dating_series
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import first_rise, leave_one_out_medians, nanmedian, runs
from flare.diagnostics.straggler_label import describe_cause, label

# Members of a group must be slow over the same steps: their runs overlap this much,
# or they begin within GROUP_ONSET_SLACK steps of each other (one episode: on a loaded
# host one member of a slowed pipeline stage stopped arriving last 17 steps before the
# other, and the stage split into two labels, seen).
GROUP_MIN_OVERLAP = 0.6
GROUP_ONSET_SLACK = 3
# The job's noise is at least this share of its median step.
NOISE_FLOOR_SHARE = 0.02


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
        if not spans or _a_hiccup(frame, config, spans):
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
        anomaly = label(frame, config, book, rows, peers, cols, mask, group)
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
                anomaly = label(frame, config, book, rows, peers, cols, mask, group)
        anomaly.evidence["job_noise_ms"] = round(book.noise_ms, 3)
        anomalies.append(anomaly)
        made[id(anomaly)] = (rows, mask, cols)
    hidden = _hidden(frame, config, book, deviation, set(runs_of), anomalies, persist,
                     density, first_warm)
    if hidden and topology is not None:
        anomalies, hidden = _whole_groups(frame, config, book, topology(), slow, anomalies, made, hidden)
    anomalies.extend(a for a, _, _, _ in hidden)
    anomalies.extend(stalls.find(frame, config, book, anomalies))
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
        merged = label(frame, config, book, rows, peers, cols, mask, topology.describe(members))
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
        if not spans or _a_hiccup(frame, config, spans):
            continue
        cols = np.concatenate([_trim(excess, a, b) for a, b in spans])
        cols = cols[cols >= _onset(excess, first_warm, int(cols[0]), int(cols[-1]), persist)]
        first, last = frame.step_of(int(cols[0])), frame.last_step_of(int(cols[-1]))
        behind = [a for a in lasting if a.first_step <= last and first <= a.last_step]
        if not behind:
            continue
        anomaly = label(frame, config, book, [row], peers, cols, mask, None)
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
        cause = describe_cause(anomaly.cause, ev["other_threads_cpu_delta_ms"] or math.nan)
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


def _a_hiccup(frame: frames.StepFrame, config: DiagnosisConfig, spans: list[tuple[int, int]]) -> bool:
    """Whether a rank's runs, together, last under `min_persist_s` of the job's time in
    a job diagnosed as it is stored (not a live pass): a host's hiccup (a healthy 2-rank
    job of 5-ms steps read "straggler [0] compute" over its last 10 steps, 0.05 s in
    all). A live pass keeps them: a straggler that began in the last second may be the
    start of a lasting one, and held back there its first seconds read as the rank's
    stalls and the lasting label was never said (config.live)."""
    if config.live:
        return False
    return sum(frame.wall_ms(np.arange(a, b + 1)) for a, b in spans) < config.min_persist_s * 1e3


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


