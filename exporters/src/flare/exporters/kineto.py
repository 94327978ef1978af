"""Import PyTorch profiler (Kineto) traces into the Flare store as ordinary Flare spans.

    result = import_directory("traces/", "store.duckdb", job="llama-run-7")
    result.files_imported, result.spans, result.errors  # per-file errors, never raised

What becomes what (span names and attributes from `flare.instrumentation.semconv`):
- `ProfilerStep#N`          → `train.step` with `flare.step` = N
- GPU kernel/memcpy/memset  → `kernel` (category, stream, device, issue latency = GPU
                              start − CPU launch via the correlation id, launch time,
                              FLOPs from the launching operator's shapes, achieved TFLOPS
                              or GB/s), parent = the step whose CPU side launched it
- NCCL kernels              → also `collective.<op>` with PG, group size, bytes, dtype
                              from the kernel's own metadata (new traces) or the enclosing
                              `nccl:<op>` / `record_param_comms` operator (old traces)
- CPU-only traces           → top-level CPU operators become `kernel` spans on device
                              "cpu", the same shape as Flare's live CPU kernel windows
Traces without `ProfilerStep` import with NULL steps. One rank per file: the rank comes
from `distributedInfo.rank`, else a `rank<N>` in the file name, else 0.

The parser streams: it walks the top-level JSON object itself and decodes one trace
event at a time with the C scanner of `json`, keeping only the few fields Flare needs,
so memory grows with the number of kernels, not with the file's text. Gzip or plain.

Errors: a missing, corrupt or truncated file becomes one `FileResult.error` sentence
naming the file; the other files still import. A file's spans are written in one
transaction that first deletes what an earlier import of the same (job, rank) wrote,
so importing twice does not double the data and a failure leaves the store as it was.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flare.exporters import store
from flare.instrumentation import bandwidth, semconv
from flare.instrumentation import kernel_taxonomy as taxonomy

TRACE_SUFFIXES = (".json", ".json.gz")  # covers torch's *.pt.trace.json[.gz] names
# Text read and decoded per step of the parse: the events of one chunk exist as dicts
# at once (256 KB: ~1k events, ~5 MB less peak than 1 MB chunks, same speed).
_CHUNK = 1 << 18
_WS = " \t\n\r"
_WS_RE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_BOUNDARY = re.compile(r"\}[ \t\n\r]*,[ \t\n\r]*(?=\{)")  # `}, {` between two elements
_DECODER = json.JSONDecoder()
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_GPU_CAT_NAMES = {cat: cat for cat in _GPU_CATS}  # the one copy of each kept
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_SPAN_KIND_INTERNAL = 1


class TraceError(Exception):
    """A trace file that cannot be read; the message names the file and the problem."""


@dataclasses.dataclass
class FileResult:
    path: str
    rank: int | None = None
    spans: int = 0
    kernels: int = 0
    steps: int = 0
    error: str | None = None


@dataclasses.dataclass
class ImportResult:
    job: str
    store_path: str
    files: list[FileResult]

    @property
    def files_imported(self) -> int:
        return sum(1 for f in self.files if f.error is None)

    @property
    def spans(self) -> int:
        return sum(f.spans for f in self.files)

    @property
    def errors(self) -> list[str]:
        return [f.error for f in self.files if f.error is not None]


# ---------------------------------------------------------------- streaming JSON


class _StreamingTrace:
    """Top-level keys of a trace object, with `traceEvents` yielded one event at a time."""

    def __init__(self, text: io.TextIOBase, name: str) -> None:
        self._text = text
        self._name = name
        self._buf = ""
        self._pos = 0
        self._base = 0  # characters of the file before `_buf` (offsets in errors are the file's)
        self._eof = False
        self.meta: dict[str, Any] = {}

    def _fill(self) -> bool:
        if self._eof:
            return False
        chunk = self._text.read(_CHUNK)
        if not chunk:
            self._eof = True
            return False
        self._base += self._pos
        self._buf = self._buf[self._pos:] + chunk
        self._pos = 0
        return True

    def _peek(self) -> str:
        while True:
            buf, pos = self._buf, self._pos
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            self._pos = pos
            if pos < len(buf):
                return buf[pos]
            if not self._fill():
                raise TraceError(f"{self._name}: truncated (ends inside the JSON)")

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            found = self._buf[self._pos:self._pos + 20]
            # !a: a binary file's bytes stay escapes on the terminal
            raise TraceError(f"{self._name}: not a Kineto trace (expected {char!r}, found {found!a})")
        self._pos += 1

    def _value(self) -> Any:
        self._peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                near_end = len(self._buf) - exc.pos <= 64 or exc.msg.startswith("Unterminated")
                if near_end and self._fill():
                    continue
                if near_end:
                    raise TraceError(f"{self._name}: truncated (ends inside the JSON)") from None
                raise TraceError(f"{self._name}: corrupt JSON at offset {self._base + exc.pos}: "
                                 f"{exc.msg}") from None
            if end >= len(self._buf) and not self._eof and self._fill():
                continue  # a number may continue in the next chunk
            self._pos = end
            return value

    def _array_items(self) -> Iterator[dict[str, Any]]:
        """The elements of the array being read (the hot loop).

        Each chunk's whole elements are decoded in one `json.loads` call: the elements up
        to the chunk's last `}` that a `,` and a `{` follow. Should that guess be wrong
        (the `}` inside a string or a nested object), the text does not parse as a list
        and the chunk goes element by element with the C scanner instead, which also
        says where a corrupt element is; a list it does parse is exactly the elements
        the scanner would have read. One call per chunk instead of one per element:
        ~40 % less time on a GPU trace's ~100k small events.
        """
        scan = _DECODER.scan_once
        while True:
            buf = self._buf
            size = len(buf)
            pos = _WS_RE.match(buf, self._pos).end()
            boundary = _last_boundary(buf, pos, size)
            if boundary is not None:
                try:
                    batch = json.loads("[" + buf[pos:boundary[0]] + "]")
                except (json.JSONDecodeError, RecursionError):
                    batch = None  # the element-by-element scan below reads the chunk
                if batch is not None:
                    for value in batch:
                        if isinstance(value, dict):
                            yield value
                    del batch
                    pos = boundary[1]
            while pos < size:
                try:
                    value, end = scan(buf, pos)
                except StopIteration as stop:
                    # The scanner reports where it failed, possibly deep inside the event.
                    failed_at = stop.value if isinstance(stop.value, int) else pos
                    if size - failed_at > 64:
                        raise TraceError(f"{self._name}: corrupt JSON in traceEvents at "
                                         f"offset {self._base + failed_at}") from None
                    break  # a literal cut by the chunk boundary
                except json.JSONDecodeError as exc:
                    if size - exc.pos > 64 and not exc.msg.startswith("Unterminated"):
                        raise TraceError(f"{self._name}: corrupt JSON at offset {self._base + exc.pos}: "
                                         f"{exc.msg}") from None
                    break  # an element cut by the chunk boundary
                separator = _SEPARATOR.match(buf, end)
                if separator is None:
                    if _WS_RE.match(buf, end).end() < size:
                        raise TraceError(f"{self._name}: corrupt JSON in traceEvents")
                    break  # the separator is in the next chunk
                if isinstance(value, dict):
                    yield value
                pos = separator.end()
                if separator.group(1) == "]":
                    self._pos = pos
                    return
            self._pos = pos
            if not self._fill():
                raise TraceError(f"{self._name}: truncated (ends inside traceEvents)")

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield every trace event; top-level keys land in `meta` as they are passed.

        The legacy profiler (torch < 1.8) wrote the Chrome trace "array format": the
        top level is the event list itself.
        """
        if self._peek() == "[":
            self._pos += 1
            if self._peek() == "]":
                return
            yield from self._array_items()
            return
        self._expect("{")
        if self._peek() == "}":
            return
        while True:
            key = self._value()
            self._expect(":")
            if key == "traceEvents":
                self._expect("[")
                if self._peek() == "]":
                    self._pos += 1
                else:
                    yield from self._array_items()
            else:
                self.meta[key] = self._value()
            char = self._peek()
            at = self._base + self._pos
            self._pos += 1
            if char == "}":
                return
            if char != ",":
                raise TraceError(f"{self._name}: corrupt JSON at offset {at}: expected ',' or "
                                 f"'}}' after a top-level value, found {char!r}")


