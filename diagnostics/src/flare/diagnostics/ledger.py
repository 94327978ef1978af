"""The time-lost ledger: for every step, how much time the job lost and to whom.

A collective makes every rank wait for the last one to arrive, so a step lasts as
long as its slowest rank's own work. What the step *lost* is how much longer the
typical victim waited than the last arrival did (median wait of the ranks outside the
culprit set − least wait): the time the job would have saved had the slowest ranks
been as quick as the typical one.

The *culprit set* of a step is every rank that arrived within the job's noise of the
last one (least wait + tolerance), not the single argmin: two ranks of a slow
pipeline stage or node arrive together, and whichever is a hair later must not make
the other a victim. A step whose culprits are more than half the ranks has no
culprit (the "victims" would be the minority: nobody in particular is slow). The
step's loss is shared equally by its culprits.

Every rank-level detector reads it: a persistent straggler is a rank (or a group)
that is in the culprit set of most steps of a run; an intermittent or periodic stall
is one that is in it for a minority of steps but loses a real share of the run's time;
`impact` is seconds lost over seconds run, for the whole run.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flare.diagnostics.frame import PHASES, StepFrame, warm_mask
from flare.diagnostics.model import DiagnosisConfig
from flare.diagnostics.stats import mad, nanmedian, period

# A rank is in a step's culprit set when it arrived within this share of the step's
# loss of the last arrival (or within NOISE_UNITS of the job's noise, if more).
CULPRIT_TOLERANCE = 0.3
NOISE_UNITS = 2.0


@dataclasses.dataclass
class Ledger:
    lost_ms: np.ndarray  # (S,) per column (mean over its steps): median wait − least wait
    step_ms: np.ndarray  # (S,) median step duration per column
    steps: np.ndarray  # (S,) real steps in each column (1 unless the job is bucketed)
    culprits: np.ndarray  # (R, S) bool: the rank arrived within tolerance of the last
    significant: np.ndarray  # (S,) bool: warm, and the loss is a real share of the step
    warm: np.ndarray  # (S,) bool: past the warm-up steps
    noise_ms: float  # the job's rank-to-rank noise of own time (see noise_ms below)
    has_wait: bool  # any wait reported at all (an import may have none)

    @property
    def run_ms(self) -> float:
        """The run's wall time, from the step durations (every column, warm-up too)."""
        return float(np.nansum(np.nan_to_num(self.step_ms) * self.steps))

    def share(self) -> np.ndarray:
        """Per column, the share of the step that was lost."""
        return np.where(self.step_ms > 0, self.lost_ms / np.where(self.step_ms > 0, self.step_ms, 1), 0.0)

    def lost_by(self, rows: list[int] | np.ndarray, cols: np.ndarray | None = None) -> float:
        """ms the job lost to these ranks (their part of each step's loss) over `cols`."""
        culprits = self.culprits[:, cols] if cols is not None else self.culprits
        lost = self.lost_ms[cols] if cols is not None else self.lost_ms
        steps = self.steps[cols] if cols is not None else self.steps
        size = culprits.sum(axis=0)
        mine = culprits[np.asarray(rows)].sum(axis=0)
        part = np.where(size > 0, mine / np.maximum(size, 1), 0.0)
        return float(np.sum(part * lost * steps))

    def impact(self, rows: list[int] | np.ndarray, cols: np.ndarray | None = None) -> float:
        """Share of the whole run's time these ranks cost (over `cols`)."""
        run = self.run_ms
        return min(1.0, self.lost_by(rows, cols) / run) if run > 0 else 0.0


