"""Ranks that stall everyone in a minority of steps (a garbage collection, a checkpoint
or an evaluation every N steps) but lose a real share of the run's time: straggler
labels with `pattern` "periodic" (and its period) or "intermittent"."""

from __future__ import annotations

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics import ledger as ledgers
from flare.diagnostics.model import Anomaly, DiagnosisConfig
from flare.diagnostics.stats import period
from flare.diagnostics.straggler_label import label

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
# Periodic (stats.period): this share of the gaps between stalls within PERIOD_TOLERANCE
# of the median gap, or of the stalls and of the period's steps on one lattice.
PERIODIC_MIN_REGULAR = 0.75
PERIOD_TOLERANCE = 0.15


def find(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger,
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
        anomaly = label(frame, config, book, [row], peers, cols, stalls, None, pattern)
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