def _last_boundary(buf: str, pos: int, size: int) -> tuple[int, int] | None:
    """(end of the last element, start of the next) that `buf[pos:size]` shows whole,
    judged by the text alone (`json.loads` then checks), or None."""
    cut = size
    for _ in range(64):
        cut = buf.rfind("}", pos, cut)
        if cut < 0:
            return None
        match = _BOUNDARY.match(buf, cut)
        if match is not None:
            return cut + 1, match.end()
    return None


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as raw:
        magic = raw.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


# ---------------------------------------------------------------- one trace → rows


@dataclasses.dataclass(slots=True)
class _Gpu:
    name: str
    cat: str
    ts: float
    dur: float
    stream: int
    device: int
    correlation: int
    external_id: int | None
    args: dict[str, Any]


@dataclasses.dataclass(slots=True)
class _Op:
    tid: Any
    ts: float
    end: float
    name: str
    args: dict[str, Any]


class _Collector:
    """Keeps what the spans need from each event; everything else is dropped on sight."""

    def __init__(self) -> None:
        self.gpu: list[_Gpu] = []
        self.launches: dict[int, tuple[float, Any, float]] = {}  # correlation → (ts, tid, dur)
        self.steps: list[tuple[float, float, int]] = []  # (ts, end, N)
        self.comm_ops: list[_Op] = []
        self.flop_ops: list[_Op] = []
        self.cpu_ops: list[_Op] = []  # kept only while no GPU activity has been seen
        self.pid: int | None = None
        # One object per distinct kernel name and thread id: tens of thousands of events
        # repeat a few hundred, and each kept copy would pin memory the parse frees.
        self._shared: dict[Any, Any] = {}
        # The trace's top-level keys as parsed so far: `deviceProperties` usually comes
        # before the events and says GPU activity follows, so CPU operators need no copy.
        self.meta: dict[str, Any] = {}

    def add(self, event: dict[str, Any]) -> None:
        if event.get("ph") != "X":
            return
        cat = event.get("cat")
        args = event.get("args") or {}
        if cat in _GPU_CATS:
            if self.cpu_ops:
                self.cpu_ops = []
            name = event.get("name", "")
            self.gpu.append(_Gpu(
                self._shared.setdefault(name, name), _GPU_CAT_NAMES[cat], event["ts"],
                event.get("dur", 0),
                _int(args.get("stream"), -1), _int(args.get("device"), _int(event.get("pid"), 0)),
                _int(args.get("correlation"), -1), _int(args.get("External id"), None),
                _gpu_args(cat, args),
            ))
            return
        if cat in _LAUNCH_CATS:
            correlation = args.get("correlation")
            if correlation is not None:
                tid = event.get("tid")
                self.launches[int(correlation)] = (event["ts"], self._shared.setdefault(tid, tid),
                                                   event.get("dur", 0))
            return
        name = event.get("name", "")
        ts = event.get("ts", 0)
        end = ts + event.get("dur", 0)
        if self.pid is None and isinstance(event.get("pid"), int):
            self.pid = event["pid"]
        if name.startswith("ProfilerStep"):
            match = _STEP_RE.match(name)
            if match:
                self.steps.append((ts, end, int(match.group(1))))
            return
        if name.startswith("nccl:") or name == "record_param_comms":
            self.comm_ops.append(_Op(event.get("tid"), ts, end, name, _op_args(args)))
            return
        if cat != "cpu_op":
            return
        if name in taxonomy.FLOP_OPS:
            self.flop_ops.append(_Op(event.get("tid"), ts, end, name, _op_args(args)))
        if not self.gpu and not self.meta.get("deviceProperties"):
            self.cpu_ops.append(_Op(event.get("tid"), ts, end, name, _op_args(args)))