def build(frame: StepFrame, config: DiagnosisConfig, noise_ms: float) -> Ledger:
    wait = frame.wait.astype(np.float64)
    duration = frame.duration.astype(np.float64)
    step_ms = np.nan_to_num(nanmedian(duration, axis=0))
    filled = np.where(np.isnan(wait), np.inf, wait)
    least = filled.min(axis=0)
    has_wait = bool(np.isfinite(wait).any())
    # A first estimate over every rank places the culprit set; the loss is then the
    # victims' typical wait (with two culprits of four, the median of all four would be
    # halfway between them and their victims).
    first = np.clip(np.nan_to_num(np.where(np.isfinite(least), nanmedian(wait, axis=0) - least, 0.0)),
                    0.0, None)
    tolerance = np.maximum(CULPRIT_TOLERANCE * first, NOISE_UNITS * noise_ms)
    culprits = np.isfinite(filled) & (filled <= (least + tolerance)[None, :])
    victims = np.where(culprits, np.nan, wait)
    lost = np.where(np.isfinite(least) & np.isfinite(victims).any(axis=0),
                    nanmedian(victims, axis=0) - least, 0.0)
    lost = np.clip(np.nan_to_num(lost), 0.0, None)
    ranks = len(frame.ranks)
    crowded = culprits.sum(axis=0) > ranks / 2
    culprits[:, crowded] = False
    warm = warm_mask(frame, config)
    share = np.where(step_ms > 0, lost / np.where(step_ms > 0, step_ms, 1), 0.0)
    significant = warm & ~crowded & (share >= config.straggler_min_impact) & (lost > 0)
    steps = _steps_per_column(frame)
    return Ledger(lost, step_ms, steps, culprits, significant, warm, float(noise_ms), has_wait)


def _steps_per_column(frame: StepFrame) -> np.ndarray:
    counts = getattr(frame, "step_counts", None)
    if counts is not None:
        return np.asarray(counts, dtype=np.float64)
    return np.full(len(frame.steps), float(frame.bucket))


def noise_ms(deviation: np.ndarray) -> float:
    """The job's rank-to-rank noise: how much each rank's own time around its step's
    median moves from one step to the next (MAD of the step-to-step changes, scaled to
    one step's deviation). A lasting difference does not move it: a slow rank, two of
    four, or a slow group would otherwise count as noise themselves (with two slow
    ranks of four the median sits halfway and every rank deviates by half the excess)."""
    if deviation.shape[1] < 3:
        return mad(deviation)
    changes = np.diff(deviation, axis=1)
    changes = changes[np.isfinite(changes)]
    if changes.size < 3:
        return mad(deviation)
    return mad(changes) / math.sqrt(2)


