"""Collectives: every `torch.distributed` call a rank makes, with its process group,
per-group sequence number, size and call site; plus, on detail steps, the collectives
issued from C++ that only the flight recorder sees (an entry created during a wrapped
Python call of the same group is that call, so nothing is counted twice).

Always on (per step, on `train.step`): per process group the number of collectives
(from the group's sequence counter, so C++-issued ones count too), the bytes and the
wait of Python-issued ones, plus DDP's gradient bytes (ddp_gradients.py) and its exposed
gradient-sync wait, both measured at the end of backward. Detail steps: one `collective.<op>` span per collective.

Wait time is the wall time the calling thread spent blocked: the blocking call itself,
or `Work.wait()` for async calls. On CUDA, where calls return at enqueue, each
Python-issued collective is also timed on the device with pooled CUDA events polled by a
background thread (device_timing.py): `flare.collective.device_ms` and, per step,
`flare.step.pg.device_ms`.

Here: the wrappers (the per-collective path) and the step's per-group arrays. The tracker's
other parts have modules of their own: collective_install.py (putting the wrappers on
torch.distributed, once), backward_records.py (what each backward did to the groups) and
recorded_collectives.py (the flight recorder's collectives, on detail and hung steps).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass

from opentelemetry import trace

from flare.instrumentation.backward_records import BackwardRecords, add_backward
from flare.instrumentation.callsite import caller_site, format_site
from flare.instrumentation.collective_install import CallSpec, wrap_distributed
from flare.instrumentation.ddp_gradients import DdpGradients
from flare.instrumentation.functional_collectives import FunctionalCollectives
from flare.instrumentation.patching import Patches
from flare.instrumentation.process_groups import PgInfo, ProcessGroups
from flare.instrumentation.recorded_collectives import RecordedCollectives
from flare.instrumentation.runtime import Runtime
from flare.wire import semconv
from flare.wire.bandwidth import busbw_gbps

_log = logging.getLogger(__name__)

ALWAYS_ASYNC = {"isend", "irecv", "batch_isend_irecv"}
P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}
MAX_PENDING_WORKS = 4096


def _nbytes(value) -> tuple[int, str | None]:
    """(bytes, dtype) of a tensor or a list of tensors."""
    if value is None:
        return 0, None
    if isinstance(value, (list, tuple)):
        total, dtype = 0, None
        for item in value:
            size, item_dtype = _nbytes(item)
            total += size
            dtype = dtype or item_dtype
        return total, dtype
    try:
        return value.numel() * value.element_size(), str(value.dtype).removeprefix("torch.")
    except AttributeError:
        return 0, None


@dataclass
class CollectiveRecord:
    op: str
    pg: PgInfo | None
    seq: int | None
    nbytes: int
    dtype: str | None
    start_ns: int
    end_ns: int
    site: tuple | None
    is_async: bool
    peer: int | None = None
    wait_ns: int = 0
    pending_works: int = 0
    device_token: object = None  # CUDA start event while the device time is pending
    device_ms: float | None = None
    attributes: dict | None = None  # the emitted child's attributes, until its step ends

    @property
    def pg_name(self) -> str:
        return self.pg.name if self.pg else "?"


def _add_pg_arrays(summary: dict, totals_pg: dict, started: dict, now_seqs: dict,
                   roles: dict[str, str] | None = None, said: set[str] | None = None) -> None:
    # (Loops, not comprehensions: see backward_records.add_backward.)
    names = list(totals_pg)
    for name, seq in now_seqs.items():
        if seq > started.get(name, seq) and name not in totals_pg:
            names.append(name)
    if len(names) > 1:
        names.sort()
    counts, waits, sizes, last_seqs, device = [], [], [], [], []
    role_list: list[str] | None = None
    untimed: list[int] | None = None
    count_sum = bytes_sum = 0
    any_device = False
    for index, name in enumerate(names):
        totals = totals_pg.get(name)
        now = now_seqs.get(name)
        delta = 0 if now is None else now - started.get(name, now)
        role = roles.get(name, "") if roles else ""
        if totals is not None:
            count = max(delta, totals.python_count)
            nbytes = totals.bytes
            waits.append(round(totals.wait_ns / 1e6, 3))
            device_ms = round(totals.device_ns / 1e6, 3)
            any_device = any_device or device_ms != 0
            device.append(device_ms)
            unseen = 0 if totals.cpp_accounted else delta - totals.covered
            if not role and totals.p2p_count and totals.p2p_count == totals.python_count:
                role = semconv.ROLE_PIPELINE  # the step's traffic on it was point-to-point
        else:
            count, nbytes = delta, 0
            waits.append(0.0)
            device.append(0.0)
            unseen = delta
        if unseen > 0:
            if untimed is None:
                untimed = [0] * len(names)
            untimed[index] = unseen
            if said is not None and name not in said and len(said) < 64:
                said.add(name)  # once per group and tracker
                _log.warning(
                    "flare: rank %s: %d collective(s) of process group %s were issued where Flare "
                    "cannot time them (C++ code or a compiled graph, not torch.distributed's "
                    "Python API); the group is counted by its sequence numbers, its wait "
                    "is unknown (flare.step.pg.untimed) and reads as compute",
                    os.environ.get("RANK", "?"), unseen, name)
        if role:
            if role_list is None:
                role_list = [""] * len(names)
            role_list[index] = role
        counts.append(count)
        sizes.append(nbytes)
        count_sum += count
        bytes_sum += nbytes
        last_seqs.append(-1 if now is None else now)
    if any_device:
        summary[semconv.STEP_PG_DEVICE_MS] = device
    if names:
        summary[semconv.STEP_PG_NAMES] = names
        summary[semconv.STEP_PG_COUNTS] = counts
        summary[semconv.STEP_PG_WAIT_MS] = waits
        summary[semconv.STEP_PG_BYTES] = sizes
        summary[semconv.STEP_PG_LAST_SEQ] = last_seqs
        if role_list is not None:
            summary[semconv.STEP_PG_ROLES] = role_list
        if untimed is not None:
            summary[semconv.STEP_PG_UNTIMED] = untimed
            summary[semconv.STEP_COLLECTIVE_UNTIMED] = sum(untimed)
    summary[semconv.STEP_COLLECTIVE_COUNT] = count_sum
    summary[semconv.STEP_COLLECTIVE_BYTES] = bytes_sum


class CollectiveTracker:
    """Wraps torch.distributed and summarises each step; a Runtime step listener."""

    # The step's sequence numbers are read by the runtime (`sequence_reader`) and kept
    # in its StepTotals: only a detail step's end needs the listener.
    ordinary_steps = ()

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.groups = ProcessGroups()
        self.ddp_gradients = DdpGradients(self.groups)
        self.recorded = RecordedCollectives(runtime, self.groups)  # the flight recorder's
        self.backward = BackwardRecords(runtime, self.groups, self.ddp_gradients)
        # StepHooks asks before each backward (with several groups): bound once here, the
        # call does the method's work and no more.
        self.sequences_before_backward = self.backward.sequences_before_backward
        self._patches = Patches()
        self._pending: dict[int, tuple[object, CollectiveRecord]] = {}
        self._local = threading.local()
        self._device_timer = None  # created at the first CUDA collective
        self._said_untimed: set[str] = set()  # groups whose unseen collectives were logged

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        wrap_distributed(self._patches, self._wrap, self._wrap_wait)
        FunctionalCollectives(self.runtime, self._patches).install()
        try:
            self.ddp_gradients.install()
        except Exception as error:  # DDP buckets stay counted, just not sized every step
            _log.info("flare: DDP gradient bytes are not summarised per step (%r)", error)
        self.runtime.add_step_listener(self)
        self.runtime.sequence_reader = self.groups.sequence_snapshot
        self.runtime.summary_adders = (*self.runtime.summary_adders, self.add_step_summary)

    def uninstall(self) -> None:
        if self._device_timer is not None:
            self._device_timer.stop()
            self._device_timer = None
        self.runtime.remove_step_listener(self)
        if self.runtime.sequence_reader == self.groups.sequence_snapshot:
            self.runtime.sequence_reader = None
        self.runtime.summary_adders = tuple(
            add for add in self.runtime.summary_adders if add != self.add_step_summary)
        self.ddp_gradients.uninstall()
        self._patches.restore_all()
        self._pending.clear()

    # ------------------------------------------------------------------ wrappers
    def _wrap(self, original, spec: CallSpec):
        runtime = self.runtime
        tracker = self
        local = self._local
        span_name = semconv.collective_span_name(spec.op)

        def traced(*args, **kwargs):
            if not runtime.enabled or getattr(local, "depth", 0):
                return original(*args, **kwargs)
            if spec.op == "batch_isend_irecv":
                p2p_ops = args[0] if args else kwargs.get("p2p_op_list") or ()
                group = getattr(p2p_ops[0], "group", None) if p2p_ops else None
                data = [getattr(p, "tensor", None) for p in p2p_ops]
                peer = None
            else:
                group = spec.argument(args, kwargs, "group", spec.group_index)
                data = spec.argument(args, kwargs, spec.data_name, spec.data_index)
                peer = spec.argument(args, kwargs, spec.peer_name, spec.peer_index)
            pg = tracker.groups.resolve(group)
            info = tracker.groups.info(pg)
            seq_before = tracker.groups.sequence(pg)
            site = caller_site()
            start = time.time_ns()
            in_flight = {semconv.COLL_OP: spec.op}
            if info is not None:
                in_flight[semconv.COLL_PG] = info.name
            if seq_before is not None and spec.op not in P2P:
                in_flight[semconv.COLL_SEQ] = seq_before + 1
            device_token = tracker._device_begin(data)
            op = runtime.operations.push(span_name, start, in_flight, site)
            local.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                local.depth = 0
                end = time.time_ns()
                runtime.operations.pop(op)
            is_async = spec.op in ALWAYS_ASYNC or bool(
                spec.argument(args, kwargs, "async_op", spec.async_index))
            nbytes, dtype = _nbytes(data)
            seq = tracker.groups.sequence(pg)
            advance = (seq - seq_before if seq is not None and seq_before is not None
                       and seq > seq_before else 1)
            record = CollectiveRecord(spec.op, info, seq if spec.op not in P2P else None,
                                      nbytes, dtype, start, end, site, is_async,
                                      peer if isinstance(peer, int) else None,
                                      device_token=device_token)
            if device_token is not None and not is_async:
                tracker._device_end(record)
            tracker._launched(record, result, advance)
            return result

        traced._flare_traced = True
        traced.__wrapped__ = original
        traced.__doc__ = original.__doc__
        traced.__name__ = getattr(original, "__name__", spec.op)
        return traced

    def _wrap_wait(self, original_wait):
        tracker = self
        runtime = self.runtime

        def wait(work, *args, **kwargs):
            pending = tracker._pending.pop(id(work), None) if tracker._pending else None
            if pending is None or pending[0] is not work:
                return original_wait(work, *args, **kwargs)
            record = pending[1]
            start = time.time_ns()
            op = runtime.operations.push(semconv.collective_span_name(record.op), start, {
                semconv.COLL_OP: record.op, semconv.COLL_PG: record.pg_name,
                **({semconv.COLL_SEQ: record.seq} if record.seq is not None else {})},
                record.site)
            try:
                return original_wait(work, *args, **kwargs)
            finally:
                end = time.time_ns()
                runtime.operations.pop(op)
                tracker._waited(record, start, end)

        wait.__wrapped__ = original_wait
        return wait

    # ------------------------------------------------------------------ accounting
    def _launched(self, record: CollectiveRecord, result, advance: int = 1) -> None:
        totals = self.runtime.totals.pg_totals(record.pg_name)
        totals.python_count += 1
        totals.covered += advance
        if record.op in P2P:
            totals.p2p_count += 1
        totals.bytes += record.nbytes
        if self.runtime.step_detail:
            step = self.runtime.totals
            if step.python_windows is None:
                step.python_windows = []
            step.python_windows.append((record.pg_name, record.start_ns, record.end_ns))
        works = result if isinstance(result, list) else [result] if result is not None else []
        if record.is_async and works and len(self._pending) < MAX_PENDING_WORKS:
            record.pending_works = len(works)
            for work in works:
                self._pending[id(work)] = (work, record)
            return
        wait_ns = record.end_ns - record.start_ns
        totals.wait_ns += wait_ns
        record.wait_ns = wait_ns
        self._emit(record)

    def _waited(self, record: CollectiveRecord, start: int, end: int) -> None:
        if record.device_token is not None:  # the caller's stream now waits on the work
            self._device_end(record)
        self.runtime.totals.pg_totals(record.pg_name).wait_ns += end - start
        record.wait_ns += end - start
        record.end_ns = max(record.end_ns, end)
        record.pending_works -= 1
        if record.pending_works <= 0:
            self._emit(record)

    def _emit(self, record: CollectiveRecord) -> None:
        runtime = self.runtime
        if not runtime.wants_child(record.start_ns, record.end_ns):
            return  # ordinary step, fast call: counted in the step's totals only
        attributes = {
            semconv.COLL_OP: record.op,
            semconv.COLL_BYTES: record.nbytes,
            semconv.COLL_ASYNC: record.is_async,
            semconv.COLL_WAIT_MS: round(record.wait_ns / 1e6, 3),
            semconv.COLL_SOURCE: "python",
        }
        if record.pg is not None:
            attributes[semconv.COLL_PG] = record.pg.name
            attributes[semconv.COLL_PG_DESC] = record.pg.desc
            attributes[semconv.COLL_GROUP_SIZE] = record.pg.size
            attributes[semconv.COLL_GROUP_RANKS] = list(record.pg.ranks)
            attributes[semconv.COLL_BACKEND] = record.pg.backend
            bandwidth = busbw_gbps(record.op, record.nbytes, record.pg.size,
                                   record.end_ns - record.start_ns)
            if bandwidth is not None and not record.is_async:
                attributes[semconv.COLL_BUSBW_GBPS] = round(bandwidth, 4)
        if record.seq is not None:
            attributes[semconv.COLL_SEQ] = record.seq
        if record.dtype:
            attributes[semconv.COLL_DTYPE] = record.dtype
        if record.peer is not None:
            attributes[semconv.COLL_P2P_PEER] = record.peer
        site = format_site(record.site)
        if site:
            attributes[semconv.CODE_CALLSITE] = site
        if record.device_ms is not None:
            self._add_device_attributes(record, attributes)
        else:
            record.attributes = attributes  # the device time may still arrive
        runtime.emit_child(semconv.collective_span_name(record.op), record.start_ns,
                           record.end_ns, attributes)

    # ------------------------------------------------------------------ CUDA device time
    def _device_begin(self, data):
        first = data[0] if isinstance(data, (list, tuple)) and data else data
        if not getattr(first, "is_cuda", False):
            return None
        if self._device_timer is None:
            from flare.instrumentation.device_timing import CudaEventTimer

            self._device_timer = CudaEventTimer()
        return self._device_timer.begin()

    def _device_end(self, record: CollectiveRecord) -> None:
        token, record.device_token = record.device_token, None
        self._device_timer.end(token, lambda ms: self.device_done(record, ms))

    def device_done(self, record: CollectiveRecord, device_ms: float) -> None:
        """On the poller thread: a collective's device time is known."""
        record.device_ms = device_ms
        runtime = self.runtime
        if runtime.step_open:
            runtime.totals.pg_totals(record.pg_name).device_ns += int(device_ms * 1e6)
        if record.attributes is not None:
            self._add_device_attributes(record, record.attributes)

    @staticmethod
    def _add_device_attributes(record: CollectiveRecord, attributes: dict) -> None:
        attributes[semconv.COLL_DEVICE_MS] = round(record.device_ms, 4)
        if record.pg is not None:
            bandwidth = busbw_gbps(record.op, record.nbytes, record.pg.size,
                                   int(record.device_ms * 1e6))
            if bandwidth is not None:
                attributes[semconv.COLL_BUSBW_GBPS] = round(bandwidth, 4)

    # ------------------------------------------------------------------ backward
    # What StepHooks queues itself for a backward's usual case (one group, one DDP wrapper).
    _add_backward = staticmethod(add_backward)

    def record_backward(self, totals, start: int, graph_done: int, end: int,
                        seqs_before: dict[str, int] | None) -> None:
        """A backward of the step `totals` ended: `BackwardRecords.record_backward`. (A
        method of the tracker's class, which StepHooks calls outside its inline case.)"""
        self.backward.record_backward(totals, start, graph_done, end, seqs_before)

    # ------------------------------------------------------------------ step listener
    def on_step_start(self, step: int, detail: bool) -> None:
        pass  # the runtime reads the step's starting sequence numbers itself

    def add_step_summary(self, summary: dict, totals) -> None:
        """The always-on per-group arrays of a step's summary, from its totals and the
        sequence numbers at its start and end (a Runtime summary adder: it runs when
        the span is built, possibly on the finisher thread)."""
        _add_pg_arrays(summary, totals.pg, totals.seq_start or {}, totals.seq_end or {},
                       self.groups.roles, self._said_untimed)

    def on_step_end(self, step: int, detail: bool, span) -> None:
        if detail:
            # The recorder's dump costs milliseconds (linear in its buffer): it is read
            # off the training thread, by the finisher woken for it now, while the
            # entries of this step are still in the ring.
            runtime = self.runtime
            self.runtime.run_later(functools.partial(
                self.recorded.emit_flight_recorder, runtime.step_start_ns, time.time_ns(),
                runtime.totals, step, trace.set_span_in_context(span),
                dict(runtime.span_attributes)))

    # ------------------------------------------------------------------ hangs
    def collective_in_flight(self, since_ns: int) -> dict | None:
        """For a thread blocked in C++ (backward waiting on DDP buckets): the oldest
        collective the flight recorder saw issued since `since_ns` and not completed."""
        return self.recorded.collective_in_flight(since_ns)
