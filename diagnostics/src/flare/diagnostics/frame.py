"""The rank × step matrices most detectors read, built from one pushed-down query.

A long job is bucketed (means over `bucket` consecutive steps) so that the matrices
never exceed `max_step_columns` columns nor `max_frame_cells` cells: memory is bounded
by that cap, not by the number of spans, and a thousand-rank hour costs one SQL
aggregation.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flare.diagnostics.columns import Table
from flare.diagnostics.model import DiagnosisConfig, JobData
from flare.diagnostics.stats import nanmedian
from flare.wire import semconv as sc

# What a rank's step is made of; `wait` is time blocked in collectives (for others).
COMPONENTS = {
    "dataloader": sc.STEP_DATALOADER_MS,
    "compute": sc.STEP_COMPUTE_MS,
    "gc": sc.STEP_GC_MS,
    "pycall": sc.STEP_PYCALL_MS,
    # the framework's phases, outside compute (python_calls.PHASES); 0 where not sent
    "checkpoint": sc.STEP_CHECKPOINT_MS,
    "evaluation": sc.STEP_EVALUATION_MS,
}
# Parts that only some steps and some jobs have: a missing value is 0 ms, not unknown.
PHASES = ("checkpoint", "evaluation")
WAIT = sc.STEP_COLLECTIVE_WAIT_MS
BYTES = sc.STEP_COLLECTIVE_BYTES
# NVML state the instrumentation attaches to a step when it changes (gpu_throttle reads it
# here, in the one shared pass, rather than every step span in Python).
SM_CLOCK = sc.STEP_GPU_SM_CLOCK_MHZ
THROTTLE = sc.STEP_GPU_THROTTLE
# CPU burnt by the rank's other threads: not part of its step time, but what tells a
# starved Python side (a GIL-holding thread) from slower compute.
OTHER_CPU = sc.STEP_OTHER_THREADS_CPU_MS
# Time the training thread waited for a CPU: a host busy with other work.
RUNQUEUE = sc.STEP_RUNQUEUE_MS
THREAD_CPU = sc.STEP_THREAD_CPU_MS  # ...and the CPU it burnt: tells the two apart
# Collectives whose wait no wrapper saw (C++-issued, a compiled graph): their wait is
# inside compute, so compute cannot be told from waiting on those ranks.
UNTIMED = sc.STEP_COLLECTIVE_UNTIMED
STEP_ATTRIBUTES = (*COMPONENTS.values(), WAIT, BYTES, SM_CLOCK, THROTTLE, OTHER_CPU, RUNQUEUE,
                   THREAD_CPU, UNTIMED)

# Which cause a component's growth points to.
COMPONENT_CAUSE = {"dataloader": "input", "compute": "compute", "gc": "gc", "pycall": "cpu",
                   "checkpoint": "checkpoint", "evaluation": "evaluation", "wait": "communication"}
# Which component dates a cause's onset (cpu starvation shows first in compute).
CAUSE_COMPONENT = {"compute": "compute", "input": "dataloader", "gc": "gc", "cpu": "compute",
                   "checkpoint": "checkpoint", "evaluation": "evaluation"}


@dataclasses.dataclass
class StepFrame:
    ranks: np.ndarray  # (R,) rank numbers
    steps: np.ndarray  # (S,) first step of each bucket
    bucket: int
    duration: np.ndarray  # (R, S) ms, NaN where the rank reported nothing
    wait: np.ndarray
    parts: dict[str, np.ndarray]  # component name → (R, S) ms
    bytes: np.ndarray
    start_ns: np.ndarray  # (R, S) float64
    end_ns: np.ndarray
    sm_clock_mhz: np.ndarray  # (R, S) mean SM clock; NaN where the bucket reported none
    throttle_reasons: np.ndarray  # (R, S) float64 holding the OR of the buckets' NVML masks
    other_cpu: np.ndarray  # (R, S) ms of CPU on the rank's other threads; NaN if unreported
    runqueue: np.ndarray | None = None  # (R, S) ms the training thread waited for a CPU
    untimed: np.ndarray | None = None  # (R, S) collectives per step Flare could not time
    thread_cpu: np.ndarray | None = None  # (R, S) ms of CPU the training thread burnt
    # (S,) the real first and last step of each column and how many steps it holds:
    # sampled or imported jobs number their steps sparsely, so a column's key (`steps`)
    # and the bucket width do not say which steps exist.
    first_steps: np.ndarray | None = None
    last_steps: np.ndarray | None = None
    step_counts: np.ndarray | None = None

    @property
    def work(self) -> np.ndarray:
        """A rank's own time in the step: everything but waiting for the others."""
        return self.duration - np.nan_to_num(self.wait)

    def cause_series(self, cause: str) -> np.ndarray | None:
        """The (R, S) matrix whose jump dates a slowdown of this cause: the component
        that grew, or for `cpu` the other threads' CPU when reported (it jumps the step a
        busy thread starts, where the training thread's compute only drifts up)."""
        if cause == "cpu" and np.isfinite(self.other_cpu).any():
            return self.other_cpu
        if cause == "compute" and self.runqueue is not None and np.isfinite(self.runqueue).any():
            # Time runnable but waiting for a CPU is the host's, not the rank's compute:
            # on a loaded host a descheduled stretch before the fault dated it early
            # (step 11 for a slow pipeline stage from step 20, seen).
            return self.parts["compute"] - np.nan_to_num(self.runqueue, nan=0.0)
        component = CAUSE_COMPONENT.get(cause)
        return None if component is None else self.parts[component]

    def step_of(self, column: int) -> int:
        if self.first_steps is not None:
            return int(self.first_steps[column])
        return int(self.steps[column])

    def last_step_of(self, column: int) -> int:
        if self.last_steps is not None:
            return int(self.last_steps[column])
        return int(self.steps[column]) + self.bucket - 1

    def step_count(self, columns: np.ndarray) -> int:
        """How many real steps these columns hold."""
        columns = np.asarray(columns, dtype=np.int64)
        if self.step_counts is not None:
            return int(self.step_counts[columns].sum())
        return int(columns.size * self.bucket)

    def wall_ms(self, columns: np.ndarray) -> float:
        """How long these columns' steps took the job: the median rank's step time
        times the real steps each column holds."""
        columns = np.asarray(columns, dtype=np.int64)
        if columns.size == 0:
            return 0.0
        step_ms = nanmedian(self.duration[:, columns].astype(np.float64), axis=0)
        counts = (self.step_counts[columns] if self.step_counts is not None
                  else np.full(columns.size, float(self.bucket)))
        return float(np.nansum(step_ms * counts))

    def row(self, rank: int) -> int:
        return int(np.searchsorted(self.ranks, rank))

    def column(self, step: int) -> int:
        return int(np.clip(np.searchsorted(self.steps, step, side="right") - 1, 0, len(self.steps) - 1))


