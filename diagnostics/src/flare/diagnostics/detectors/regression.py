"""Regression: this job against a baseline job (`--baseline-job`), naming what grew.

Steady-state medians (after warm-up) of the step time and of each part of it —
data loading, compute, GC, Python hot calls, collective wait and bytes moved — are
compared; a step time at least `fail_slow_min_shift` above the baseline's is a
regression, and the parts that account for the growth are named.

Imported profiler traces carry no step breakdown; for them the parts are read from
the kernel and operator spans instead: GPU compute, memory copies, collectives (their
kernels), CPU operators (a CPU-only trace) and the GPU's idle time in the step. When
the two jobs ran on different GPU models, world sizes or software versions (as their
resources say), the summary says so in one sentence: the comparison is then not like
for like.
"""

from __future__ import annotations

import json

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.frame import COMPONENT_CAUSE
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData, rank_resources
from flare.diagnostics.stats import nanmedian
from flare.wire import semconv as sc

_NAMES = {"dataloader": "data loading", "compute": "compute", "gc": "garbage collection",
          "pycall": "Python hot calls", "checkpoint": "checkpoint saves",
          "evaluation": "evaluation", "wait": "communication (collective wait)",
          "gpu_compute": "GPU compute", "memcpy": "memory copies",
          "collectives": "collective kernels", "cpu_ops": "CPU operators", "gpu_idle": "GPU idle"}
# What a kernel-derived part's growth points to.
_KERNEL_CAUSE = {"gpu_compute": "compute", "memcpy": "compute", "collectives": "communication",
                 "cpu_ops": "cpu", "gpu_idle": "unknown"}
_MEMORY = frozenset(("memcpy", "memset"))


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
    cause_of = COMPONENT_CAUSE
    if not any(current[k] > 0 or base[k] > 0 for k in current):
        # An imported trace: no breakdown on its steps; its kernels and operators say.
        kernels_now, kernels_then = _kernel_profile(job, step_now), _kernel_profile(config.baseline, step_then)
        if kernels_now and kernels_then:
            current, base, cause_of = kernels_now, kernels_then, _KERNEL_CAUSE
            current.setdefault("wait", 0.0)
            base.setdefault("wait", 0.0)
    deltas = {k: current[k] - base.get(k, 0.0) for k in current}
    moves_more = bytes_now > 1.1 * bytes_then + 1024
    # Communication that grew with the bytes moved is a regression even when noise in
    # the other parts (a busier host during the baseline) hides it in the step total.
    comm_grew = moves_more and deltas["wait"] >= config.fail_slow_min_shift * step_then
    if step_now / step_then - 1 < config.fail_slow_min_shift and not comm_grew:
        return []
    excess = max(step_now - step_then, deltas["wait"] if comm_grew else 0.0)
    grew = sorted((k for k in deltas if deltas[k] >= 0.2 * excess), key=lambda k: -deltas[k])
    top = grew[0] if grew else None
    cause = cause_of.get(top, "unknown") if top and deltas[top] >= config.cause_min_share * excess else "unknown"
    if moves_more and top == "wait":
        # More bytes per step and more time in collectives: the job communicates more,
        # whatever share step-to-step noise leaves to the other parts.
        cause = "communication"
    parts = ", ".join(f"{_NAMES[k]} +{deltas[k]:.1f} ms" for k in grew) or "no single part"
    more_bytes = ""
    if moves_more:
        more_bytes = f"; {(bytes_now - bytes_then) / 1e6:.1f} MB more moved by collectives per step"
    shift = max(step_now / step_then - 1, excess / step_then)
    differences = _differences(job, config.baseline, now, then)
    unlike = ("; not like for like: " + "; ".join(differences)) if differences else ""
    return [Anomaly(
        kind="regression", ranks=[], cause=cause, first_step=int(now.steps[0]),
        last_step=now.last_step_of(len(now.steps) - 1), impact=shift / (1 + shift),
        confidence=min(0.99, 0.5 + shift),
        summary=(f"{shift:.0%} slower per step than baseline {config.baseline.job} "
                 f"({step_then:.1f} → {step_now:.1f} ms): {parts}{more_bytes}{unlike}"
                 if step_now / step_then - 1 >= config.fail_slow_min_shift else
                 f"communication regressed against baseline {config.baseline.job}: {parts}"
                 f"{more_bytes} (step time {step_then:.1f} → {step_now:.1f} ms, the other parts "
                 f"moved with the host's load){unlike}"),
        evidence={"baseline_job": config.baseline.job, "step_ms": [round(step_then, 3), round(step_now, 3)],
                  "component_ms": {k: [round(base.get(k, 0.0), 3), round(current[k], 3)] for k in current},
                  "collective_bytes_per_step": [bytes_then, bytes_now], "grew": grew,
                  "differences": differences},
    )]


