"""Synthetic span tables with known faults, for detector tests and benchmarks.

Models what the instrumentation reports from a data-parallel job: each step every
rank does its own work (input, compute, gc, Python calls), then all ranks meet in a
collective; a rank that arrives early waits for the last one. So the culprit of a
slow step has the *least* collective wait, and every rank's step lasts about as long
as the slowest rank's work — the trap BACKGROUND.md warns about.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa

from flare.exporters.store import spans_table
from flare.wire import semconv as sc


@dataclasses.dataclass
class Fault:
    # compute | input | gc | cpu | busy_thread | busy_thread_loaded | gil_between_steps | host | asleep |
    # communication | hang | error | silent | checkpoint | evaluation (a framework phase's
    # time: rank -1 runs it on every rank)
    kind: str
    rank: int
    from_step: int
    extra_ms: float = 30.0
    to_step: int | None = None
    # busy_thread: steps where the thread burns its CPU but does not slow the training
    # thread (a loaded host hands the GIL around patchily at first).
    missed: tuple[int, ...] = ()
    # Active only every `every` steps from from_step (a periodic stall); 0: every step.
    every: int = 0


def job_spans(
    job: str = "job",
    world: int = 4,
    steps: int = 60,
    faults: tuple[Fault, ...] = (),
    base_ms: float = 40.0,
    seed: int = 0,
    start_ns: int = 1_700_000_000_000_000_000,
    comm_ms: float = 5.0,
    node_size: int = 0,
    groups: dict[str, tuple[int, ...]] | None = None,
    hiccups: float = 0.0,
    step_numbers: list[int] | None = None,
    warmup: tuple[float, ...] = (),
    busy_host_ms: float = 0.0,
    bytes_per_step: int = 0,
) -> pa.Table:
    """`node_size` > 0 puts `flare.node_rank` = rank // node_size in the resources;
    `groups` are process groups (name → member ranks) reported in each member's steps;
    `hiccups` is the chance that a rank's step is delayed by 20-100 % of `base_ms` (a
    loaded host descheduling it); `step_numbers` renumbers the steps (sampled jobs); `warmup` adds ms of compute
    to the first steps, each rank 0.5-1.5x of it (a compiled model's first steps);
    `busy_host_ms` is every rank's run-queue wait per step (a host busy with other work,
    which also slows the collective library's threads: not modelled otherwise);
    `bytes_per_step` > 0 reports that many collective bytes in every rank's step."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[object]] = {k: [] for k in (
        "job", "service", "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns",
        "end_ns", "duration_ns", "status_code", "status_message", "rank", "step", "host", "pid",
        "attributes", "resource", "events", "links")}
    now = start_ns
    stopped: dict[int, int] = {}  # rank → the step it never finished
    for f in faults:
        if f.kind in ("hang", "error", "silent"):
            stopped[f.rank] = f.from_step
    span_counter = 0
    for step in range(steps):
        parts = {}
        other_cpu_ms = {}
        runqueue_ms = {}
        thread_cpu_ms = {}
        late_ms = {}  # time before the rank's step began, in no step (gil_between_steps)
        for rank in range(world):
            jitter = rng.normal(1.0, 0.02)
            if hiccups and rng.random() < hiccups:
                jitter += rng.uniform(0.2, 1.0)
            part = {"dataloader": 2.0 * jitter, "compute": base_ms * jitter, "gc": 0.0,
                    "pycall": 1.0 * jitter, "checkpoint": 0.0, "evaluation": 0.0}
            if step < len(warmup):
                part["compute"] += warmup[step] * (0.5 + rng.random())
            other_cpu = 0.5 * jitter  # the rank's other threads (exporter, gloo)
            runqueue = 0.2 * jitter + busy_host_ms  # the training thread waiting for a CPU
            idle = 0.0  # wall time of the step the training thread did not burn CPU for
            late = 0.0
            for f in faults:
                active = (f.rank in (rank, -1) and step >= f.from_step
                          and (f.to_step is None or step < f.to_step)
                          and (not f.every or (step - f.from_step) % f.every == 0))
                if not active:
                    continue
                if f.kind == "compute":
                    part["compute"] += f.extra_ms
                elif f.kind == "input":
                    part["dataloader"] += f.extra_ms
                elif f.kind == "gc":
                    part["gc"] += f.extra_ms
                elif f.kind in ("checkpoint", "evaluation"):
                    part[f.kind] += f.extra_ms
                elif f.kind == "cpu":
                    for key in part:
                        part[key] *= 1.0 + f.extra_ms / base_ms
                elif f.kind == "host":
                    # Another process on the host takes the rank's core: the training
                    # thread is runnable but waits for a CPU (run-queue time).
                    part["compute"] += f.extra_ms
                    runqueue += 0.9 * f.extra_ms
                    idle += f.extra_ms
                elif f.kind == "asleep":
                    # The training thread's compute sleeps longer, neither burning CPU nor
                    # waiting for one: the GIL held by a thread the busy host descheduled,
                    # page faults served from a busy disk.
                    part["compute"] += f.extra_ms
                    idle += f.extra_ms
                elif f.kind == "busy_compute":
                    # More compute on a busy host: the extra work waits for CPU slices
                    # too, so about half the excess is run-queue wait, half own CPU.
                    part["compute"] += f.extra_ms
                    runqueue += 0.52 * f.extra_ms
                    idle += 0.52 * f.extra_ms
                elif f.kind == "busy_thread":
                    # A GIL-holding thread: the training thread's ops wait for the GIL
                    # (compute grows alone) while the other thread burns the CPU.
                    if step not in f.missed:
                        part["compute"] += f.extra_ms
                        idle += f.extra_ms  # waiting for the GIL
                    other_cpu += f.extra_ms
                elif f.kind == "busy_thread_loaded":
                    # The same thread on a busy host: both of the rank's threads wait for
                    # CPU slices, so the training thread's excess is mostly run-queue
                    # wait, and the hog gets a part of the CPU it asks for.
                    part["compute"] += f.extra_ms
                    runqueue += 0.7 * f.extra_ms
                    idle += f.extra_ms
                    other_cpu += 0.3 * f.extra_ms
                elif f.kind == "gil_between_steps":
                    # A GIL holder that takes the GIL now and then (3 steps of 5): the
                    # training thread gets it back late as the last collective returns,
                    # so its next step begins late (in no step's time) and it reaches
                    # the collectives last, while its own time in the step barely grows;
                    # the thread burns the CPU in every step.
                    other_cpu += f.extra_ms
                    if (step - f.from_step) % 5 in (0, 2, 4):
                        part["compute"] += 0.05 * f.extra_ms
                        late += 0.95 * f.extra_ms
            parts[rank] = part
            late_ms[rank] = late
            other_cpu_ms[rank] = other_cpu
            runqueue_ms[rank] = runqueue
            thread_cpu_ms[rank] = sum(part.values()) - idle
        ready = {r: sum(p.values()) + late_ms[r] for r, p in parts.items()}
        live = [r for r in range(world) if stopped.get(r, 1 << 60) > step]
        if not live:
            break
        barrier = max(ready[r] for r in live)
        comm = comm_ms * (1.0 + sum(1.0 for f in faults if f.kind == "communication" and step >= f.from_step))
        number = step if step_numbers is None else step_numbers[step]
        trace_id = f"{sc.step_trace_id(job, number):032x}"
        for rank in live:
            wait = barrier - ready[rank] + comm
            duration_ms = barrier + comm - late_ms[rank]
            attrs = {
                sc.STEP: number,
                sc.STEP_DATALOADER_MS: round(parts[rank]["dataloader"], 3),
                sc.STEP_COMPUTE_MS: round(parts[rank]["compute"], 3),
                sc.STEP_OTHER_THREADS_CPU_MS: round(other_cpu_ms[rank], 3),
                sc.STEP_RUNQUEUE_MS: round(runqueue_ms[rank], 3),
                sc.STEP_THREAD_CPU_MS: round(thread_cpu_ms[rank], 3),
                sc.STEP_GC_MS: round(parts[rank]["gc"], 3),
                sc.STEP_PYCALL_MS: round(parts[rank]["pycall"], 3),
                sc.STEP_CHECKPOINT_MS: round(parts[rank]["checkpoint"], 3),
                sc.STEP_EVALUATION_MS: round(parts[rank]["evaluation"], 3),
                sc.STEP_COLLECTIVE_WAIT_MS: round(wait, 3),
                sc.STEP_COLLECTIVE_COUNT: 1,
                sc.STEP_PG_NAMES: ["0", *(n for n, m in (groups or {}).items() if rank in m)],
                sc.STEP_PG_WAIT_MS: [round(wait, 3)],
            }
            if bytes_per_step:
                attrs[sc.STEP_COLLECTIVE_BYTES] = bytes_per_step
            span_counter += 1
            _append(cols, job, trace_id, f"{span_counter:016x}", sc.SPAN_STEP,
                     now + int(late_ms[rank] * 1e6), int(duration_ms * 1e6), rank, number, attrs, world,
                     node=rank // node_size if node_size else None)
        for f in faults:
            if f.from_step == step and f.kind == "error":
                span_counter += 1
                _append(cols, job, trace_id, f"{span_counter:016x}", sc.SPAN_STEP, now,
                        int(ready[f.rank] * 1e6), f.rank, step,
                        {sc.STEP: step, sc.CODE_CALLSITE: "train.py:42 in load_shard"}, world,
                        status=2, events=[{"name": "exception", "time_ns": now, "attributes": {
                            sc.ERROR_TYPE: "RuntimeError", sc.ERROR_MESSAGE: "shard missing",
                            sc.ERROR_STACKTRACE: 'File "train.py", line 42, in load_shard'}}])
        now += int((barrier + comm) * 1e6) + 1_000_000
    return spans_table(cols)


def _append(cols, job, trace_id, span_id, name, start, duration, rank, step, attrs, world,
            status=0, events=(), node=None) -> None:
    resource = {sc.RANK: rank, sc.WORLD_SIZE: world, sc.JOB_ID: job}
    if node is not None:
        resource[sc.NODE_RANK] = node
    row = {
        "job": job, "service": job, "trace_id": trace_id, "span_id": span_id,
        "parent_span_id": "", "name": name, "kind": 1, "start_ns": start,
        "end_ns": start + duration, "duration_ns": duration, "status_code": status,
        "status_message": "", "rank": rank, "step": step, "host": "node0", "pid": 1000 + rank,
        "attributes": json.dumps(attrs),
        "resource": json.dumps(resource),
        "events": json.dumps(list(events)), "links": "[]",
    }
    for key, values in cols.items():
        values.append(row[key])