# Warm-up read from the data: a run that starts with steps this many times its steady
# level (a compile, autotuning, first all-gathers) is warming up until a window of
# WARMUP_WINDOW steps settles within WARMUP_SETTLED of that level; at most half the run.
WARMUP_SLOW = 1.5
WARMUP_SETTLED = 1.25
WARMUP_WINDOW = 5


def warm_mask(frame: StepFrame, config: DiagnosisConfig) -> np.ndarray:
    """The columns a detector reads: past warm-up (`_past_warm_up`), and, in a job its
    user stopped (`config.stopped_by_user`), not the last one — the step the stop cut
    short or stretched (seen: a 2-rank job stopped while rank 0 hung, rank 1's last step
    6.1 s to its SIGTERM, read as "fail_slow [1] cpu 22-30")."""
    warm = _past_warm_up(frame, config)
    if config.stopped_by_user and warm.size > 1:
        warm = warm.copy()
        warm[-1] = False
    return warm


def _past_warm_up(frame: StepFrame, config: DiagnosisConfig) -> np.ndarray:
    """The columns past warm-up: the first `warmup_steps`, and beyond them while the job
    is still settling from a slow start (a compiled model's first steps, recompiles, a
    new schedule's first all-gathers), so baselines and change points start at steady
    state. Only a slow *prefix* counts: a slowdown later in the run is never warm-up."""
    steps = np.asarray(frame.steps)
    warm = steps >= steps[0] + config.warmup_steps
    series = nanmedian(frame.duration.astype(np.float64), axis=0)
    finite = np.isfinite(series)
    if finite.sum() < 4 * WARMUP_WINDOW:
        return warm
    later = series[len(series) // 2:]
    level = float(np.nanmedian(later)) if np.isfinite(later).any() else math.nan
    if not (level > 0) or not series[0] > WARMUP_SLOW * level:
        return warm
    limit = len(series) // 2
    for start in range(1, limit):
        window = series[start:start + WARMUP_WINDOW]
        if np.isfinite(window).any() and float(np.nanmedian(window)) <= WARMUP_SETTLED * level:
            return warm & (np.arange(len(series)) >= start)
    return warm & (np.arange(len(series)) >= limit)


# The least wait of a step is a transfer time only while (nearly) every rank reports it.
_LEAST_WAIT_MIN_REPORTING = 0.9


def least_wait(frame: StepFrame, cols: np.ndarray) -> np.ndarray:
    """Per column of `cols`, the least collective wait over the ranks: the rank that
    arrived last waited for nobody, so its wait is the collective's own time. NaN where
    fewer than 90 % of the ranks (and fewer than two) report the step: a rank whose last
    steps were lost (killed, hung, its spans still queued) is often the one that arrived
    last, and the least wait of those left is their wait for it (a killed rank's peer:
    "collective_slow [] communication" over its last 8 steps, seen on a loaded host)."""
    wait = frame.wait[:, cols].astype(np.float64)
    reporting = np.sum(~np.isnan(wait), axis=0)
    enough = reporting >= max(2, math.ceil(_LEAST_WAIT_MIN_REPORTING * (reporting.max(initial=0))))
    least = np.nanmin(np.where(np.isnan(wait), np.inf, wait), axis=0)
    return np.where(enough & np.isfinite(least), least, np.nan)


def bucket_for(steps_range: tuple[int, int] | None, config: DiagnosisConfig,
               distinct: int | None = None, ranks: int | None = None) -> int:
    """Steps per column: 1 unless the job has more steps than `max_step_columns`, or
    than `max_frame_cells` / `ranks` (counted as distinct step numbers when the backend
    can say, else by range)."""
    if steps_range is None:
        return 1
    span = steps_range[1] - steps_range[0] + 1
    count = span if distinct is None else distinct
    columns = config.max_step_columns
    if ranks:
        columns = max(1, min(columns, config.max_frame_cells // ranks))
    if count <= columns:
        return 1
    # Bucketed by step number: widths are of the numbering, so scale by how sparse it is.
    return max(1, math.ceil(span / columns))


def load(job: JobData, config: DiagnosisConfig) -> StepFrame | None:
    """The job's frame; built once per diagnosis where the job data can remember it
    (cached.CachedJobData: every detector reads the same one, none changes it)."""
    count = getattr(job, "step_count", None)
    bucket = bucket_for(job.steps_range(), config, count() if callable(count) else None,
                        len(job.ranks()))

    def build() -> StepFrame | None:
        table = job.step_summary(STEP_ATTRIBUTES, step_bucket=bucket)
        return None if table.num_rows == 0 else from_summary(table, bucket)

    memo = getattr(job, "memo", None)
    return memo(("frame", bucket), build) if callable(memo) else build()


def from_summary(table: Table, bucket: int) -> StepFrame:
    rank_values = table["rank"].to_numpy()
    step_values = table["step"].to_numpy()
    ranks = np.unique(rank_values)
    steps = np.unique(step_values)
    rows = np.searchsorted(ranks, rank_values)
    cols = np.searchsorted(steps, step_values)
    # Each cell's place in a flattened matrix, computed once for every column (1.2 M
    # cells x 22 columns for an hour of 1,024 ranks).
    flat = rows * len(steps) + cols

    def matrix(name: str, dtype=np.float32) -> np.ndarray:
        out = np.full(len(ranks) * len(steps), np.nan, dtype=dtype)
        out[flat] = table[name].to_numpy(zero_copy_only=False)
        return out.reshape(len(ranks), len(steps))

    return StepFrame(
        ranks=ranks, steps=steps, bucket=bucket,
        duration=matrix("duration_ms"), wait=matrix(WAIT),
        parts={name: (np.nan_to_num(matrix(key)) if name in PHASES else matrix(key))
               if key in table.column_names else np.zeros((len(ranks), len(steps)), np.float32)
               for name, key in COMPONENTS.items()},
        bytes=matrix(BYTES), start_ns=matrix("start_ns", np.float64),
        end_ns=matrix("end_ns", np.float64),
        sm_clock_mhz=matrix(SM_CLOCK), throttle_reasons=matrix(THROTTLE, np.float64),
        other_cpu=matrix(OTHER_CPU),
        runqueue=matrix(RUNQUEUE) if RUNQUEUE in table.column_names else None,
        thread_cpu=matrix(THREAD_CPU) if THREAD_CPU in table.column_names else None,
        untimed=matrix(UNTIMED) if UNTIMED in table.column_names else None,
        **_real_steps(table, cols, len(steps), bucket),
    )


def _real_steps(table: Table, cols: np.ndarray, columns: int, bucket: int) -> dict:
    """first_steps, last_steps and step_counts per column from the summary's real step
    numbers (absent from summaries that do not give them)."""
    if "first_step" not in table.column_names or "last_step" not in table.column_names:
        return {}
    first = np.full(columns, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(columns, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, cols, np.asarray(table["first_step"].to_numpy(), dtype=np.int64))
    np.maximum.at(last, cols, np.asarray(table["last_step"].to_numpy(), dtype=np.int64))
    counts = np.ones(columns) if bucket == 1 else np.minimum(
        last - first + 1, np.bincount(cols, weights=table["steps"].to_numpy(), minlength=columns))
    return {"first_steps": first, "last_steps": last, "step_counts": np.asarray(counts, dtype=np.float64)}