def _profile(frame: frames.StepFrame, config: DiagnosisConfig) -> dict[str, float]:
    cols = np.flatnonzero(frames.warm_mask(frame, config))
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


def _kernel_profile(job: JobData, step_ms: float) -> dict[str, float] | None:
    """Per rank and step, ms of GPU compute, memory copies, collective kernels, CPU
    operators and GPU idle (the step minus its kernels), medians over steps; None
    without kernel spans."""
    table = job.spans([sc.SPAN_KERNEL], attributes=[sc.KERNEL_CATEGORY, sc.KERNEL_DEVICE],
                      columns=["rank", "step", "duration_ns"])
    if table.num_rows == 0:
        return None
    totals: dict[tuple, dict[str, float]] = {}
    for rank, step, duration, category, device in zip(
            table["rank"].to_pylist(), table["step"].to_pylist(), table["duration_ns"].to_pylist(),
            table[sc.KERNEL_CATEGORY].to_pylist(), table[sc.KERNEL_DEVICE].to_pylist(), strict=True):
        if step is None or duration is None:
            continue
        if device is not None and int(device) == sc.KERNEL_DEVICE_HOST:
            part = "cpu_ops"
        elif category == "communication":
            part = "collectives"
        elif category in _MEMORY:
            part = "memcpy"
        else:
            part = "gpu_compute"
        entry = totals.setdefault((rank, step), {})
        entry[part] = entry.get(part, 0.0) + duration / 1e6
    if not totals:
        return None
    parts = ("gpu_compute", "memcpy", "collectives", "cpu_ops")
    profile = {p: float(np.median([t.get(p, 0.0) for t in totals.values()])) for p in parts}
    if profile["gpu_compute"] + profile["memcpy"] + profile["collectives"] > 0:
        busy = profile["gpu_compute"] + profile["memcpy"] + profile["collectives"]
        profile["gpu_idle"] = max(0.0, step_ms - busy)
    return profile


# Resource attributes that make two jobs not comparable when they differ.
_LIKE_FOR_LIKE = (sc.GPU_MODEL, sc.WORLD_SIZE)


def _differences(job: JobData, baseline: JobData, now: frames.StepFrame,
                 then: frames.StepFrame) -> list[str]:
    """What differs between the two jobs' set-ups, one phrase each."""
    mine, theirs = _resource(job), _resource(baseline)
    out = []
    keys = [*_LIKE_FOR_LIKE, *sorted(k for k in set(mine) | set(theirs)
                                     if "version" in k and k not in _LIKE_FOR_LIKE)]
    for key in keys:
        a, b = theirs.get(key), mine.get(key)
        if key == sc.WORLD_SIZE:
            a = a if a is not None else len(then.ranks)
            b = b if b is not None else len(now.ranks)
        if a is not None and b is not None and str(a) != str(b):
            out.append(f"{key} {a} → {b}")
    return out


def _resource(job: JobData) -> dict:
    for _, resource in rank_resources(job, [sc.SPAN_STEP]):
        try:
            value = json.loads(resource) if resource else {}
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}