def where_the_time_went(ledger: Ledger, labels: list, cells=None,
                        phases: list[dict] | None = None) -> list[dict]:
    """Rows of the report's closing table: each rank-level label's seconds and share
    of the run, the framework phases every rank ran (`phases`, from `phase_time`: time
    spent, not lost to a culprit), then what no label explains.

    One count of each lost second: with `cells(label)` → (rows, columns) of the frame, a
    straggler label is credited with its ranks' part of each step's loss in its steps;
    where labels share a cell (a rank's slowdown and its periodic stalls, a rank and its
    group) the cell is split between them by what each says it adds per step (its
    excess, or its stall), so the table never adds up past what was lost.

    A hang's row is the time the job has been stuck (its `elapsed_s`): the run's time is
    then the finished steps' and the stuck time together, and every share is of that."""
    hung_s = max((float(a.evidence.get("elapsed_s") or 0.0) for a in labels if a.kind == "hang"), default=0.0)
    run_ms = ledger.run_ms + hung_s * 1e3
    rows = []
    credited: dict[int, float] = {}
    located = [(a, cells(a)) for a in labels if cells is not None and a.kind == "straggler"]
    located = [(a, where) for a, where in located if where is not None]
    if located:
        size = np.maximum(ledger.culprits.sum(axis=0), 1)
        cell_ms = np.where(ledger.culprits, (ledger.lost_ms * ledger.steps / size)[None, :], 0.0)
        masks, weights = [], []
        for anomaly, (at_rows, at_cols) in located:
            mask = np.zeros_like(ledger.culprits)
            mask[np.ix_(np.asarray(at_rows), np.asarray(at_cols))] = True
            ev = anomaly.evidence
            masks.append(mask & ledger.culprits)
            weights.append(max(float(ev.get("stall_ms") or ev.get("excess_ms_per_step") or 0.0), 1e-6))
        claims = sum(m * w for m, w in zip(masks, weights, strict=True))  # weight per cell
        for (anomaly, _), mask, weight in zip(located, masks, weights, strict=True):
            share = np.where(mask, weight / np.where(claims > 0, claims, 1.0), 0.0)
            credited[id(anomaly)] = float(np.sum(share * cell_ms)) / 1e3
    for anomaly in labels:
        lost = credited.get(id(anomaly), anomaly.evidence.get("lost_s"))
        if anomaly.kind == "hang":
            lost = anomaly.evidence.get("elapsed_s")
        if lost is None:
            continue
        who = anomaly.evidence.get("group") or (
            "all ranks" if not anomaly.ranks else ("rank " if len(anomaly.ranks) == 1 else "ranks ")
            + ",".join(map(str, anomaly.ranks)))
        if anomaly.evidence.get("pattern"):
            who += f" ({anomaly.evidence['pattern']})"
        cause = "host CPU" if anomaly.evidence.get("host_starved") else anomaly.cause
        if anomaly.kind == "hang":
            cause = f"hang ({anomaly.cause})"
        rows.append({"who": who, "cause": cause, "kind": anomaly.kind,
                     "seconds": round(float(lost), 3),
                     "share": round(float(lost) * 1e3 / run_ms, 4) if run_ms > 0 else 0.0})
    for phase in phases or ():
        every = f"every {phase['period_steps']} steps" if phase.get("period_steps") else (
            f"{phase['steps']} time{'s' if phase['steps'] != 1 else ''}")
        rows.append({"who": f"all ranks ({every})", "cause": phase["phase"], "kind": "phase",
                     "seconds": round(phase["seconds"], 3),
                     "share": round(phase["seconds"] * 1e3 / run_ms, 4) if run_ms > 0 else 0.0})
    total = float(np.sum(ledger.lost_ms * ledger.steps))
    explained = sum(r["seconds"] for r in rows if r["kind"] == "straggler") * 1e3
    rest = max(0.0, total - explained)
    if rows or rest > 0:
        rows.append({"who": "no label (noise, short stalls)", "cause": "-", "kind": "-",
                     "seconds": round(rest / 1e3, 3),
                     "share": round(rest / run_ms, 4) if run_ms > 0 else 0.0})
    return rows


# A framework phase every rank ran is listed once it holds this share of the run, and a
# step holds it when the median rank spent this long in it.
PHASE_MIN_SHARE = 0.005
PHASE_MIN_MS = 1.0


def phase_time(frame: StepFrame, run_ms: float) -> list[dict]:
    """The framework's phases (an evaluation every N steps, a checkpoint every M) that
    the job's ranks ran alike: the median rank's time in each, summed over the run. A
    phase of one rank that held the others up is a straggler label instead; one all
    ranks run is time spent, never a label, and is listed here."""
    out = []
    for name in PHASES:
        matrix = frame.parts.get(name)
        if matrix is None:
            continue
        per_step = nanmedian(np.nan_to_num(matrix.astype(np.float64)), axis=0)
        held = per_step >= PHASE_MIN_MS
        counts = frame.step_counts if frame.step_counts is not None else np.full(
            per_step.shape, float(frame.bucket))
        seconds = float(np.sum(per_step[held] * counts[held])) / 1e3
        if not held.any() or run_ms <= 0 or seconds * 1e3 < PHASE_MIN_SHARE * run_ms:
            continue
        every, _ = period(frame.steps[held], 3)
        out.append({"phase": name, "seconds": seconds, "steps": int(held.sum()),
                    "period_steps": every})
    return out
