"""GPU timeline arithmetic shared by the GPU detectors and the Kineto benchmark.

Definitions (docs/gpu.md has the prose):
- busy time: the union of kernel/memcpy/memset intervals over every stream of a rank.
- void share of a step (the paper's void percentage): 1 − busy / window, where the
  step's GPU window runs from the first GPU activity the step launched to the first one
  the next step launched (the last step: to its last activity's end). GPU work is
  asynchronous, so a step's kernels run later than its CPU span; windows follow them.
- trace idle share (`trace_idle_share`): Holistic Trace Analysis's temporal breakdown —
  activities launched before the last ProfilerStep began, window first start → last end.
- host wait: an idle gap that ends with an activity launched only after the gap began:
  the GPU waited for the CPU to issue work (HTA's "host wait"; Flare's launch-bound).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from flare.diagnostics.backends import attributes as typed_attributes
from flare.diagnostics.columns import Table
from flare.diagnostics.model import rank_resources
from flare.wire import semconv as sc

typed_attributes.register(sc.KERNEL_LAUNCH_NS, "int64")
typed_attributes.register(sc.KERNEL_LAUNCH_DUR_US, "double")
typed_attributes.register(sc.STEP_GPU_TEMPERATURE_C, "double")
typed_attributes.register(sc.STEP_GPU_POWER_W, "double")

KERNEL_ATTRIBUTES = (
    sc.KERNEL_NAME, sc.KERNEL_CATEGORY, sc.KERNEL_STREAM, sc.KERNEL_DEVICE,
    sc.KERNEL_ISSUE_LATENCY_US, sc.KERNEL_LAUNCH_NS, sc.KERNEL_LAUNCH_DUR_US,
    sc.KERNEL_FLOPS, sc.KERNEL_ACHIEVED_TFLOPS, sc.KERNEL_SHAPE, sc.KERNEL_DTYPE,
)
SPAN_COLUMNS = ("rank", "step", "start_ns", "end_ns", "duration_ns", "trace_id", "resource")
# What the detectors read: the resource (the same JSON text on every span of a rank, a
# third of the kernel table's bytes) comes once per rank from `gpu_models`.
DETECTOR_COLUMNS = tuple(c for c in SPAN_COLUMNS if c != "resource")


def gpu_activities(job, attributes: Sequence[str] = KERNEL_ATTRIBUTES,
                   ranks: Sequence[int] | None = None,
                   columns: Sequence[str] = SPAN_COLUMNS) -> Table:
    """Kernel spans that ran on a GPU (CPU operators of CPU-only windows excluded)."""
    table = job.spans([sc.SPAN_KERNEL], attributes=list(attributes), ranks=ranks,
                      columns=list(columns))
    if table.num_rows == 0 or sc.KERNEL_DEVICE not in table.column_names:
        return table
    device = table.column(sc.KERNEL_DEVICE)
    # A null device counts as a GPU's (only the host's own marker excludes a span).
    keep = ~device.is_valid() | (device.data != sc.KERNEL_DEVICE_HOST)
    return table.filter(keep)


def detector_activities(job) -> Table:
    """The GPU detectors' kernel table: all ask with the same arguments, so the
    diagnosis pipeline's cache answers them with one query."""
    return gpu_activities(job, columns=DETECTOR_COLUMNS)


def gpu_models(job) -> dict[int, str]:
    """Per rank, the GPU model its kernel spans' resource names (the first that does)."""
    models: dict[int, str] = {}
    for rank, resource in rank_resources(job, [sc.SPAN_KERNEL]):
        if rank in models or not resource:
            continue
        try:
            model = json.loads(resource).get(sc.GPU_MODEL)
        except (ValueError, AttributeError):
            model = None
        if model:
            models[int(rank)] = model
    return models


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted union of [start, end) intervals."""
    if len(starts) == 0:
        return starts.astype(np.int64), ends.astype(np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    running_end = np.maximum.accumulate(e)
    new_group = np.empty(len(s), dtype=bool)
    new_group[0] = True
    new_group[1:] = s[1:] > running_end[:-1]
    group = np.cumsum(new_group) - 1
    merged_s = s[new_group]
    merged_e = np.zeros(len(merged_s), dtype=e.dtype)
    np.maximum.at(merged_e, group, e)
    return merged_s, merged_e


class BusyTimeline:
    """Busy time of one rank's GPU between any two instants, in O(log n) per query."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        self.starts, self.ends = merge_intervals(np.asarray(starts), np.asarray(ends))
        lengths = self.ends - self.starts
        self._before = np.concatenate([[0], np.cumsum(lengths)])  # busy before interval i

    def busy_until(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t)
        index = np.searchsorted(self.starts, t, side="right") - 1
        safe = np.clip(index, 0, None)
        inside = np.where(index >= 0,
                          np.clip(t - self.starts[safe], 0, self.ends[safe] - self.starts[safe]), 0)
        return np.where(index >= 0, self._before[safe] + inside, 0)

    def busy_between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.busy_until(b) - self.busy_until(a)


