"""Shared rule for 'one component eats a share of the step' labels (input, gc)."""

from __future__ import annotations

import math

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics import ledger as ledgers
from flare.diagnostics.model import Anomaly, DiagnosisConfig
from flare.diagnostics.stats import nanmedian, runs

# A component stalls a step when it takes this share of the job's median step...
_MIN_SHARE = 0.10
# ...and is this many times the rank's usual (or the job's usual) value for it.
_MIN_RATIO = 3.0
_MIN_DENSITY = 0.8


def share_anomalies(frame: frames.StepFrame, config: DiagnosisConfig, book: ledgers.Ledger | None,
                    component: str, kind: str, cause: str, what: str) -> list[Anomaly]:
    """With the job's ledger (`book`, two ranks or more that wait for each other), a
    stall of some of the ranks is labelled only where it cost the job time: those ranks
    were the ones the others waited for in its steps, for at least
    `straggler_min_impact` of the run, which is then its impact. A rank whose loader or
    collections are slow while it waits anyway (for a straggler, on a busy host whose
    workers lag now and then: 8 ms of a 60 ms step on healthy ranks of a loaded host)
    slows nothing. Every rank stalling together, or no waits to tell, keeps the share."""
    values = frame.parts[component].astype(np.float64)
    warm = frames.warm_mask(frame, config)
    if not warm.any():
        return []
    step_ms = nanmedian(frame.duration.astype(np.float64), axis=0)
    # "Usual" = the low quartile over the whole job, so a stall that lasts most of the
    # run still stands out against the job's healthy steps and ranks.
    usual = float(np.nanpercentile(values[:, warm], 25)) if np.isfinite(values[:, warm]).any() else 0.0
    floor = max(usual, 0.5)
    stalled = (values >= _MIN_SHARE * step_ms[None, :]) & (values >= _MIN_RATIO * floor) & warm[None, :]
    # A symptom label needs twice the usual persistence, counted in stalled steps:
    # on a busy host any rank's loader has bursts of several slow fetches.
    persist = max(2, math.ceil(2 * config.min_persist_steps / frame.bucket))
    per_rank: dict[int, list[tuple[int, int]]] = {}
    for row in range(len(frame.ranks)):
        spans = [(a, b) for a, b in runs(stalled[row], max_gap=2)
                 if stalled[row, a:b + 1].sum() >= persist and stalled[row, a:b + 1].mean() >= _MIN_DENSITY]
        if spans:
            per_rank[int(frame.ranks[row])] = spans
    if not per_rank:
        return []
    # Ranks that stall over the same steps are one problem (e.g. a shared slow filesystem).
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, spans in per_rank.items():
        groups.setdefault((spans[0][0], spans[-1][1]), []).append(rank)
    anomalies = []
    for (first_col, last_col), ranks in groups.items():
        rows = [frame.row(r) for r in ranks]
        cols = np.arange(first_col, last_col + 1)
        ms = float(nanmedian(values[np.ix_(rows, cols)]))
        share = float(np.mean(np.nan_to_num(values[np.ix_(rows, cols)]) / step_ms[None, cols]))
        density = float(stalled[np.ix_(rows, cols)].mean())
        first, last = frame.step_of(first_col), frame.last_step_of(last_col)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        impact = min(share, 1.0)
        evidence = {f"{component}_ms_median": round(ms, 3), "usual_ms": round(usual, 3),
                    "share_of_step": round(share, 4), "stalled_share": round(density, 3)}
        if book is not None and book.has_wait and len(ranks) < len(frame.ranks):
            impact = book.impact(rows, cols)
            if impact < config.straggler_min_impact:
                continue
            evidence["lost_s"] = round(book.lost_by(rows, cols) / 1e3, 3)
        anomalies.append(Anomaly(
            kind=kind, ranks=ranks, cause=cause, first_step=first, last_step=last,
            impact=impact, confidence=min(0.99, density),
            summary=f"{who} {what} {ms:.1f} ms per step ({share:.0%} of the step) "
                    f"from step {first} to {last}",
            evidence=evidence,
        ))
    return anomalies
