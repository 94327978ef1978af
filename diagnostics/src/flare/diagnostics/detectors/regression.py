"""Regression: this job against a baseline job (`--baseline-job`), naming what grew.

Steady-state medians (after warm-up) of the step time and of each part of it —
data loading, compute, GC, Python hot calls, collective wait and bytes moved — are
compared; a step time at least `fail_slow_min_shift` above the baseline's is a
regression, and the parts that account for the growth are named.
"""

from __future__ import annotations

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.frame import COMPONENT_CAUSE
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.diagnostics.stats import nanmedian

_NAMES = {"dataloader": "data loading", "compute": "compute", "gc": "garbage collection",
          "pycall": "Python hot calls", "wait": "communication (collective wait)"}


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    if config.baseline is None:
        return []
    now = frames.load(job, config)
    then = frames.load(config.baseline, config)
    if now is None or then is None:
        return []
    current, base = _profile(now, config), _profile(then, config)
    step_now, step_then = current.pop("step"), base.pop("step")
    bytes_now, bytes_then = current.pop("bytes"), base.pop("bytes")
    if step_then <= 0:
        return []
    deltas = {k: current[k] - base[k] for k in current}
    moves_more = bytes_now > 1.1 * bytes_then + 1024
    # Communication that grew with the bytes moved is a regression even when noise in
    # the other parts (a busier host during the baseline) hides it in the step total.
    comm_grew = moves_more and deltas["wait"] >= config.fail_slow_min_shift * step_then
    if step_now / step_then - 1 < config.fail_slow_min_shift and not comm_grew:
        return []
    excess = max(step_now - step_then, deltas["wait"] if comm_grew else 0.0)
    grew = sorted((k for k in deltas if deltas[k] >= 0.2 * excess), key=lambda k: -deltas[k])
    top = grew[0] if grew else None
    cause = COMPONENT_CAUSE[top] if top and deltas[top] >= config.cause_min_share * excess else "unknown"
    if moves_more and top == "wait":
        # More bytes per step and more time in collectives: the job communicates more,
        # whatever share step-to-step noise leaves to the other parts.
        cause = "communication"
    parts = ", ".join(f"{_NAMES[k]} +{deltas[k]:.1f} ms" for k in grew) or "no single part"
    more_bytes = ""
    if moves_more:
        more_bytes = f"; {(bytes_now - bytes_then) / 1e6:.1f} MB more moved by collectives per step"
    shift = max(step_now / step_then - 1, excess / step_then)
    return [Anomaly(
        kind="regression", ranks=[], cause=cause, first_step=int(now.steps[0]),
        last_step=now.last_step_of(len(now.steps) - 1), impact=shift / (1 + shift),
        confidence=min(0.99, 0.5 + shift),
        summary=(f"{shift:.0%} slower per step than baseline {config.baseline.job} "
                 f"({step_then:.1f} → {step_now:.1f} ms): {parts}{more_bytes}"
                 if step_now / step_then - 1 >= config.fail_slow_min_shift else
                 f"communication regressed against baseline {config.baseline.job}: {parts}"
                 f"{more_bytes} (step time {step_then:.1f} → {step_now:.1f} ms, the other parts "
                 "moved with the host's load)"),
        evidence={"baseline_job": config.baseline.job, "step_ms": [round(step_then, 3), round(step_now, 3)],
                  "component_ms": {k: [round(base[k], 3), round(current[k], 3)] for k in current},
                  "collective_bytes_per_step": [bytes_then, bytes_now], "grew": grew},
    )]


def _profile(frame: frames.StepFrame, config: DiagnosisConfig) -> dict[str, float]:
    cols = np.flatnonzero(frame.steps >= frame.steps[0] + config.warmup_steps)
    if cols.size == 0:
        cols = np.arange(len(frame.steps))

    def med(matrix: np.ndarray) -> float:
        value = nanmedian(nanmedian(matrix[:, cols].astype(np.float64), axis=0))
        return 0.0 if np.isnan(value) else float(value)

    profile = {name: med(matrix) for name, matrix in frame.parts.items()}
    profile["wait"] = med(frame.wait)
    profile["step"] = med(frame.duration)
    profile["bytes"] = med(frame.bytes)
    return profile
