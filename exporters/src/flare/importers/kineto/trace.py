"""One Kineto trace → Flare span rows (columns in the store's span layout).

What becomes what is in the package's docstring (`flare.importers.kineto`). Events it
cannot use are skipped and counted by reason; what it keeps is costed against
`Limits.max_memory`.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import gzip
import hashlib
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

from flare.importers.kineto.events import (
    INT32_MAX,
    MALFORMED,
    SCALARS,
    Collector,
    Gpu,
    Op,
    OverBudget,
    int_or,
)
from flare.importers.kineto.json_stream import StreamingTrace, open_text
from flare.importers.kineto.limits import Limits, TraceError, format_size
from flare.wire import bandwidth, semconv
from flare.wire import kernel_taxonomy as taxonomy

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_SPAN_KIND_INTERNAL = 1
# baseTimeNanoseconds at most 2^62 keeps every nanosecond time in BIGINT (event times
# are bounded in events.py).
_MAX_BASE_NS = 1 << 62
# Rates (TFLOPS, GB/s) only over at least a picosecond: a denormal duration would make
# them infinite, which JSON cannot hold.
_MIN_SECONDS = 1e-12
# Kernel and operator names are categorized by their first 4 KiB (real names reach ~2 KB):
# the taxonomy's regular expressions take time quadratic in a crafted name's length.
_CATEGORIZE_CHARS = 4096


class _Innermost:
    """Innermost operator of one kind enclosing a CPU time point, per thread."""

    def __init__(self, ops: list[Op]) -> None:
        self._by_tid: dict[Any, tuple[list[float], list[Op]]] = {}
        for op in sorted(ops, key=lambda o: o.ts):
            starts, items = self._by_tid.setdefault(op.tid, ([], []))
            starts.append(op.ts)
            items.append(op)

    def find(self, tid: Any, ts: float) -> Op | None:
        entry = self._by_tid.get(tid)
        if entry is None:
            return None
        starts, items = entry
        index = bisect.bisect_right(starts, ts) - 1
        # Walk back over siblings that ended before `ts`; nesting depth is small.
        for candidate in range(index, max(index - 64, -1), -1):
            if items[candidate].end >= ts:
                return items[candidate]
        return None


def _hex_id(*parts: object, size: int = 8) -> str:
    raw = "\x00".join(map(str, parts)).encode()
    return hashlib.blake2b(raw, digest_size=size).hexdigest()


@dataclasses.dataclass
class TraceSpans:
    """The span rows of one trace file, columnar, in the store's span columns."""

    rank: int
    world_size: int | None
    gpu_model: str | None
    columns: dict[str, list[Any]]
    kernels: int
    steps: int
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # events, by reason


def read_trace(path: str | os.PathLike[str], job: str, limits: Limits | None = None) -> TraceSpans:
    """Parse one Kineto trace into Flare span rows; raises TraceError naming the file.

    `limits` bounds what the file may cost (default `Limits()`); events it cannot use
    are skipped and counted in `TraceSpans.skipped`.
    """
    path = Path(path)
    name = str(path)
    limits = limits or Limits()
    collector = Collector(limits.max_memory)
    # The parse allocates ~10 containers per event and frees most at once: the cyclic
    # collector's passes over them would cost ~25 % more time and find nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with open_text(path, limits) as text:
            trace = StreamingTrace(text, name, limits)
            collector.meta = trace.meta
            add, skip = collector.add, collector.skip
            for event in trace.events():
                try:
                    add(event)
                except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                    skip(MALFORMED)  # what the checks in `add` did not foresee
    except TraceError:
        raise
    except OverBudget:
        raise TraceError(f"{name}: its spans would take more than {format_size(limits.max_memory)} "
                         f"of memory (2 × the per-file limit, --max-file-size)") from None
    except FileNotFoundError:
        raise TraceError(f"{name}: no such file") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{name}: corrupt or truncated gzip ({brief(exc)})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceError(f"{name}: not a Kineto trace ({type(exc).__name__}: {brief(exc)})") from None
    except OSError as exc:
        raise TraceError(f"{name}: cannot read ({exc.strerror or brief(exc)})") from None
    except RecursionError:
        raise TraceError(f"{name}: JSON nested too deep (deeper than Python's decoder reads)") from None
    except MemoryError:
        raise TraceError(f"{name}: out of memory reading the trace (lower --max-file-size)") from None
    finally:
        if collecting:
            gc.enable()
    meta = trace.meta
    if "schemaVersion" not in meta and not collector.steps and not collector.gpu \
            and not collector.cpu_ops:
        raise TraceError(f"{name}: not a Kineto trace (no schemaVersion and no events)")
    skipped = dict(collector.skipped)
    for reason, count in trace.skipped.items():
        skipped[reason] = skipped.get(reason, 0) + count
    try:
        spans = _to_spans(collector, meta, path, job)
    except TraceError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError,
            ZeroDivisionError, RecursionError) as exc:  # a combination the checks missed
        raise TraceError(f"{name}: cannot convert ({type(exc).__name__}: {brief(exc)})") from None
    spans.skipped = skipped
    return spans


