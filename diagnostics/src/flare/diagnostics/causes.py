"""Naming the cause of excess time from the step breakdown.

A rank's own step time splits into dataloader, compute, gc and Python hot calls
(collective wait is time spent on *other* ranks). When a rank's time grows, the
component that grew names the cause — if it explains at least `cause_min_share` of
the growth (TraceML's rule).

One pattern is special: CPU starvation of the rank's Python side (a GIL-holding
thread, an oversubscribed core). Measured on gloo/CPU runs of examples/train_ddp.py:
an injected compute slowdown grows compute_ms alone, the data loader's mean stays at
its peers' (~1 ms, ratio ≈ 1.1); a GIL-holding thread grows compute_ms *and* makes
the data loader — pure Python that should take ~1 ms — erratically slow (mean 7 ms
against 1–2 ms on its peers, p75 7 ms against 1 ms), because every time the main
thread gives up the GIL it waits a switch interval to get it back. So a second,
unrelated Python-side component inflating by its *mean* beside the main one names
`cpu`, not `compute`. The direct sign, where the instrumentation reports it, is the
CPU the rank's *other* threads burn during its steps (`flare.step.cpu.other_threads_ms`):
a busy thread burns it, slower compute on the training thread does not.
"""

from __future__ import annotations

import dataclasses
import math

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
              subject_work: float, reference_work: float,
              subject_mean: dict[str, float] | None = None,
              reference_mean: dict[str, float] | None = None) -> Attribution:
    """Compare the subject's per-component medians (and means) to a reference's
    (its peers, or its own past)."""
    excess = subject_work - reference_work
    deltas = {k: subject[k] - reference[k] for k in subject}
    ratios = {k: (subject[k] + 1.0) / (reference[k] + 1.0) for k in subject}
    if excess <= 0:
        return Attribution("unknown", 0.0, excess, deltas, ratios)
    inflated = [k for k in ("dataloader", "compute", "pycall")
                if ratios[k] >= _INFLATION_RATIO and deltas[k] >= _INFLATION_MIN_SHARE * excess]
    top = max(deltas, key=lambda k: deltas[k])
    if len(inflated) >= 2 and not (top == "dataloader" and deltas[top] >= LOADER_DOMINANT_SHARE * excess):
        share = sum(deltas[k] for k in inflated) / excess
        return Attribution("cpu", min(share, 1.0), excess, deltas, ratios)
    share = deltas[top] / excess
    cause = COMPONENT_CAUSE[top] if share >= min_share else "unknown"
    if cause == "compute" and subject_mean and reference_mean and _python_side_starved(
            subject_mean, reference_mean):
        cause = "cpu"
    return Attribution(cause, min(share, 1.0), excess, deltas, ratios)


# Two inflated components name `cpu` unless the data loader's growth is most of the
# excess: a slow loader whose worker processes burn the CPU the trainer needs makes
# compute a little slower too (a single process on a loaded 2-core host, loader +40 ms,
# compute +6 ms per step), while starvation of the Python side grows compute most and
# the loader's wait by a few ms.
LOADER_DOMINANT_SHARE = 0.6

# The data loader's mean must grow this much (ratio with +1 ms smoothing) and by this
# many ms beside a compute growth to call it CPU starvation (see the module note).
_STARVED_RATIO = 2.0
_STARVED_MIN_MS = 2.0


# Other threads' CPU must grow by this share of the compute growth (and by this many
# ms) for the growth to be starvation: a busy thread burns CPU that slower compute on
# the training thread does not.
_OTHER_CPU_MIN_SHARE = 0.25
_OTHER_CPU_MIN_MS = 2.0


# ...while the training thread's own CPU grew by less than this share of it (or by less
# than _OTHER_CPU_MIN_MS): a thread that holds the GIL keeps the training thread waiting,
# off the CPU; torch's intra-op threads share the step's own work with it, and it burns
# as long as they do (one process, 2 OpenMP threads, a matmul from step 100: compute
# +41 ms/step, the training thread +39.5 ms and the others +40.8 ms of CPU — read as
# "starved of CPU", cause cpu).
_OWN_CPU_MAX_SHARE = 0.5


def _python_side_starved(subject_mean: dict[str, float], reference_mean: dict[str, float]) -> bool:
    other = subject_mean.get("other_cpu", math.nan) - reference_mean.get("other_cpu", math.nan)
    own = subject_mean.get("thread_cpu", math.nan) - reference_mean.get("thread_cpu", math.nan)
    compute_growth = subject_mean["compute"] - reference_mean["compute"]
    if (math.isfinite(other) and other >= max(_OTHER_CPU_MIN_MS, _OTHER_CPU_MIN_SHARE * compute_growth)
            and not (math.isfinite(own)
                     and own >= max(_OTHER_CPU_MIN_MS, _OWN_CPU_MAX_SHARE * compute_growth))):
        return True
    grew = subject_mean["dataloader"] - reference_mean["dataloader"]
    ratio = (subject_mean["dataloader"] + 1.0) / (reference_mean["dataloader"] + 1.0)
    return ratio >= _STARVED_RATIO and grew >= _STARVED_MIN_MS


