"""Naming the cause of excess time from the step breakdown.

A rank's own step time splits into dataloader, compute, gc and Python hot calls
(collective wait is time spent on *other* ranks). When a rank's time grows, the
component that grew names the cause — if it explains at least `cause_min_share` of
the growth (TraceML's rule). One pattern is special: a GIL-holding thread slows
*every* Python-side part of the rank at once, so when several unrelated components
all inflate by a large factor the cause is `cpu`, not any one of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flare.diagnostics.frame import COMPONENT_CAUSE, StepFrame
from flare.diagnostics.stats import nanmedian

# A component counts as inflated when it grew by this factor and by a visible amount.
_INFLATION_RATIO = 1.5
_INFLATION_MIN_SHARE = 0.1


@dataclasses.dataclass
class Attribution:
    cause: str
    share: float  # of the excess explained by the named component(s)
    excess_ms: float
    deltas_ms: dict[str, float]
    ratios: dict[str, float]


def attribute(subject: dict[str, float], reference: dict[str, float], min_share: float,
              subject_work: float, reference_work: float) -> Attribution:
    """Compare the subject's per-component medians to a reference's (peers or past)."""
    excess = subject_work - reference_work
    deltas = {k: subject[k] - reference[k] for k in subject}
    ratios = {k: (subject[k] + 1.0) / (reference[k] + 1.0) for k in subject}
    if excess <= 0:
        return Attribution("unknown", 0.0, excess, deltas, ratios)
    inflated = [k for k in ("dataloader", "compute", "pycall")
                if ratios[k] >= _INFLATION_RATIO and deltas[k] >= _INFLATION_MIN_SHARE * excess]
    if len(inflated) >= 2:
        share = sum(deltas[k] for k in inflated) / excess
        return Attribution("cpu", min(share, 1.0), excess, deltas, ratios)
    top = max(deltas, key=lambda k: deltas[k])
    share = deltas[top] / excess
    cause = COMPONENT_CAUSE[top] if share >= min_share else "unknown"
    return Attribution(cause, min(share, 1.0), excess, deltas, ratios)


def medians(frame: StepFrame, rows: np.ndarray | list[int], cols: np.ndarray | slice) -> tuple[dict[str, float], float]:
    """Per-component medians of `rows` over `cols` (median across the rows per step first)."""
    def med(matrix: np.ndarray) -> float:
        block = matrix[np.asarray(rows)][:, cols]
        value = nanmedian(nanmedian(block, axis=0))
        return 0.0 if np.isnan(value) else float(value)

    parts = {name: med(matrix) for name, matrix in frame.parts.items()}
    return parts, med(frame.work)
