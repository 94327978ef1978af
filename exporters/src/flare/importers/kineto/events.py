"""Reading a Kineto trace's events: what the spans need from each, kept within a memory
budget, and everything else dropped on sight (`Collector`). The arguments kept are
checked here (plain scalars, shapes of integers), so `trace.py` turns them into spans
without re-checking."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from flare.importers.kineto.limits import Limits
from flare.wire import kernel_taxonomy as taxonomy

_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_GPU_CAT_NAMES = {cat: cat for cat in _GPU_CATS}  # the one copy of each kept
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")
INT32_MAX = (1 << 31) - 1
# Event times are microseconds; |ts| and |ts + dur| at most 4e15 (year 2096 as epoch
# microseconds).
_MAX_US = 4e15


@dataclasses.dataclass(slots=True)
class Gpu:
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
class Op:
    tid: Any
    ts: float
    end: float
    name: str
    args: dict[str, Any]


_BAD_TIME = "with a non-finite or out-of-range time"
_BAD_STEP = "with a ProfilerStep number out of range"
MALFORMED = "with a field missing or of the wrong type"
SCALARS = (str, int, float, bool, type(None))
_MAX_DIM = 1 << 40  # one tensor dimension in `Input Dims`
_INT64 = (1 << 63) - 1


class OverBudget(Exception):
    """The events kept would take more memory than Limits.max_memory."""


# What one kept item costs, in bytes, until its span row is in the store (measured on a
# trace of minimal kernel events: ~0.8 KB per kernel with its row); an operator's input
# shapes and types add per entry.
_KERNEL_COST, _LAUNCH_COST, _OP_COST, _SHAPE_COST, _TYPE_COST = 800, 200, 300, 200, 64


class Collector:
    """Keeps what the spans need from each event; everything else is dropped on sight.

    An event it cannot use (a time that is NaN, infinite or out of range, a step number
    past BIGINT, a field of the wrong type) is skipped and counted in `skipped`, by
    reason; the rest of the file still imports. A time is checked by comparing it with
    ±_MAX_US, which NaN fails and which raises TypeError for anything but a number:
    `read_trace` counts what `add` raises as a malformed event. What is kept is costed
    (`cost`, bytes); past `max_cost` it raises OverBudget.
    """

    def __init__(self, max_cost: int = Limits().max_memory) -> None:
        self.cost, self.max_cost = 0, max_cost
        self.gpu: list[Gpu] = []
        self.launches: dict[int, tuple[float, Any, float]] = {}  # correlation → (ts, tid, dur)
        self.steps: list[tuple[float, float, int]] = []  # (ts, end, N)
        self.comm_ops: list[Op] = []
        self.flop_ops: list[Op] = []
        self.cpu_ops: list[Op] = []  # kept only while no GPU activity has been seen
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
            raise OverBudget

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
                return self.skip(MALFORMED)
            if self.cpu_ops:
                self.cost -= self._cpu_cost
                self.cpu_ops, self._cpu_cost = [], 0
            self._spend(_KERNEL_COST)
            self.gpu.append(Gpu(
                self._shared.setdefault(name, name), _GPU_CAT_NAMES[cat], ts, dur,
                int_or(args.get("stream"), -1), int_or(args.get("device"), int_or(event.get("pid"), 0)),
                int_or(args.get("correlation"), -1), int_or(args.get("External id"), None),
                _gpu_args(cat, args),
            ))
            return
        if cat in _LAUNCH_CATS:
            correlation = args.get("correlation")
            if correlation is not None:
                ts, dur, tid = event["ts"], event.get("dur", 0), event.get("tid")
                if not (-_MAX_US <= ts <= _MAX_US and -_MAX_US <= ts + dur <= _MAX_US):
                    return self.skip(_BAD_TIME)
                if type(tid) not in SCALARS:
                    tid = None
                self._spend(_LAUNCH_COST)
                self.launches[int(correlation)] = (ts, self._shared.setdefault(tid, tid), dur)
            return
        name = event.get("name", "")
        if self.pid is None:
            pid = event.get("pid")
            if type(pid) is int and 0 <= pid <= INT32_MAX:
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
        if type(tid) not in SCALARS:
            tid = None
        kept = _op_args(args)
        cost = (_OP_COST + _SHAPE_COST * len(kept.get("Input Dims", ()))
                + _TYPE_COST * len(kept.get("Input type", ())))
        self._spend(cost * (2 if flop and cpu else 1))
        op = Op(tid, ts, ts + dur, name, kept)
        if comm:
            self.comm_ops.append(op)
            return
        if flop:
            self.flop_ops.append(op)
        if cpu:
            self.cpu_ops.append(op)
            self._cpu_cost += cost


def int_or(value: Any, default: int | None) -> int | None:
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
            if type(value) in SCALARS or (key == "Process Group Ranks" and type(value) is list
                                           and all(type(r) is int for r in value)):
                kept[key] = value
    return kept


def _gpu_args(cat: str, args: dict[str, Any]) -> dict[str, Any]:
    if cat == "gpu_memcpy" or cat == "gpu_memset":
        return {"bytes": int_or(args.get("bytes"), None)}
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