def _int(value: Any, default: int | None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


_COMM_KEYS = ("Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype",
              "Process Group Name", "Process Group Description", "Process Group Ranks", "Seq")


_NO_ARGS: dict[str, Any] = {}  # shared by the kernels without communication metadata; never mutated


def _gpu_args(cat: str, args: dict[str, Any]) -> dict[str, Any]:
    if cat == "gpu_memcpy" or cat == "gpu_memset":
        return {"bytes": args.get("bytes")}
    return {k: args[k] for k in _COMM_KEYS if k in args} or _NO_ARGS


def _op_args(args: dict[str, Any]) -> dict[str, Any]:
    kept = {k: args[k] for k in _COMM_KEYS if k in args}
    for key in ("Input Dims", "Input type", "External id"):
        if key in args:
            kept[key] = args[key]
    return kept


class _Innermost:
    """Innermost operator of one kind enclosing a CPU time point, per thread."""

    def __init__(self, ops: list[_Op]) -> None:
        self._by_tid: dict[Any, tuple[list[float], list[_Op]]] = {}
        for op in sorted(ops, key=lambda o: o.ts):
            starts, items = self._by_tid.setdefault(op.tid, ([], []))
            starts.append(op.ts)
            items.append(op)

    def find(self, tid: Any, ts: float) -> _Op | None:
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


def read_trace(path: str | os.PathLike[str], job: str) -> TraceSpans:
    """Parse one Kineto trace into Flare span rows; raises TraceError naming the file."""
    path = Path(path)
    name = str(path)
    collector = _Collector()
    # The parse allocates ~10 containers per event and frees most at once: the cyclic
    # collector's passes over them would cost ~25 % more time and find nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _open_text(path) as text:
            trace = _StreamingTrace(text, name)
            collector.meta = trace.meta
            for event in trace.events():
                collector.add(event)
    except FileNotFoundError:
        raise TraceError(f"{name}: no such file") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{name}: corrupt or truncated gzip ({exc})") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{name}: not a Kineto trace ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise TraceError(f"{name}: cannot read ({exc.strerror or exc})") from None
    finally:
        if collecting:
            gc.enable()
    meta = trace.meta
    if "schemaVersion" not in meta and not collector.steps and not collector.gpu \
            and not collector.cpu_ops:
        raise TraceError(f"{name}: not a Kineto trace (no schemaVersion and no events)")
    return _to_spans(collector, meta, path, job)


def _rank_of(meta: dict[str, Any], path: Path) -> tuple[int, int | None]:
    info = meta.get("distributedInfo") or {}
    world = _int(info.get("world_size"), None)
    rank = _int(info.get("rank"), None)
    if rank is None:
        match = _RANK_IN_NAME.search(path.name)
        rank = int(match.group(1)) if match else 0
    return rank, world


def _to_spans(c: _Collector, meta: dict[str, Any], path: Path, job: str) -> TraceSpans:
    base_ns = _int(meta.get("baseTimeNanoseconds"), 0) or 0

    def ns(ts_us: float) -> int:
        # Epoch microseconds (~1.7e15) times 1000 is past float precision: scale the
        # integer part exactly and round only the fraction.
        whole = int(ts_us)
        return base_ns + whole * 1000 + round((ts_us - whole) * 1000)

    rank, world = _rank_of(meta, path)
    devices = {d.get("id"): d.get("name") for d in meta.get("deviceProperties") or []}
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
    flop_by_external = {op.args.get("External id"): op for op in c.flop_ops
                        if op.args.get("External id") is not None}
    comm_lookup = _Innermost(c.comm_ops)

    # First pass: which operator launched each compute kernel, so an operator's FLOPs are
    # split across the GEMM/attention kernels it launched (split-K launches two).
    launched: list[tuple[_Gpu, tuple[float, Any, float] | None, str, _Op | None]] = []
    kernels_per_op: dict[int, int] = {}
    for gpu in c.gpu:
        launch = c.launches.get(gpu.correlation)
        category = taxonomy.categorize(gpu.name) if gpu.cat == "kernel" else (
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
            flops = taxonomy.op_flops(op.name, op.args.get("Input Dims") or [])
            if flops:
                flops //= kernels_per_op.get(id(op), 1)
                attributes[semconv.KERNEL_FLOPS] = flops
                if seconds > 0:
                    attributes[semconv.KERNEL_ACHIEVED_TFLOPS] = round(flops / seconds / 1e12, 3)
                attributes[semconv.KERNEL_SHAPE] = json.dumps(op.args.get("Input Dims"))
                types = [t for t in op.args.get("Input type") or [] if t and t != "Scalar"]
                if types:
                    attributes[semconv.KERNEL_DTYPE] = types[-1]
        nbytes = gpu.args.get("bytes")
        if nbytes is not None:
            attributes[semconv.KERNEL_BYTES] = int(nbytes)
            if seconds > 0:
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


def _collective_attributes(gpu: _Gpu, comm: _Op | None, start: int, end: int,
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
    nelems = _int(meta.get(shard_key), None)
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
        attributes[semconv.COLL_SEQ] = _int(meta["Seq"], None)
    ranks = meta.get("Process Group Ranks")
    if isinstance(ranks, str):  # recorded as text: "[0, 1]"
        try:
            ranks = json.loads(ranks)
        except ValueError:
            ranks = None
    if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks):
        attributes[semconv.COLL_GROUP_RANKS] = ranks
    group_size = _int(meta.get("Group size"), None)
    if group_size:
        attributes[semconv.COLL_GROUP_SIZE] = group_size
    if dtype:
        attributes[semconv.COLL_DTYPE] = str(dtype)
    width = taxonomy.dtype_bytes(str(dtype)) if dtype else None
    if nelems and width:
        nbytes = nelems * width
        attributes[semconv.COLL_BYTES] = nbytes
        if seconds > 0 and group_size:
            factor = bandwidth.bus_factor(op, group_size)
            attributes[semconv.COLL_BUSBW_GBPS] = round(nbytes / seconds / 1e9 * factor, 3)
    return attributes


def _cpu_operator_spans(c: _Collector, rows: _Rows, ns, step_of, step_span_ids) -> None:
    """CPU-only trace: top-level operators per thread, as the live CPU windows record."""
    by_tid: dict[Any, list[_Op]] = {}
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
                semconv.KERNEL_CATEGORY: taxonomy.categorize(op.name),
                semconv.KERNEL_DEVICE: semconv.KERNEL_DEVICE_HOST,
                semconv.KERNEL_STREAM: _int(tid, 0),
                semconv.KERNEL_SOURCE: "kineto",
            }
            flops = taxonomy.op_flops(op.name, op.args.get("Input Dims") or [])
            if flops:
                attributes[semconv.KERNEL_FLOPS] = flops
                seconds = (op.end - op.ts) * 1e-6
                if seconds > 0:
                    attributes[semconv.KERNEL_ACHIEVED_TFLOPS] = round(flops / seconds / 1e12, 6)
            rows.add(name=semconv.SPAN_KERNEL,
                     span_id=_hex_id(rows.job, rows.rank, "cpu", tid, op.ts, op.name),
                     parent=step_span_ids.get(step, "") if step is not None else "",
                     step=step, start=ns(op.ts), end=ns(op.end), attributes=attributes)
            rows.cpu_kernels += 1


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
        self.attributes.append(attributes if name == semconv.SPAN_STEP else json.dumps(attributes))

    def columns(self, resource: dict[str, Any], pid: int | None) -> dict[str, list[Any]]:
        n = len(self.names)
        trace_ids = [
            f"{semconv.step_trace_id(self.job, s):032x}" if s is not None else self._unstepped_trace
            for s in self.steps
        ]
        resource_json = json.dumps(resource)
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
            "attributes": [a if isinstance(a, str) else json.dumps(a) for a in self.attributes],
            "resource": [resource_json] * n,
            "events": ["[]"] * n,
            "links": ["[]"] * n,
        }