def brief(exc: BaseException) -> str:
    """An exception's message as one short printable line."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = ascii(text)[1:-1]
    return text if len(text) <= 200 else text[:200] + "…"


def _rank_of(meta: dict[str, Any], path: Path) -> tuple[int, int | None]:
    """(rank, world size) of a file; a rank outside 0..2^31-1 (the store's INTEGER) is
    refused: guessing one would mix this file's spans into another rank's."""
    info = meta.get("distributedInfo")
    if type(info) is not dict:
        info = {}
    world = int_or(info.get("world_size"), None)
    if world is not None and not 0 < world <= INT32_MAX:
        world = None
    raw = info.get("rank")
    try:
        rank = int(raw)  # a number past INTEGER is refused below, not replaced
    except (TypeError, ValueError, OverflowError):
        rank = None
    if rank is None:
        match = _RANK_IN_NAME.search(path.name)
        raw = match.group(1) if match else "0"
        rank = int(raw) if len(raw) <= 18 else None
    if rank is None or not 0 <= rank <= INT32_MAX:
        shown = ascii(str(raw))[1:-1][:40]
        raise TraceError(f"{path}: rank {shown} is out of range (0..{INT32_MAX})")
    return rank, world


def _devices(meta: dict[str, Any]) -> dict[Any, str]:
    """deviceProperties as {device id: GPU model}, malformed entries left out."""
    devices: dict[Any, str] = {}
    properties = meta.get("deviceProperties")
    for device in properties if type(properties) is list else ():
        if type(device) is dict and type(device.get("id")) in SCALARS \
                and type(device.get("name")) is str:
            devices[device["id"]] = device["name"]
    return devices


def _to_spans(c: Collector, meta: dict[str, Any], path: Path, job: str) -> TraceSpans:
    try:
        base_ns = int(meta.get("baseTimeNanoseconds") or 0)
    except (TypeError, ValueError, OverflowError):
        base_ns = 0  # not a number: the times are taken as they are
    if not 0 <= base_ns <= _MAX_BASE_NS:
        shown = ascii(str(meta.get("baseTimeNanoseconds")))[1:-1][:40]
        raise TraceError(f"{path}: baseTimeNanoseconds {shown} is out of range (0..2^62)")

    def ns(ts_us: float) -> int:
        # Epoch microseconds (~1.7e15) times 1000 is past float precision: scale the
        # integer part exactly and round only the fraction.
        whole = int(ts_us)
        return base_ns + whole * 1000 + round((ts_us - whole) * 1000)

    rank, world = _rank_of(meta, path)
    devices = _devices(meta)
    rows = _Rows(job, rank)

    steps = sorted(c.steps)
    step_starts = [s[0] for s in steps]
    step_span_ids: dict[int, str] = {}
    for ts, end, number in steps:
        span_id = _hex_id(job, rank, "step", number)
        step_span_ids[number] = span_id
        rows.add(name=semconv.SPAN_STEP, span_id=span_id, parent="", step=number,
                 start=ns(ts), end=ns(end),
                 attributes={semconv.STEP: number, semconv.STEP_DETAIL: True})

    def step_of(ts: float | None) -> int | None:
        if ts is None:
            return None
        index = bisect.bisect_right(step_starts, ts) - 1
        if index >= 0 and ts <= steps[index][1]:
            return steps[index][2]
        return None

    flop_lookup = _Innermost(c.flop_ops)
    flop_by_external = {op.args["External id"]: op for op in c.flop_ops
                        if op.args.get("External id") is not None
                        and type(op.args["External id"]) in SCALARS}
    comm_lookup = _Innermost(c.comm_ops)

    # First pass: which operator launched each compute kernel, so an operator's FLOPs are
    # split across the GEMM/attention kernels it launched (split-K launches two).
    launched: list[tuple[Gpu, tuple[float, Any, float] | None, str, Op | None]] = []
    kernels_per_op: dict[int, int] = {}
    for gpu in c.gpu:
        launch = c.launches.get(gpu.correlation)
        category = taxonomy.categorize(gpu.name[:_CATEGORIZE_CHARS]) if gpu.cat == "kernel" else (
            taxonomy.MEMCPY if gpu.cat == "gpu_memcpy" else taxonomy.MEMSET)
        op = None
        if category in (taxonomy.GEMM, taxonomy.ATTENTION):
            op = flop_by_external.get(gpu.external_id)
            if op is None and launch is not None:
                op = flop_lookup.find(launch[1], launch[0])
            if op is not None:
                kernels_per_op[id(op)] = kernels_per_op.get(id(op), 0) + 1
        launched.append((gpu, launch, category, op))

    step_comm: dict[int, list[int]] = {}
    gpu_model_used: str | None = None
    for index, (gpu, launch, category, op) in enumerate(launched):
        start, end = ns(gpu.ts), ns(gpu.ts + gpu.dur)
        step = step_of(launch[0]) if launch else None
        parent = step_span_ids.get(step, "") if step is not None else ""
        model = devices.get(gpu.device)
        gpu_model_used = gpu_model_used or model
        attributes: dict[str, Any] = {
            semconv.KERNEL_NAME: gpu.name,
            semconv.KERNEL_CATEGORY: category,
            semconv.KERNEL_STREAM: gpu.stream,
            semconv.KERNEL_DEVICE: gpu.device,
            semconv.KERNEL_CORRELATION: gpu.correlation,
            semconv.KERNEL_SOURCE: "kineto",
        }
        if launch is not None:
            attributes[semconv.KERNEL_LAUNCH_NS] = ns(launch[0])
            attributes[semconv.KERNEL_ISSUE_LATENCY_US] = round(gpu.ts - launch[0], 3)
            attributes[semconv.KERNEL_LAUNCH_DUR_US] = round(launch[2], 3)
        seconds = gpu.dur * 1e-6
        if op is not None:
            dims = op.args.get("Input Dims") or []
            flops = taxonomy.op_flops(op.name, dims)
            if flops:
                flops //= kernels_per_op.get(id(op), 1)
                attributes[semconv.KERNEL_FLOPS] = flops
                if seconds >= _MIN_SECONDS:
                    attributes[semconv.KERNEL_ACHIEVED_TFLOPS] = round(flops / seconds / 1e12, 3)
                attributes[semconv.KERNEL_SHAPE] = json.dumps(dims)
                types = [t for t in op.args.get("Input type") or [] if t and t != "Scalar"]
                if types:
                    attributes[semconv.KERNEL_DTYPE] = types[-1]
        nbytes = gpu.args.get("bytes")
        if nbytes is not None:
            attributes[semconv.KERNEL_BYTES] = int(nbytes)
            if seconds >= _MIN_SECONDS:
                attributes[semconv.KERNEL_ACHIEVED_GBPS] = round(int(nbytes) / seconds / 1e9, 3)
        rows.add(name=semconv.SPAN_KERNEL, span_id=_hex_id(job, rank, "kernel", index),
                 parent=parent, step=step, start=start, end=end, attributes=attributes)
        if category == taxonomy.COMMUNICATION:
            comm = comm_lookup.find(launch[1], launch[0]) if launch else None
            coll = _collective_attributes(gpu, comm, start, end, seconds)
            rows.add(name=semconv.collective_span_name(coll[semconv.COLL_OP]),
                     span_id=_hex_id(job, rank, "collective", index), parent=parent,
                     step=step, start=start, end=end, attributes=coll)
            if step is not None:
                counts = step_comm.setdefault(step, [0, 0])
                counts[0] += 1
                counts[1] += coll.get(semconv.COLL_BYTES, 0)

    if not c.gpu:
        _cpu_operator_spans(c, rows, ns, step_of, step_span_ids)

    for number, (count, nbytes) in step_comm.items():
        row = rows.step_row.get(number)
        if row is not None:
            rows.attributes[row][semconv.STEP_COLLECTIVE_COUNT] = count
            rows.attributes[row][semconv.STEP_COLLECTIVE_BYTES] = nbytes

    resource = {
        semconv.SERVICE_NAME: job, semconv.JOB_ID: job, semconv.RANK: rank,
        semconv.JOB_SOURCE: semconv.JOB_SOURCE_KINETO, "flare.source.file": path.name,
    }
    if world is not None:
        resource[semconv.WORLD_SIZE] = world
    if c.pid is not None:
        resource[semconv.PROCESS_PID] = c.pid
    if gpu_model_used:
        resource[semconv.GPU_MODEL] = gpu_model_used
    columns = rows.columns(resource, c.pid)
    return TraceSpans(rank, world, gpu_model_used, columns, kernels=len(c.gpu) or rows.cpu_kernels,
                      steps=len(steps))


def _collective_attributes(gpu: Gpu, comm: Op | None, start: int, end: int,
                           seconds: float) -> dict[str, Any]:
    meta = dict(comm.args) if comm is not None else {}
    meta.update(gpu.args)  # the kernel's own metadata (newer traces) wins
    op = taxonomy.collective_op(str(meta.get("Collective name", "")))
    if op is None and comm is not None and comm.name.startswith("nccl:"):
        op = taxonomy.collective_op(comm.name)
    op = op or taxonomy.collective_op(gpu.name) or "unknown"
    dtype = meta.get("dtype")
    # Bytes per rank as Flare's live collectives count them (flare.instrumentation.
    # bandwidth): the shard for all-gather (its input) and reduce-scatter (its output).
    shard_key = "Out msg nelems" if op == "reduce_scatter" else "In msg nelems"
    nelems = int_or(meta.get(shard_key), None)
    if nelems is None and comm is not None and comm.args.get("Input Dims"):
        nelems = 0
        for dims in comm.args["Input Dims"]:
            count = 1
            for size in dims or [0]:
                count *= size
            nelems += count if dims else 0
        types = comm.args.get("Input type") or []
        dtype = dtype or (types[0] if types else None)
    attributes: dict[str, Any] = {
        semconv.COLL_OP: op, semconv.COLL_BACKEND: "nccl", semconv.COLL_SOURCE: "kineto",
        semconv.COLL_DEVICE_START_NS: start, semconv.COLL_DEVICE_END_NS: end,
    }
    if meta.get("Process Group Name") is not None:
        attributes[semconv.COLL_PG] = str(meta["Process Group Name"])
    if meta.get("Process Group Description"):
        attributes[semconv.COLL_PG_DESC] = str(meta["Process Group Description"])
    if meta.get("Seq") is not None:
        attributes[semconv.COLL_SEQ] = int_or(meta["Seq"], None)
    ranks = meta.get("Process Group Ranks")
    if isinstance(ranks, str):  # recorded as text: "[0, 1]"
        try:
            ranks = json.loads(ranks)
        except (ValueError, RecursionError):
            ranks = None
    if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks):
        attributes[semconv.COLL_GROUP_RANKS] = ranks
    group_size = int_or(meta.get("Group size"), None)
    if group_size:
        attributes[semconv.COLL_GROUP_SIZE] = group_size
    if dtype:
        attributes[semconv.COLL_DTYPE] = str(dtype)
    width = taxonomy.dtype_bytes(str(dtype)) if dtype else None
    if nelems and width:
        nbytes = nelems * width
        attributes[semconv.COLL_BYTES] = nbytes
        if seconds >= _MIN_SECONDS and group_size:
            factor = bandwidth.bus_factor(op, group_size)
            attributes[semconv.COLL_BUSBW_GBPS] = round(nbytes / seconds / 1e9 * factor, 3)
    return attributes


def _cpu_operator_spans(c: Collector, rows: _Rows, ns, step_of, step_span_ids) -> None:
    """CPU-only trace: top-level operators per thread, as the live CPU windows record."""
    by_tid: dict[Any, list[Op]] = {}
    for op in c.cpu_ops:
        by_tid.setdefault(op.tid, []).append(op)
    for tid, ops in by_tid.items():
        ops.sort(key=lambda o: (o.ts, -o.end))
        outer_end = float("-inf")
        for op in ops:
            if op.ts < outer_end:
                continue  # nested inside the previous top-level operator
            outer_end = op.end
            step = step_of(op.ts)
            attributes: dict[str, Any] = {
                semconv.KERNEL_NAME: op.name,
                semconv.KERNEL_CATEGORY: taxonomy.categorize(op.name[:_CATEGORIZE_CHARS]),
                semconv.KERNEL_DEVICE: semconv.KERNEL_DEVICE_HOST,
                semconv.KERNEL_STREAM: int_or(tid, 0),
                semconv.KERNEL_SOURCE: "kineto",
            }
            flops = taxonomy.op_flops(op.name, op.args.get("Input Dims") or [])
            if flops:
                attributes[semconv.KERNEL_FLOPS] = flops
                seconds = (op.end - op.ts) * 1e-6
                if seconds >= _MIN_SECONDS:
                    attributes[semconv.KERNEL_ACHIEVED_TFLOPS] = round(flops / seconds / 1e12, 6)
            rows.add(name=semconv.SPAN_KERNEL,
                     span_id=_hex_id(rows.job, rows.rank, "cpu", tid, op.ts, op.name),
                     parent=step_span_ids.get(step, "") if step is not None else "",
                     step=step, start=ns(op.ts), end=ns(op.end), attributes=attributes)
            rows.cpu_kernels += 1


def _dumps(value: Any) -> str:
    """JSON text of a row's attributes. A lone surrogate (a trace's "\\ud800") would be
    JSON that DuckDB refuses to read, failing every later query of the job: it becomes
    "?". Only text holding a `\\ud` escape is looked at twice."""
    text = json.dumps(value)
    return text if "\\ud" not in text else json.dumps(_no_lone_surrogates(value))


def _no_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_no_lone_surrogates(k): _no_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_lone_surrogates(v) for v in value]
    return value


class _Rows:
    def __init__(self, job: str, rank: int) -> None:
        self.job, self.rank = job, rank
        self.names: list[str] = []
        self.span_ids: list[str] = []
        self.parents: list[str] = []
        self.steps: list[int | None] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        # JSON text, encoded as each row arrives (its dict is freed at once); a step's
        # stays a dict until `columns()`, for the collective totals added at the end.
        self.attributes: list[dict[str, Any] | str] = []
        self.step_row: dict[int, int] = {}
        self.cpu_kernels = 0
        self._unstepped_trace = f"{semconv.step_trace_id(job, -1 - rank):032x}"

    def add(self, *, name: str, span_id: str, parent: str, step: int | None, start: int,
            end: int, attributes: dict[str, Any]) -> None:
        if name == semconv.SPAN_STEP and step is not None:
            self.step_row[step] = len(self.names)
        self.names.append(name)
        self.span_ids.append(span_id)
        self.parents.append(parent)
        self.steps.append(step)
        self.starts.append(start)
        self.ends.append(end)
        self.attributes.append(attributes if name == semconv.SPAN_STEP else _dumps(attributes))

    def columns(self, resource: dict[str, Any], pid: int | None) -> dict[str, list[Any]]:
        n = len(self.names)
        trace_ids = [
            f"{semconv.step_trace_id(self.job, s):032x}" if s is not None else self._unstepped_trace
            for s in self.steps
        ]
        resource_json = _dumps(resource)
        return {
            "job": [self.job] * n,
            "service": [self.job] * n,
            "trace_id": trace_ids,
            "span_id": self.span_ids,
            "parent_span_id": self.parents,
            "name": self.names,
            "kind": [_SPAN_KIND_INTERNAL] * n,
            "start_ns": self.starts,
            "end_ns": self.ends,
            "duration_ns": [e - s for s, e in zip(self.starts, self.ends, strict=True)],
            "status_code": [0] * n,
            "status_message": [""] * n,
            "rank": [self.rank] * n,
            "step": self.steps,
            "host": [None] * n,
            "pid": [pid] * n,
            "attributes": [a if isinstance(a, str) else _dumps(a) for a in self.attributes],
            "resource": [resource_json] * n,
            "events": ["[]"] * n,
            "links": ["[]"] * n,
        }