def medians(frame: StepFrame, rows: np.ndarray | list[int], cols: np.ndarray | slice) -> tuple[dict[str, float], float]:
    """Per-component medians of `rows` over `cols` (median across the rows per step first)."""
    def med(matrix: np.ndarray) -> float:
        block = matrix[np.asarray(rows)][:, cols]
        value = nanmedian(nanmedian(block, axis=0))
        return 0.0 if np.isnan(value) else float(value)

    parts = {name: med(matrix) for name, matrix in frame.parts.items()}
    return parts, med(frame.work)


def means(frame: StepFrame, rows: np.ndarray | list[int], cols: np.ndarray | slice) -> dict[str, float]:
    """Per-component means over steps (median across the rows per step first): the
    mean keeps the erratic tail a median hides. `other_cpu` (CPU of the rank's other
    threads) rides along; NaN when the instrumentation did not report it."""
    out = {}
    rows = np.asarray(rows)
    extra = (("other_cpu", frame.other_cpu), ("runqueue", frame.runqueue), ("thread_cpu", frame.thread_cpu))
    for name, matrix in (*frame.parts.items(), *extra):
        if matrix is None:  # not reported
            out[name] = math.nan
            continue
        block = matrix[rows][:, cols].astype(np.float64)
        # (one rank: its own series; nanmedian of one row is ~40x slower than the row)
        per_step = block[0] if len(rows) == 1 else nanmedian(block, axis=0)
        finite = np.isfinite(per_step).any()
        out[name] = float(np.nanmean(per_step)) if finite else (math.nan if name in dict(extra) else 0.0)
    return out


# A slowdown whose growth is at least this share run-queue wait, with no more work done
# (below), was the host's doing (other work took the CPU).
HOST_STARVED_SHARE = 0.5
# More work: the training thread's own CPU grew by this share of the excess, and by this
# many ms at least. Then the slowdown is the job's on any host, however long the rank
# also waited for a CPU: on a busy host the extra work waits for CPU slices as well (an
# FSDP rank doing 40 extra matmuls on a loaded 2-core host: +24 ms of its own CPU and
# +26 ms of run-queue wait per step; the rule that asked for half the excess in CPU
# withdrew it as "the host").
WORK_GREW_SHARE = 0.25
WORK_GREW_FLOOR_MS = 2.0


def work_grew(subject_mean: dict[str, float], reference_mean: dict[str, float], excess_ms: float) -> bool:
    """Whether the subject rank burnt more CPU than the reference (peers, or its own
    past) by a part of the excess that more work, not contention, explains: its training
    thread's CPU and its other threads' together. A GIL-holding thread of the rank's own
    on a busy host makes the training thread wait for a CPU as well as for the GIL, and
    burns the CPU itself (+4 ms of other-thread CPU against +13 ms of run-queue wait on
    the loaded 2-core host): the rank's doing, not the host's."""
    def burnt(name: str) -> float:
        return subject_mean.get(name, math.nan) - reference_mean.get(name, math.nan)

    grew = [d for d in (burnt("thread_cpu"), burnt("other_cpu")) if math.isfinite(d)]
    return bool(grew) and sum(grew) >= max(WORK_GREW_FLOOR_MS, WORK_GREW_SHARE * excess_ms)


def waits_without_work(frame: StepFrame, cause: str, subject_mean: dict[str, float],
                       reference_mean: dict[str, float], excess_ms: float) -> bool:
    """Whether compute that grew on a CPU-only job (no SM clock reported) did so without
    the subject burning more CPU than the reference (peers, or its own past), measured:
    its own code waits — a sleep, blocking I/O, a lock (a new user's `time.sleep` per
    step read "its compute is slower", +0.6 ms of CPU burnt against +80 ms). On a GPU
    job slower kernels burn no CPU of the rank either, so nothing is said there."""
    if cause != "compute" or np.isfinite(frame.sm_clock_mhz).any():
        return False
    measured = any(math.isfinite(subject_mean.get(name, math.nan) - reference_mean.get(name, math.nan))
                   for name in ("thread_cpu", "other_cpu"))
    return measured and not work_grew(subject_mean, reference_mean, excess_ms)