# ---------------------------------------------------------------- directory → store


# The store's columns as (name, SQL type), read without loading pyarrow where the store
# module offers them so (the import needs neither Arrow nor its ~25 MB).
_SPAN_SQL_COLUMNS: tuple[tuple[str, str], ...] = getattr(store, "SPAN_SQL_COLUMNS", None) or tuple(
    (name, sql) for name, sql, *_ in store.SPAN_COLUMNS)
_INT_SQL = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT"}
_CSV_BLOCK = 1024  # rows formatted at a time


class _RowFile:
    """A file's span rows as CSV text in a private temporary file, for DuckDB's reader.

    The rows leave Python before DuckDB opens the store: their memory (and the parse's)
    goes back to the allocator DuckDB then draws from, and neither numpy nor pyarrow is
    loaded (on ws16_rank0 the import peaks at ~105 MB instead of ~118 with a numpy
    batch). The text is unambiguous: every string is quoted (a quote doubled), a NULL is
    an empty unquoted field, and DuckDB reads quoted fields as values (never NULL) with
    each column's type given, so each value is the one the row held.
    """

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        self.rows = len(columns["name"]) if columns else 0
        self._dir = tempfile.mkdtemp(prefix="flare-kineto-")
        self.path = os.path.join(self._dir, "spans.csv")
        self.longest = 0
        try:
            with open(self.path, "w", encoding="utf-8", newline="") as out:
                for start in range(0, self.rows, _CSV_BLOCK):
                    fields = [_csv_fields(columns[name][start:start + _CSV_BLOCK], sql in _INT_SQL)
                              for name, sql in _SPAN_SQL_COLUMNS]
                    lines = [",".join(row) for row in zip(*fields, strict=True)]
                    self.longest = max(self.longest, max(map(len, lines)))
                    out.write("\n".join(lines))
                    out.write("\n")
        except BaseException:
            self.remove()
            raise
        columns.clear()

    def insert_into(self, con) -> int:
        """`INSERT INTO spans` the rows (inside the caller's transaction)."""
        if self.rows == 0:
            return 0
        names = ", ".join(name for name, _ in _SPAN_SQL_COLUMNS)
        types = ", ".join(f"'{name}': '{sql}'" for name, sql in _SPAN_SQL_COLUMNS)
        # A line is at most `longest` characters, up to 4 bytes each in UTF-8; small read
        # buffers (128 KB for ws16_rank0) keep the reader's memory small (-3 MB against 2 MB).
        line_bytes = max(1 << 16, 4 * self.longest + 16)
        con.execute(
            f"INSERT INTO spans ({names}) SELECT {names} FROM read_csv(?, header = false, "
            f"auto_detect = false, delim = ',', quote = '\"', escape = '\"', new_line = '\\n', "
            f"columns = {{{types}}}, allow_quoted_nulls = false, strict_mode = true, "
            f"max_line_size = {line_bytes}, buffer_size = {2 * line_bytes})", [self.path])
        return self.rows

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def _csv_fields(values: list[Any], integer: bool) -> list[str]:
    if integer:
        return ["" if v is None else str(int(v)) for v in values]
    return ["" if v is None else '"' + str(v).replace('"', '""') + '"' for v in values]


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files of a directory (or the one file given), in name order."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir()
                  if p.is_file() and p.name.endswith(TRACE_SUFFIXES))


