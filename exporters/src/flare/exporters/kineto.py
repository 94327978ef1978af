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

The parser streams, in time linear in the text: it walks the top-level JSON object
itself and decodes the trace events a chunk holds with the C decoder of `json`, a value
spanning chunks with a scan that never rereads text, keeping only the few fields Flare
needs, so memory grows with the number of kernels, not with the file's text. Gzip or
plain. `Limits` bounds each file: decompressed bytes (2 GiB), one string (1 MiB), one
event (16 MiB), the memory its spans keep (2 × the bytes).

Errors: a missing, corrupt, truncated, too deep or too large file, or one whose rank is
outside INTEGER, becomes one `FileResult.error` sentence naming the file; the other
files still import. An event with a NaN, infinite or absurd time, a field of the wrong
type or a string past the limit is skipped and counted (`FileResult.skipped_events`).
A file's spans are written in one transaction that first deletes what an earlier import
of the same (job, rank) wrote, so importing twice does not double the data and a failure
leaves the store as it was.
"""

from __future__ import annotations

import bisect
import contextlib
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
_WS_RE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_BOUNDARY = re.compile(r"\}[ \t\n\r]*,[ \t\n\r]*(?=\{)")  # `}, {` between two elements
# What the scan of a value spanning chunks steps over in one regex call: text outside
# strings up to the next quote or bracket; a string's text up to its quote or next escape;
# a number or literal.
_OUTSIDE = re.compile(r'[^"{}\[\]]*')
_IN_STRING = re.compile(r'[^"\\]*')
_SCALAR = re.compile(r'[^"{}\[\],:\s]*')
_DECODER = json.JSONDecoder()
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_GPU_CAT_NAMES = {cat: cat for cat in _GPU_CATS}  # the one copy of each kept
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
# The top-level keys the import reads; the others are parsed and dropped.
_META_KEYS = frozenset({"schemaVersion", "distributedInfo", "deviceProperties", "baseTimeNanoseconds"})
_SPAN_KIND_INTERNAL = 1
_INT32_MAX = (1 << 31) - 1
# Event times are microseconds; |ts| and |ts + dur| at most 4e15 (year 2096 as epoch
# microseconds) and baseTimeNanoseconds at most 2^62 keep every nanosecond time in BIGINT.
_MAX_US = 4e15
_MAX_BASE_NS = 1 << 62
# Rates (TFLOPS, GB/s) only over at least a picosecond: a denormal duration would make
# them infinite, which JSON cannot hold.
_MIN_SECONDS = 1e-12
# Kernel and operator names are categorized by their first 4 KiB (real names reach ~2 KB):
# the taxonomy's regular expressions take time quadratic in a crafted name's length.
_CATEGORIZE_CHARS = 4096
_KIB, _MIB, _GIB = 1 << 10, 1 << 20, 1 << 30


class TraceError(Exception):
    """A trace file that cannot be read; the message names the file and the problem."""


def format_size(size: int) -> str:
    for unit, name in ((_GIB, "GiB"), (_MIB, "MiB"), (_KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def parse_size(text: str) -> int:
    """`2G`, `2GiB`, `512M`, `64k` (binary units) or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([kKmMgG])(?:i?B)?|B)?\s*", text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 2G, 512M, 65536)")
    number, unit = int(match.group(1)), (match.group(2) or "").lower()
    return number * {"": 1, "k": _KIB, "m": _MIB, "g": _GIB}[unit]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one trace file may cost, so that a broken or hostile file is refused in
    bounded time and memory instead of stalling or exhausting the import.

    max_bytes: JSON bytes read from one file (decompressed, for gzip); past it the file is
        skipped.
    max_string: characters of one JSON string or number as written; an event holding a
        longer one is skipped and counted, a top-level value holding one is ignored.
        The text of one event (or top-level value) is capped at 16 × max_string
        characters, its over-long strings not counted; past it the file is skipped.

    What a file keeps for its spans (kernels, launches, steps, operators, at an
    estimated ~0.2-0.8 KB each until stored) is capped at 2 × max_bytes (`max_memory`):
    past it the file is skipped. Real traces keep ~0.5-1.1 × their JSON size; a trace
    of nothing but minimal kernel events would otherwise take ~20 ×.
    """

    max_bytes: int = 2 * _GIB
    max_string: int = _MIB

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError("max_bytes (--max-file-size) must be positive")
        if self.max_string < _KIB:
            raise ValueError("max_string (--max-string) must be at least 1 KiB")

    @property
    def max_event(self) -> int:
        return 16 * self.max_string

    @property
    def max_memory(self) -> int:
        return 2 * self.max_bytes


@dataclasses.dataclass
class FileResult:
    path: str
    rank: int | None = None
    spans: int = 0
    kernels: int = 0
    steps: int = 0
    error: str | None = None
    # Events left out of an imported file, by reason: "with a non-finite or out-of-range time".
    skipped_events: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def warning(self) -> str | None:
        """One line on the events skipped, or None."""
        if not self.skipped_events:
            return None
        total = sum(self.skipped_events.values())
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(
            self.skipped_events.items(), key=lambda item: -item[1]))
        return f"{total} event(s) of {self.path}: {reasons}"


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

    @property
    def warnings(self) -> list[str]:
        return [f.warning for f in self.files if f.error is None and f.warning]


# ---------------------------------------------------------------- streaming JSON


_SKIP = object()  # a value left out: it holds a string longer than Limits.max_string


class _StreamingTrace:
    """Top-level keys of a trace object, with `traceEvents` yielded one event at a time.

    Time linear in the text and memory bounded by `Limits`: each chunk is decoded in
    one call (or one per element) by the C decoder of `json`; a value that a chunk holds
    only part of is read to its end by `_long_value`, which looks at each character once
    and never rescans or regrows a buffer.
    """

    def __init__(self, text: io.TextIOBase, name: str, limits: Limits | None = None) -> None:
        self._text = text
        self._name = name
        self._limits = limits or Limits()
        # A chunk no longer than max_string: a string a chunk holds whole is within the cap.
        self._chunk = max(1, min(_CHUNK, self._limits.max_string))
        self._buf = ""
        self._pos = 0
        self._base = 0  # characters of the file before `_buf` (offsets in errors are the file's)
        self._eof = False
        self._seen = False  # anything but whitespace
        self.meta: dict[str, Any] = {}
        self.skipped: dict[str, int] = {}  # events left out, by reason

    def _fill(self) -> bool:
        """Read the next chunk; called once `_buf` is consumed (so nothing is copied)."""
        if self._eof:
            return False
        chunk = self._text.read(self._chunk)
        if not chunk:
            self._eof = True
            return False
        self._base += self._pos
        self._buf = self._buf[self._pos:] + chunk
        self._pos = 0
        return True

    def _peek(self) -> str:
        while True:
            pos = _WS_RE.match(self._buf, self._pos).end()
            self._pos = pos
            if pos < len(self._buf):
                self._seen = True
                return self._buf[pos]
            if not self._fill():
                if not self._seen:
                    raise TraceError(f"{self._name}: not a Kineto trace (empty or only whitespace)")
                raise TraceError(f"{self._name}: truncated (ends inside the JSON)")

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            found = self._buf[self._pos:self._pos + 20]
            # !a: a binary file's bytes stay escapes on the terminal
            raise TraceError(f"{self._name}: not a Kineto trace (expected {char!r}, found {found!a})")
        self._pos += 1

    def _corrupt(self, at: int, what: str) -> TraceError:
        return TraceError(f"{self._name}: corrupt JSON at offset {at}: {what}")

    def _undecodable(self, exc: Exception, at: int) -> TraceError:
        """RecursionError or a ValueError other than a syntax error, at offset `at`."""
        if isinstance(exc, RecursionError):
            return TraceError(f"{self._name}: JSON nested too deep at offset {at} "
                              f"(deeper than Python's decoder reads)")
        return self._corrupt(at, "a number too long to read")  # int's 4300-digit limit

    def _value(self) -> Any:
        """The JSON value at the next non-blank character (a top-level key or value)."""
        self._peek()
        buf, pos = self._buf, self._pos
        try:
            value, end = _DECODER.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if len(buf) - exc.pos > 64 and not exc.msg.startswith("Unterminated"):
                raise self._corrupt(self._base + exc.pos, exc.msg) from None
            return self._long_value()  # the value goes on in the next chunk
        except (RecursionError, ValueError) as exc:
            raise self._undecodable(exc, self._base + pos) from None
        if end >= len(buf) and not self._eof:
            return self._long_value()  # a number may go on in the next chunk
        self._pos = end
        return value

    def _long_value(self) -> Any:
        """The JSON value at `_pos`, read across as many chunks as it spans, or _SKIP.

        One regex call steps over a run of text between quotes and brackets (or a
        string's characters up to its closing quote or an escape); a loop step handles
        each quote, bracket and escape. The text is kept as pieces, joined and decoded
        once at the end; a string past max_string stops the keeping (the value is
        _SKIP), a value past max_event outside such strings stops the file.
        """
        max_string, max_event = self._limits.max_string, self._limits.max_event
        buf, pos = self._buf, self._pos
        start = self._base + pos  # the value's offset in the file
        pieces: list[str] | None = []
        scalar = buf[pos] not in '{["'
        depth = 0
        in_string = False
        string_from = 0  # offset of the current string's opening quote
        long_chars = 0  # characters of the strings past max_string that have ended
        i = pos
        while True:
            base, size = self._base, len(buf)
            end = -1
            if scalar:
                i = _SCALAR.match(buf, i).end()
                if i < size:
                    end = i
            else:
                while i < size:
                    if in_string:
                        i = _IN_STRING.match(buf, i).end()
                        if i >= size:
                            break
                        if buf[i] == "\\":
                            i += 2  # may land past the chunk: the escaped character is next
                            continue
                        i += 1
                        in_string = False
                        length = base + i - string_from
                        if length - 2 > max_string:
                            long_chars += length
                            pieces = None
                        if depth == 0:
                            end = i
                            break
                        continue
                    i = _OUTSIDE.match(buf, i).end()
                    if i >= size:
                        break
                    char = buf[i]
                    i += 1
                    if char == '"':
                        in_string = True
                        string_from = base + i - 1
                    elif char == "{" or char == "[":
                        depth += 1
                    else:
                        depth -= 1
                        if depth <= 0:
                            end = i
                            break
            stop = end if end >= 0 else size
            scanned = base + stop - start
            current = 0  # characters of a string (or number) past max_string still going on
            if scalar:
                if scanned > max_string:
                    current = scanned
                    pieces = None
            elif in_string and base + size - string_from - 1 > max_string:
                current = base + size - string_from
                pieces = None
            if pieces is not None:
                pieces.append(buf[pos:stop])
            if scanned - long_chars - current > max_event:
                raise TraceError(f"{self._name}: a trace event or value of more than "
                                 f"{format_size(max_event)} at offset {start} "
                                 f"(16 × the string limit, --max-string)")
            if end >= 0:
                break
            chunk = self._text.read(self._chunk)
            if not chunk:
                self._eof = True
                raise TraceError(f"{self._name}: truncated (ends inside the JSON)")
            self._base = base + size
            i -= size  # past 0 where an escape's second character opens this chunk
            buf, pos = chunk, 0
        self._buf, self._pos = buf, end
        if pieces is None:
            return _SKIP
        text = "".join(pieces)
        del pieces
        try:
            value, used = _DECODER.raw_decode(text)
        except json.JSONDecodeError as exc:
            raise self._corrupt(start + exc.pos, exc.msg) from None
        except (RecursionError, ValueError) as exc:
            raise self._undecodable(exc, start) from None
        if used != len(text):
            raise self._corrupt(start + used, "unexpected text after a value")
        return value

    def _skip_event(self) -> None:
        reason = f"with a string over {format_size(self._limits.max_string)} (--max-string)"
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _array_items(self) -> Iterator[dict[str, Any]]:
        """The elements of the array being read (the hot loop).

        Each chunk's whole elements are decoded in one `json.loads` call: the elements up
        to the chunk's last `}` that a `,` and a `{` follow. Should that guess be wrong
        (the `}` inside a string or a nested object), the text does not parse as a list
        and the chunk goes element by element with the C scanner instead, which also
        says where a corrupt element is; a list it does parse is exactly the elements
        the scanner would have read. One call per chunk instead of one per element:
        ~40 % less time on a GPU trace's ~100k small events. The element the chunk ends
        inside is read on by `_long_value`.
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
                except (ValueError, RecursionError):
                    batch = None  # the element-by-element scan below reads the chunk
                if batch is not None:
                    for value in batch:
                        if type(value) is dict:
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
                        raise self._corrupt(self._base + exc.pos, exc.msg) from None
                    break  # an element cut by the chunk boundary
                except (RecursionError, ValueError) as exc:
                    raise self._undecodable(exc, self._base + pos) from None
                separator = _SEPARATOR.match(buf, end)
                if separator is None:
                    if _WS_RE.match(buf, end).end() < size:
                        raise TraceError(f"{self._name}: corrupt JSON in traceEvents at "
                                         f"offset {self._base + end}")
                    break  # the separator is in the next chunk
                if type(value) is dict:
                    yield value
                pos = separator.end()
                if separator.group(1) == "]":
                    self._pos = pos
                    return
            self._pos = pos
            if pos < size:  # an element the chunk holds the start of
                value = self._long_value()
                if value is _SKIP:
                    self._skip_event()
                elif type(value) is dict:
                    yield value
                char = self._peek()
                at = self._base + self._pos
                self._pos += 1
                if char == "]":
                    return
                if char != ",":
                    raise self._corrupt(at, f"expected ',' or ']' after an element, found {char!a}")
            elif not self._fill():
                raise TraceError(f"{self._name}: truncated (ends inside traceEvents)")

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield every trace event; the top-level keys Flare reads land in `meta` as
        they are passed.

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
                value = self._value()  # _SKIP for a string past the cap: left out
                if type(key) is str and key in _META_KEYS and value is not _SKIP:
                    self.meta[key] = value
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


class _Capped(io.RawIOBase):
    """The bytes of a file (decompressed, for gzip), refused past `limit`."""

    def __init__(self, stream: io.BufferedIOBase, limit: int, name: str, gzipped: bool) -> None:
        super().__init__()
        self._stream, self._limit, self._name, self._gzipped = stream, limit, name, gzipped
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self._stream.readinto(buffer)
        self.total += count
        if self.total > self._limit:
            what = "decompresses to" if self._gzipped else "holds"
            raise TraceError(f"{self._name}: {what} more than {format_size(self._limit)} "
                             f"(the per-file limit, --max-file-size)")
        return count

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            super().close()


def _open_text(path: Path, limits: Limits) -> io.TextIOBase:
    with open(path, "rb") as raw:
        magic = raw.read(2)
    gzipped = magic == b"\x1f\x8b"
    # Closed with the text stream (by `_Capped.close`).
    stream = gzip.open(path, "rb") if gzipped else open(path, "rb", buffering=0)  # noqa: SIM115
    capped = _Capped(stream, limits.max_bytes, str(path), gzipped)
    return io.TextIOWrapper(io.BufferedReader(capped, 1 << 16), encoding="utf-8", errors="replace")


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


_BAD_TIME = "with a non-finite or out-of-range time"
_BAD_STEP = "with a ProfilerStep number out of range"
_MALFORMED = "with a field missing or of the wrong type"
_SCALARS = (str, int, float, bool, type(None))
_MAX_DIM = 1 << 40  # one tensor dimension in `Input Dims`
_INT64 = (1 << 63) - 1


class _OverBudget(Exception):
    """The events kept would take more memory than Limits.max_memory."""


# What one kept item costs, in bytes, until its span row is in the store (measured on a
# trace of minimal kernel events: ~0.8 KB per kernel with its row); an operator's input
# shapes and types add per entry.
_KERNEL_COST, _LAUNCH_COST, _OP_COST, _SHAPE_COST, _TYPE_COST = 800, 200, 300, 200, 64


class _Collector:
    """Keeps what the spans need from each event; everything else is dropped on sight.

    An event it cannot use (a time that is NaN, infinite or out of range, a step number
    past BIGINT, a field of the wrong type) is skipped and counted in `skipped`, by
    reason; the rest of the file still imports. A time is checked by comparing it with
    ±_MAX_US, which NaN fails and which raises TypeError for anything but a number:
    `read_trace` counts what `add` raises as a malformed event. What is kept is costed
    (`cost`, bytes); past `max_cost` it raises _OverBudget.
    """

    def __init__(self, max_cost: int = Limits().max_memory) -> None:
        self.cost, self.max_cost = 0, max_cost
        self.gpu: list[_Gpu] = []
        self.launches: dict[int, tuple[float, Any, float]] = {}  # correlation → (ts, tid, dur)
        self.steps: list[tuple[float, float, int]] = []  # (ts, end, N)
        self.comm_ops: list[_Op] = []
        self.flop_ops: list[_Op] = []
        self.cpu_ops: list[_Op] = []  # kept only while no GPU activity has been seen
        self._cpu_cost = 0  # of cpu_ops, given back when they are dropped
        self.pid: int | None = None
        self.skipped: dict[str, int] = {}
        # One object per distinct kernel name and thread id: tens of thousands of events
        # repeat a few hundred, and each kept copy would pin memory the parse frees.
        self._shared: dict[Any, Any] = {}
        # The trace's top-level keys as parsed so far: `deviceProperties` usually comes
        # before the events and says GPU activity follows, so CPU operators need no copy.
        self.meta: dict[str, Any] = {}

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _spend(self, cost: int) -> None:
        self.cost += cost
        if self.cost > self.max_cost:
            raise _OverBudget

    def add(self, event: dict[str, Any]) -> None:
        if event.get("ph") != "X":
            return
        cat = event.get("cat")
        if type(cat) is not str:
            cat = None
        args = event.get("args")
        if type(args) is not dict:
            args = _NO_ARGS
        if cat in _GPU_CATS:
            ts, dur, name = event["ts"], event.get("dur", 0), event.get("name", "")
            if not (-_MAX_US <= ts <= _MAX_US and -_MAX_US <= ts + dur <= _MAX_US):
                return self.skip(_BAD_TIME)
            if type(name) is not str:
                return self.skip(_MALFORMED)
            if self.cpu_ops:
                self.cost -= self._cpu_cost
                self.cpu_ops, self._cpu_cost = [], 0
            self.cost += _KERNEL_COST  # `_spend`, inline for the two commonest kinds
            if self.cost > self.max_cost:
                raise _OverBudget
            self.gpu.append(_Gpu(
                self._shared.setdefault(name, name), _GPU_CAT_NAMES[cat], ts, dur,
                _int(args.get("stream"), -1), _int(args.get("device"), _int(event.get("pid"), 0)),
                _int(args.get("correlation"), -1), _int(args.get("External id"), None),
                _gpu_args(cat, args),
            ))
            return
        if cat in _LAUNCH_CATS:
            correlation = args.get("correlation")
            if correlation is not None:
                ts, dur, tid = event["ts"], event.get("dur", 0), event.get("tid")
                if not (-_MAX_US <= ts <= _MAX_US and -_MAX_US <= ts + dur <= _MAX_US):
                    return self.skip(_BAD_TIME)
                if type(tid) not in _SCALARS:
                    tid = None
                self.cost += _LAUNCH_COST
                if self.cost > self.max_cost:
                    raise _OverBudget
                self.launches[int(correlation)] = (ts, self._shared.setdefault(tid, tid), dur)
            return
        name = event.get("name", "")
        if self.pid is None:
            pid = event.get("pid")
            if type(pid) is int and 0 <= pid <= _INT32_MAX:
                self.pid = pid
        if name.startswith("ProfilerStep"):
            match = _STEP_RE.match(name)
            if match:
                ts, dur = event.get("ts", 0), event.get("dur", 0)
                if not (-_MAX_US <= ts <= _MAX_US and -_MAX_US <= ts + dur <= _MAX_US):
                    return self.skip(_BAD_TIME)
                if len(match.group(1)) > 18:  # past BIGINT (and int()'s digit limit)
                    return self.skip(_BAD_STEP)
                self._spend(_OP_COST)
                self.steps.append((ts, ts + dur, int(match.group(1))))
            return
        comm = name.startswith("nccl:") or name == "record_param_comms"
        if not comm and cat != "cpu_op":
            return
        flop = not comm and name in taxonomy.FLOP_OPS
        cpu = not comm and not self.gpu and not self.meta.get("deviceProperties")
        if not (comm or flop or cpu):
            return
        ts, dur, tid = event.get("ts", 0), event.get("dur", 0), event.get("tid")
        if not (-_MAX_US <= ts <= _MAX_US and -_MAX_US <= ts + dur <= _MAX_US):
            return self.skip(_BAD_TIME)
        if type(tid) not in _SCALARS:
            tid = None
        kept = _op_args(args)
        cost = (_OP_COST + _SHAPE_COST * len(kept.get("Input Dims", ()))
                + _TYPE_COST * len(kept.get("Input type", ())))
        self._spend(cost * (2 if flop and cpu else 1))
        op = _Op(tid, ts, ts + dur, name, kept)
        if comm:
            self.comm_ops.append(op)
            return
        if flop:
            self.flop_ops.append(op)
        if cpu:
            self.cpu_ops.append(op)
            self._cpu_cost += cost


def _int(value: Any, default: int | None) -> int | None:
    """`int(value)` within BIGINT, else `default` (NaN, infinity, text, past BIGINT)."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return number if -_INT64 <= number <= _INT64 else default


_COMM_KEYS = ("Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype",
              "Process Group Name", "Process Group Description", "Process Group Ranks", "Seq")


_NO_ARGS: dict[str, Any] = {}  # shared by the kernels without communication metadata; never mutated


def _comm_args(args: dict[str, Any]) -> dict[str, Any]:
    """The communication keys whose values are plain: a scalar, or for the group's ranks
    a list of integers (or its text)."""
    kept = {}
    for key in _COMM_KEYS:
        if key in args:
            value = args[key]
            if type(value) in _SCALARS or (key == "Process Group Ranks" and type(value) is list
                                           and all(type(r) is int for r in value)):
                kept[key] = value
    return kept


def _gpu_args(cat: str, args: dict[str, Any]) -> dict[str, Any]:
    if cat == "gpu_memcpy" or cat == "gpu_memset":
        return {"bytes": _int(args.get("bytes"), None)}
    return _comm_args(args) or _NO_ARGS


def _input_dims(dims: Any) -> list[Any]:
    """`Input Dims` as a list of shapes, a shape that is not up to 16 integers in 0..2^40
    replaced by [] (positions stay); [] when it is not a list."""
    if type(dims) is not list:
        return []
    return [d if type(d) is list and len(d) <= 16
            and all(type(x) is int and 0 <= x <= _MAX_DIM for x in d) else [] for d in dims]


def _op_args(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments an operator span may need, checked: communication keys with plain
    values, `Input Dims` as shapes of integers, `Input type` as strings."""
    kept = _comm_args(args)
    if "Input Dims" in args:
        kept["Input Dims"] = _input_dims(args["Input Dims"])
    types = args.get("Input type")
    if type(types) is list and all(type(t) is str for t in types):
        kept["Input type"] = types
    if "External id" in args:
        kept["External id"] = args["External id"]
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
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # events, by reason


def read_trace(path: str | os.PathLike[str], job: str, limits: Limits | None = None) -> TraceSpans:
    """Parse one Kineto trace into Flare span rows; raises TraceError naming the file.

    `limits` bounds what the file may cost (default `Limits()`); events it cannot use
    are skipped and counted in `TraceSpans.skipped`.
    """
    path = Path(path)
    name = str(path)
    limits = limits or Limits()
    collector = _Collector(limits.max_memory)
    # The parse allocates ~10 containers per event and frees most at once: the cyclic
    # collector's passes over them would cost ~25 % more time and find nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _open_text(path, limits) as text:
            trace = _StreamingTrace(text, name, limits)
            collector.meta = trace.meta
            add, skip = collector.add, collector.skip
            for event in trace.events():
                try:
                    add(event)
                except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                    skip(_MALFORMED)  # what the checks in `add` did not foresee
    except TraceError:
        raise
    except _OverBudget:
        raise TraceError(f"{name}: its spans would take more than {format_size(limits.max_memory)} "
                         f"of memory (2 × the per-file limit, --max-file-size)") from None
    except FileNotFoundError:
        raise TraceError(f"{name}: no such file") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{name}: corrupt or truncated gzip ({_brief(exc)})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceError(f"{name}: not a Kineto trace ({type(exc).__name__}: {_brief(exc)})") from None
    except OSError as exc:
        raise TraceError(f"{name}: cannot read ({exc.strerror or _brief(exc)})") from None
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
        raise TraceError(f"{name}: cannot convert ({type(exc).__name__}: {_brief(exc)})") from None
    spans.skipped = skipped
    return spans


def _brief(exc: BaseException) -> str:
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
    world = _int(info.get("world_size"), None)
    if world is not None and not 0 < world <= _INT32_MAX:
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
    if rank is None or not 0 <= rank <= _INT32_MAX:
        shown = ascii(str(raw))[1:-1][:40]
        raise TraceError(f"{path}: rank {shown} is out of range (0..{_INT32_MAX})")
    return rank, world


def _devices(meta: dict[str, Any]) -> dict[Any, str]:
    """deviceProperties as {device id: GPU model}, malformed entries left out."""
    devices: dict[Any, str] = {}
    properties = meta.get("deviceProperties")
    for device in properties if type(properties) is list else ():
        if type(device) is dict and type(device.get("id")) in _SCALARS \
                and type(device.get("name")) is str:
            devices[device["id"]] = device["name"]
    return devices


def _to_spans(c: _Collector, meta: dict[str, Any], path: Path, job: str) -> TraceSpans:
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
                        and type(op.args["External id"]) in _SCALARS}
    comm_lookup = _Innermost(c.comm_ops)

    # First pass: which operator launched each compute kernel, so an operator's FLOPs are
    # split across the GEMM/attention kernels it launched (split-K launches two).
    launched: list[tuple[_Gpu, tuple[float, Any, float] | None, str, _Op | None]] = []
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
        except (ValueError, RecursionError):
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
        if seconds >= _MIN_SECONDS and group_size:
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
                semconv.KERNEL_CATEGORY: taxonomy.categorize(op.name[:_CATEGORIZE_CHARS]),
                semconv.KERNEL_DEVICE: semconv.KERNEL_DEVICE_HOST,
                semconv.KERNEL_STREAM: _int(tid, 0),
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
            with open(self.path, "w", encoding="utf-8", errors="replace", newline="") as out:
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
                     job: str | None = None, limits: Limits | None = None,
                     create_directory: bool = False) -> ImportResult:
    """Import every trace file under `path` (or `path` itself) into the store.

    Raises TraceError only when `path` itself is missing or holds no trace file; a file
    that cannot be read (or breaks `limits`, default `Limits()`) gets one error line in
    the result, its rank's spans already stored stay, and the other files still import.
    The store's directory must exist unless `create_directory`.
    """
    import duckdb  # loaded with the store module already

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
            spans = read_trace(file, job, limits)
        except TraceError as exc:
            entry.error = str(exc)
            continue
        except Exception as exc:  # one file's surprise must not stop the others
            entry.error = f"{file}: cannot import ({type(exc).__name__}: {_brief(exc)})"
            continue
        entry.rank, entry.skipped_events = spans.rank, spans.skipped
        if spans.rank in seen_ranks:
            entry.error = (f"{file}: rank {spans.rank} was already imported from "
                           f"{seen_ranks[spans.rank]}; one rank per file")
            continue
        seen_ranks[spans.rank] = str(file)
        row_file = _RowFile(spans.columns)  # the rows leave Python before DuckDB opens
        try:
            with store.writer(store_path, create_directory=create_directory) as con:
                # One thread: the insert and its checkpoint peak ~10 MB lower, for a few
                # thousand rows per file no slower.
                con.execute("SET threads = 1")
                con.execute("BEGIN TRANSACTION")
                try:
                    con.execute("DELETE FROM spans WHERE job = ? AND rank = ?", [job, spans.rank])
                    rows = row_file.insert_into(con)
                    con.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(duckdb.Error):  # a failed COMMIT ended it
                        con.execute("ROLLBACK")
                    raise
        except (duckdb.ConversionException, duckdb.InvalidInputException,
                duckdb.OutOfRangeException) as exc:  # this file's values; the store is as it was
            entry.error = f"{file}: the store refused its spans ({_brief(exc)})"
            continue
        finally:
            row_file.remove()
        entry.spans, entry.kernels, entry.steps = rows, spans.kernels, spans.steps
    return result