def trace_idle_share(starts: np.ndarray, ends: np.ndarray, launches: np.ndarray,
                     last_step_start_ns: int | None) -> tuple[float, int, int]:
    """HTA temporal-breakdown idle share: (share, idle_ns, window_ns).

    Only activities with a known launch count (HTA joins GPU events to CPU events by
    correlation); with two or more ProfilerSteps only those launched before the last one
    began (HTA drops the last, usually incomplete, iteration).
    """
    keep = ~np.isnan(launches.astype(float))
    if last_step_start_ns is not None:
        keep &= launches.astype(float) < float(last_step_start_ns)
    s, e = starts[keep], ends[keep]
    if len(s) == 0:
        return 0.0, 0, 0
    merged_s, merged_e = merge_intervals(s, e)
    window = int(merged_e.max() - merged_s.min())
    idle = window - int((merged_e - merged_s).sum())
    return (idle / window if window > 0 else 0.0), idle, window


def step_windows(table: Table) -> dict[int, list[tuple[int, int, int]]]:
    """Per rank: [(step, window_start_ns, window_end_ns)] over the GPU timeline."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    if table.num_rows == 0:
        return out
    stepped = table.filter(table.column("step").is_valid() & table.column("rank").is_valid())
    if stepped.num_rows == 0:
        return out
    # Per (rank, step), sorted by rank then step: first start and last end.
    all_ranks = stepped.column("rank").to_numpy().astype(np.int64)
    all_steps = stepped.column("step").to_numpy().astype(np.int64)
    order = np.lexsort((all_steps, all_ranks))
    r, st = all_ranks[order], all_steps[order]
    new_group = np.ones(len(r), dtype=bool)
    new_group[1:] = (r[1:] != r[:-1]) | (st[1:] != st[:-1])
    starts_at = np.flatnonzero(new_group)
    ranks, steps = r[starts_at], st[starts_at]
    first = np.minimum.reduceat(stepped.column("start_ns").to_numpy()[order], starts_at)
    last = np.maximum.reduceat(stepped.column("end_ns").to_numpy()[order], starts_at)
    for i in range(len(ranks)):
        nxt = i + 1 < len(ranks) and ranks[i + 1] == ranks[i] and steps[i + 1] == steps[i] + 1
        end = first[i + 1] if nxt else last[i]
        out.setdefault(int(ranks[i]), []).append((int(steps[i]), int(first[i]), int(end)))
    return out


def timelines(table: Table) -> dict[int, BusyTimeline]:
    out: dict[int, BusyTimeline] = {}
    ranks = table.column("rank").to_numpy(zero_copy_only=False)
    starts = table.column("start_ns").to_numpy(zero_copy_only=False)
    ends = table.column("end_ns").to_numpy(zero_copy_only=False)
    for rank in np.unique(ranks):
        mask = ranks == rank
        out[int(rank)] = BusyTimeline(starts[mask], ends[mask])
    return out


def void_shares(table: Table) -> dict[int, list[tuple[int, float, int]]]:
    """Per rank: [(step, void share, window ns)] for each step with GPU activity."""
    lines = timelines(table) if table.num_rows else {}
    out: dict[int, list[tuple[int, float, int]]] = {}
    for rank, windows in step_windows(table).items():
        arr = np.array([(w[1], w[2]) for w in windows], dtype=np.int64)
        busy = lines[rank].busy_between(arr[:, 0], arr[:, 1])
        length = arr[:, 1] - arr[:, 0]
        out[rank] = [
            (windows[i][0], float(1 - busy[i] / length[i]) if length[i] > 0 else 0.0,
             int(length[i]))
            for i in range(len(windows))
        ]
    return out


def host_wait_ns(starts: np.ndarray, ends: np.ndarray, launches: np.ndarray,
                 launch_durs_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Idle gaps the GPU spent waiting for the CPU to issue the next activity.

    Returns (gap_end_ns, host_wait_ns) per gap: a gap counts as host wait from the gap's
    start until the next activity's launch call returned, when that was after the gap
    began; the rest of the gap (launched in time, started late) is not the CPU's fault.
    """
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    launch_end = launches[order].astype(float) + np.nan_to_num(
        launch_durs_us[order].astype(float)) * 1000.0
    running_end = np.maximum.accumulate(e)
    gap_after = np.empty(len(s), dtype=float)
    gap_after[0] = np.nan
    gap_after[1:] = np.where(s[1:] > running_end[:-1], running_end[:-1], np.nan)
    is_gap = ~np.isnan(gap_after)
    gap_start = gap_after[is_gap]
    gap_end = s[is_gap].astype(float)
    issued = launch_end[is_gap]
    wait = np.where(np.isnan(issued), 0.0,
                    np.clip(np.minimum(issued, gap_end) - gap_start, 0, None))
    return gap_end.astype(np.int64), wait.astype(np.int64)


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    return float(np.percentile(arr, q)) if len(arr) else float("nan")


def trace_ids_of(table: Table, mask: np.ndarray | None = None, limit: int = 5) -> list[str]:
    if "trace_id" not in table.column_names or table.num_rows == 0:
        return []
    ids = table.column("trace_id").to_numpy(zero_copy_only=False)
    if mask is not None:
        ids = ids[mask]
    seen: list[str] = []
    for value in ids:
        if value and value not in seen:
            seen.append(value)
            if len(seen) >= limit:
                break
    return seen