def import_directory(path: str | os.PathLike[str], store_path: str | os.PathLike[str],
                     job: str | None = None) -> ImportResult:
    """Import every trace file under `path` (or `path` itself) into the store.

    Raises TraceError only when `path` itself is missing or holds no trace file; problems
    with single files are reported in the result and the other files still import.
    """
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    files = trace_files(path)
    if not files:
        raise TraceError(f"{path}: no Kineto trace files (*.json, *.json.gz)")
    job = job or (path.stem.removesuffix(".json") if path.is_file() else path.resolve().name)
    result = ImportResult(job=job, store_path=str(store_path), files=[])
    seen_ranks: dict[int, str] = {}
    for file in files:
        entry = FileResult(path=str(file))
        result.files.append(entry)
        try:
            spans = read_trace(file, job)
        except TraceError as exc:
            entry.error = str(exc)
            continue
        entry.rank = spans.rank
        if spans.rank in seen_ranks:
            entry.error = (f"{file}: rank {spans.rank} was already imported from "
                           f"{seen_ranks[spans.rank]}; one rank per file")
            continue
        seen_ranks[spans.rank] = str(file)
        row_file = _RowFile(spans.columns)  # the rows leave Python before DuckDB opens
        try:
            with store.writer(store_path) as con:
                # One thread: the insert and its checkpoint peak ~10 MB lower, for a few
                # thousand rows per file no slower.
                con.execute("SET threads = 1")
                con.execute("BEGIN TRANSACTION")
                try:
                    con.execute("DELETE FROM spans WHERE job = ? AND rank = ?", [job, spans.rank])
                    rows = row_file.insert_into(con)
                    con.execute("COMMIT")
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
        finally:
            row_file.remove()
        entry.spans, entry.kernels, entry.steps = rows, spans.kernels, spans.steps
    return result