def dating_series(frame: StepFrame, cause: str, rows: list[int], cols: np.ndarray, excess_ms: float,
                  peers: list[int] | None = None, before: np.ndarray | None = None) -> np.ndarray | None:
    """The (R, S) series whose jump dates a label of `cause` on `rows`, for every
    detector. Compute that the rows' training thread burnt as CPU is dated by that CPU:
    it is the work itself, and neither a wait for a CPU nor a sleep on the GIL of a
    thread the host descheduled moves it (a slow node on a busy CI host dated @6 and @10
    by its compute for a fault from step 20, the thread CPU flat until 20). The CPU must
    carry the share of the excess that makes work grow (WORK_GREW_SHARE; on a busy host
    the extra work's time is half waiting for CPU slices), measured over `cols` against
    `peers` there, or against the rows' own `before` columns when no peers are given (a
    job-wide slowdown). Else the cause's component (StepFrame.cause_series)."""
    if cause == "compute" and frame.thread_cpu is not None:
        cpu = frame.thread_cpu.astype(np.float64)

        def level(which: list[int], columns: np.ndarray) -> float:
            return float(nanmedian(nanmedian(cpu[np.asarray(which)][:, columns], axis=0)))

        if peers:
            grew = level(rows, cols) - level(peers, cols)
        elif before is not None and len(before):
            grew = level(rows, cols) - level(rows, before)
        else:
            grew = math.nan
        if math.isfinite(grew) and grew >= max(WORK_GREW_FLOOR_MS, WORK_GREW_SHARE * excess_ms):
            return cpu
    return frame.cause_series(cause)


def host_starved(subject_mean: dict[str, float], reference_mean: dict[str, float],
                 excess_ms: float, grew: bool | None = None) -> bool:
    """Whether the subject's excess over the reference (peers, or its own past) is the
    host's doing: it waited for a CPU (run-queue time) without doing more work itself.
    A rank the host starves does the same work, later; a rank whose work grew is the
    job's however much it also waited (`work_grew`, unless the caller measured it: `grew`)."""
    if not excess_ms > 0:
        return False
    runqueue = subject_mean.get("runqueue", math.nan) - reference_mean.get("runqueue", math.nan)
    if not math.isfinite(runqueue) or runqueue < HOST_STARVED_SHARE * excess_ms:
        return False
    return not (work_grew(subject_mean, reference_mean, excess_ms) if grew is None else grew)



def cpu_only_idle(frame: StepFrame, now: dict[str, float], past: dict[str, float],
                  slowdown_ms: float) -> bool:
    """Whether the ranks' compute (every rank's, or the slowed ranks') grew by
    `slowdown_ms` per step on a CPU-only job without their CPU doing more work: the
    training threads and the ranks' other threads burnt no more CPU (measured),
    so the time went to waiting — for a CPU (run queue), or asleep (the GIL held by a
    thread the busy host descheduled, page faults from a busy disk). That is the host's,
    however little of it the run queue shows (a healthy 2-rank job on a busy CI host:
    steps 8 -> 14 ms, thread CPU flat at 5 ms, run queue under half of it: "fail_slow []
    compute"). Not on a GPU job (an SM clock reported): a GPU's slower kernels burn no
    CPU of the rank either, and they are the job's. Nor without the run queue showing
    some of it (IDLE_RUNQUEUE_SHARE): a step that sleeps, blocks on I/O or waits on a
    lock in the job's own code burns no CPU either, and no busy host stands behind it
    (one process, `time.sleep(0.04)` in every step from step 100: steps 2 -> 42 ms, run
    queue +0.1 ms — read as "the host, +41.5 ms/step asleep", no label)."""
    if frame.thread_cpu is None or not np.isfinite(frame.thread_cpu).any():
        return False
    if np.isfinite(frame.sm_clock_mhz).any():
        return False
    waited = now.get("runqueue", math.nan) - past.get("runqueue", math.nan)
    if math.isfinite(waited) and waited < IDLE_RUNQUEUE_SHARE * slowdown_ms:
        return False  # (unreported, as off Linux: no evidence either way, the rule as before)
    return slowdown_ms > 0 and not work_grew(now, past, slowdown_ms)


# A slowdown without more CPU burnt is the host's only if the ranks also waited for a
# CPU this share of it (`cpu_only_idle`): on the busy hosts seen the run queue showed
# 29-45 % of it, the rest asleep; a job's own sleep shows ~0 %.
IDLE_RUNQUEUE_SHARE = 0.1

# Slower collectives are the host's when the ranks waited for a CPU at least this share
# of the slowdown per step (`host_busy`).
HOST_BUSY_SHARE = 0.5


def host_busy(frame: StepFrame, cols: np.ndarray, slowdown_ms: float) -> bool:
    """Whether every rank's collectives may have slowed by `slowdown_ms` per step over
    `cols` because the host was busy: the ranks' training threads waited for a CPU (run
    queue, median rank, mean step) at least HOST_BUSY_SHARE of it. The collective
    library's threads wait for CPUs too, unmeasured, so a busy host reads as a slower
    fabric (a healthy compiled DDP job beside one busy process per core: "fail_slow []
    communication" over its last 6 steps, 1 of 3 loaded runs). False where the run
    queue is not reported."""
    if frame.runqueue is None or not slowdown_ms > 0:
        return False
    per_step = nanmedian(frame.runqueue[:, cols].astype(np.float64), axis=0)
    if not np.isfinite(per_step).any():
        return False
    return float(np.nanmean(per_step)) >= HOST_BUSY_SHARE * slowdown_ms
