"""`rank_correlation`: line spans up across ranks (ARCHITECTURE §4).

Input is every trace request the collector receives, from many ranks, in any order,
possibly late or duplicated. Output, added to the pipeline as spans of their own:
- per (job, step) one `train.step.ranks` span, in the step's trace, linked to every
  rank's `train.step` span: ranks present/expected/missing, cross-rank spread, the
  slowest rank and the culprit (least collective wait; see `correlation_windows`),
  per-PG arrival skew, and the ranks currently reporting hangs;
- per (job, pg, seq) a `collective.ranks` span (child of the step's `train.step.ranks`)
  from the `collective.<op>` spans of detail steps: arrival skew, last rank to arrive,
  missing ranks; from the per-PG step summaries whenever a PG's members did not all
  reach its last collective of the step; and from watchdog `flare.hang` reports: the
  ranks stuck inside (pg, seq) arrived, the members that never did are missing
  ("which rank did not join?", before any NCCL timeout);
- per rank, when it was last heard from and whether its watchdog reports a hang
  (`snapshot()`, and counters in `metrics()`).

A window closes, and its span is emitted, as soon as every expected rank reported
(expected = `flare.world_size` of the resource, or the collective's group size), else
`grace_period` after its first span arrived (`hang_grace_period` for a collective seen
only through hang reports; such a window closes as soon as every member that has not
arrived is itself reported hung elsewhere, `hung_elsewhere`: it cannot come). A window
closed early by the byte budget
says so in `flare.ranks.closed_by`. After closing, the window's ranks are remembered
(a bitmap) for `window` so that later copies count as late or duplicate rather than
opening a new window. Jobs silent for `window` are forgotten.

Spans emitted when a window completes are appended to the request being processed
(latency is the processing time of that request); those closed by time come out of
`tick`. Emitted spans have ids derived from (job, step) / (job, pg, seq), so a replay
re-emits identical spans; a `train.step.ranks` span takes the id every rank's
`train.step` already names as its parent (`semconv.step_root_span_id`), so it is the
root of the step's trace.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.instrumentation import semconv as sc
from flare.processors import correlation_output as output
from flare.processors import options
from flare.processors.base import Processor
from flare.processors.correlation_output import SCOPE_NAME
from flare.processors.correlation_windows import (
    ARRIVAL_ENTRY_BYTES,
    PG_ENTRY_BYTES,
    STEP_ENTRY_BYTES,
    CollectiveWindow,
    RankArrival,
    RankStep,
    StepWindow,
    Window,
)
from flare.processors.otlp_values import as_float, as_int
from flare.processors.span_select import COMPACT_STEP_FIELDS, Selection, SpanRecord

# What the correlator reads; everything else passes through untouched (and unparsed).
_SELECTION = Selection(
    names=(sc.SPAN_STEP, sc.SPAN_HANG, sc.SPAN_HEARTBEAT),
    prefix=sc.SPAN_COLLECTIVE_PREFIX,
    excluded=(sc.SPAN_COLLECTIVE_RANKS,),
    skip_scope=SCOPE_NAME,  # our own output coming back (a collector chained to itself)
    span_keys=(
        sc.STEP, sc.RANK, sc.STEP_COLLECTIVE_WAIT_MS, sc.STEP_PG_NAMES, sc.STEP_PG_WAIT_MS,
        sc.STEP_PG_LAST_SEQ, sc.COLL_OP, sc.COLL_PG, sc.COLL_SEQ, sc.COLL_GROUP_SIZE,
        sc.COLL_GROUP_RANKS, sc.HANG_OPERATION, sc.HANG_PG, sc.HANG_SEQ, sc.HANG_COLL_OP,
        sc.HANG_ELAPSED_S, sc.HEARTBEAT_LAST_STEP,
    ),
    resource_keys=(sc.SERVICE_NAME, sc.JOB_ID, sc.RANK, sc.WORLD_SIZE),
    # What _ingest_step reads: the C picker hands such spans over as these values.
    step=(sc.SPAN_STEP, sc.RANK, sc.STEP, sc.STEP_COLLECTIVE_WAIT_MS, sc.STEP_PG_NAMES,
          sc.STEP_PG_WAIT_MS, sc.STEP_PG_LAST_SEQ),
)
_CLOSED_MEMORY_PER_JOB = 4096  # closed windows remembered per job, besides the time bound
_PG_MEMBER_LIMIT = 65536  # distinct (pg, rank) memberships remembered per job
_PG_NAME_LISTS_LIMIT = 1024  # distinct PG-name lists shared per job


@dataclass
class RankHealth:
    last_heard_ns: int  # collector clock, when its latest data arrived
    last_span_end_ns: int = 0  # sender clock, latest end of a span the correlator read
    last_step: int | None = None
    hang: str | None = None  # where the watchdog says it is stuck
    hang_since_ns: int = 0
    hang_collective: tuple[str, int] | None = None  # (pg, seq) it is stuck in, if one


@dataclass
class JobState:
    job: str
    service: str
    world_size: int | None = None
    last_arrival_ns: int = 0
    steps: dict[int, StepWindow] = field(default_factory=dict)
    collectives: dict[tuple[str, int], CollectiveWindow] = field(default_factory=dict)
    # key -> (closed at, bitmap of the ranks it held)
    closed_steps: OrderedDict[int, tuple[int, bytearray]] = field(default_factory=OrderedDict)
    closed_collectives: OrderedDict[tuple[str, int], tuple[int, bytearray]] = field(
        default_factory=OrderedDict
    )
    ranks: dict[int, RankHealth] = field(default_factory=dict)
    pg_members: dict[str, set[int]] = field(default_factory=dict)
    pg_member_count: int = 0
    rank_pg_names: dict[int, tuple[str, ...]] = field(default_factory=dict)  # last learned
    # One tuple per distinct PG-name list the ranks reported (at most _PG_NAME_LISTS_LIMIT).
    pg_names_seen: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)


_STR_ONLY, _FLOAT_ONLY, _INT_ONLY = {str}, {float}, {int}


def _pg_summary(
    attrs: dict[str, Any], learned: tuple[str, ...] | None = None,
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    """A step span's per-PG (names, waits, last sequence numbers), equal lengths.

    Runs once per rank per step: arrays of the expected types (what Flare's
    instrumentation sends, checked with one C-level pass each) are taken as they are,
    anything else is converted value by value. `learned` is the rank's names from an
    earlier step: names equal to them are strings already, and sharing that one tuple
    lets the window's summary see at a glance that all ranks report the same groups.
    """
    raw_names = attrs.get(sc.STEP_PG_NAMES) or ()
    if not raw_names:
        return (), (), ()
    raw_waits = attrs.get(sc.STEP_PG_WAIT_MS) or ()
    raw_seqs = attrs.get(sc.STEP_PG_LAST_SEQ) or ()
    n = len(raw_names)
    if learned is not None and type(raw_names) is tuple and raw_names == learned:
        names = learned
    elif type(raw_names) is tuple and set(map(type, raw_names)) == _STR_ONLY:
        names = raw_names
    else:
        names = tuple(str(v) for v in raw_names)
    if type(raw_waits) is tuple and len(raw_waits) == n and set(map(type, raw_waits)) == _FLOAT_ONLY:
        waits = raw_waits
    else:
        waits = (tuple(as_float(w) or 0.0 for w in raw_waits) + (0.0,) * n)[:n]
    if type(raw_seqs) is tuple and len(raw_seqs) == n and set(map(type, raw_seqs)) == _INT_ONLY:
        seqs = raw_seqs
    else:
        seqs = (tuple(-1 if (i := as_int(v)) is None else i for v in raw_seqs) + (-1,) * n)[:n]
    return names, waits, seqs


def _absent_hang_elsewhere(job: JobState, win: CollectiveWindow) -> bool:
    """Whether every member a hang-reported collective still waits for is itself
    reported hung, somewhere else (its own step, another collective): none of them can
    arrive before its own hang ends, so the answer to "which rank did not join?" is
    known now and the window need not wait out its hang grace period."""
    members = set(win.group_ranks) or job.pg_members.get(str(win.key[0]), set())
    absent = members - win.ranks.keys()
    return bool(absent) and all(
        (health := job.ranks.get(rank)) is not None and health.hang
        and health.hang_collective != win.key for rank in absent)


def _ranks(values: Iterable[object]) -> tuple[int, ...]:
    return tuple(r for r in (as_int(v) for v in values) if r is not None)


def _bitmap(ranks: Iterable[int]) -> bytearray:
    ranks = list(ranks)
    bits = bytearray((max(ranks, default=0) >> 3) + 1)
    for rank in ranks:
        if rank >= 0:
            bits[rank >> 3] |= 1 << (rank & 7)
    return bits


def _in_bitmap(bits: bytearray, rank: int) -> bool:
    return rank >= 0 and (rank >> 3) < len(bits) and bool(bits[rank >> 3] & (1 << (rank & 7)))


class RankCorrelation(Processor):
    def __init__(
        self,
        grace_period: object = "5s",
        hang_grace_period: object = "10s",
        window: object = "120s",
        max_state_mib: float = 256,
        max_pg_detail: int = 16,
        expected_ranks: int | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.grace_ns = int(options.duration_s(grace_period, "rank_correlation.grace_period") * 1e9)
        # Hang reports trickle in over the watchdogs' poll and export intervals, and
        # nothing is lost by waiting: the job is stuck.
        self.hang_grace_ns = int(
            options.duration_s(hang_grace_period, "rank_correlation.hang_grace_period") * 1e9
        )
        self.window_ns = int(options.duration_s(window, "rank_correlation.window") * 1e9)
        if self.window_ns < max(self.grace_ns, self.hang_grace_ns):
            raise ValueError("rank_correlation.window must be at least grace_period and hang_grace_period")
        self.max_state_bytes = options.mib_bytes(max_state_mib, "rank_correlation.max_state_mib")
        if self.max_state_bytes <= 0:
            raise ValueError("rank_correlation.max_state_mib must be positive")
        self.max_pg_detail = options.count(max_pg_detail, "rank_correlation.max_pg_detail")
        self.expected_ranks = (
            None if expected_ranks is None
            else options.count(expected_ranks, "rank_correlation.expected_ranks", minimum=1)
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, JobState] = {}
        self._state_bytes = 0
        self._counters: dict[str, float] = dict.fromkeys((
            "step_spans", "collective_spans", "hang_spans", "heartbeat_spans",
            "duplicate_spans", "late_spans", "replaced_reports", "spans_without_rank",
            "spans_without_step", "steps_emitted", "steps_complete", "steps_grace",
            "steps_budget", "steps_shutdown", "collectives_emitted", "collectives_budget",
            "windows_evicted", "jobs_evicted",
        ), 0.0)

    # ------------------------------------------------------------ pipeline interface
    def process_traces(self, request: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
        return self._process(request, None)

    def process_traces_encoded(
        self, request: ExportTraceServiceRequest, payload: bytes
    ) -> ExportTraceServiceRequest:
        return self._process(request, payload)

    def process_traces_wire(self, payload: bytes) -> bytes:
        """`process_traces` on a request's serialized bytes, never parsed into a message:
        the spans emitted go into a request of their own, whose encoding is appended
        (`resource_spans` is the request's only field, repeated, so the concatenation is
        the request with them appended: the bytes `process_traces` would give)."""
        now = self._clock()
        try:
            selected = _SELECTION.select_payload(payload, compact=True)
        except ValueError:
            # Bytes the receiver accepted but the C scanner does not read: the reference
            # reads the parsed request.
            _SELECTION.fallbacks += 1
            selected = _SELECTION.select_python(ExportTraceServiceRequest.FromString(payload))
        emitted = ExportTraceServiceRequest()
        self._ingest_and_emit(selected, now, emitted.resource_spans)
        return payload + emitted.SerializeToString() if emitted.resource_spans else payload

    def _process(
        self, request: ExportTraceServiceRequest, payload: bytes | None
    ) -> ExportTraceServiceRequest:
        now = self._clock()
        # The bytes the request arrived as save re-serialising it for the C picker.
        selected = (
            _SELECTION.select(request, compact=True) if payload is None
            else _SELECTION.select_encoded(request, payload, compact=True)
        )
        self._ingest_and_emit(selected, now, request.resource_spans)
        return request

    def _ingest_and_emit(self, selected: list, now: int, into: Any) -> None:
        with self._lock:
            completed: list[tuple[JobState, Window, str]] = []
            for resource, records in selected:
                self._ingest_resource(resource, records, now, completed)
            if self._state_bytes > self.max_state_bytes:
                completed.extend(self._over_budget())
            # Built in place: a span extended into a request later is copied whole,
            # and a train.step.ranks span carries one link per rank.
            self._emit(completed, into)

    def tick(self, now_ns: int) -> list[ExportTraceServiceRequest]:
        """Close windows whose grace period ran out; forget what fell out of `window`.

        `now_ns` is the collector's wall clock (`time.time_ns()`), the clock arrival
        times are taken with.
        """
        with self._lock:
            closing: list[tuple[JobState, Window, str]] = []
            for job_id, job in list(self._jobs.items()):
                for step, win in list(job.steps.items()):
                    if now_ns - win.first_arrival_ns >= self.grace_ns:
                        closing.append((job, job.steps.pop(step), "grace"))
                for key, win in list(job.collectives.items()):
                    grace = self.hang_grace_ns if win.source == "hang" else self.grace_ns
                    if now_ns - win.first_arrival_ns >= grace:
                        closing.append((job, job.collectives.pop(key), "grace"))
                    elif win.source == "hang" and _absent_hang_elsewhere(job, win):
                        closing.append((job, job.collectives.pop(key), "hung_elsewhere"))
                self._forget_closed(job, now_ns)
                if now_ns - job.last_arrival_ns >= self.window_ns and not job.steps and not job.collectives:
                    del self._jobs[job_id]
                    self._counters["jobs_evicted"] += 1
            out = ExportTraceServiceRequest()
            self._emit(closing, out.resource_spans)
        return [out] if out.resource_spans else []

    def shutdown(self) -> list[ExportTraceServiceRequest]:
        with self._lock:
            closing: list[tuple[JobState, Window, str]] = []
            for job in self._jobs.values():
                closing.extend((job, win, "shutdown") for win in job.steps.values())
                closing.extend((job, win, "shutdown") for win in job.collectives.values())
                job.steps.clear()
                job.collectives.clear()
            out = ExportTraceServiceRequest()
            self._emit(closing, out.resource_spans)
        return [out] if out.resource_spans else []

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._counters)
            out["state_bytes"] = float(self._state_bytes)
            out["jobs"] = float(len(self._jobs))
            out["open_step_windows"] = float(sum(len(j.steps) for j in self._jobs.values()))
            out["open_collective_windows"] = float(
                sum(len(j.collectives) for j in self._jobs.values())
            )
            out["hanging_ranks"] = float(
                sum(1 for j in self._jobs.values() for h in j.ranks.values() if h.hang)
            )
            now = self._clock()
            silences = [now - h.last_heard_ns for j in self._jobs.values() for h in j.ranks.values()]
            out["max_rank_silence_s"] = max(silences, default=0) / 1e9
        out["picker_fallbacks"] = float(_SELECTION.fallbacks)
        return out

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per job: each rank's last-heard times and hang location, and open windows."""
        with self._lock:
            return {
                job_id: {
                    "world_size": job.world_size,
                    "open_steps": sorted(job.steps),
                    "ranks": {
                        rank: {
                            "last_heard_ns": h.last_heard_ns,
                            "last_span_end_ns": h.last_span_end_ns,
                            "last_step": h.last_step,
                            "hang": h.hang,
                        }
                        for rank, h in sorted(job.ranks.items())
                    },
                    "hanging": {rank: h.hang for rank, h in job.ranks.items() if h.hang},
                }
                for job_id, job in self._jobs.items()
            }

    # ------------------------------------------------------------ ingest
    def _ingest_resource(
        self, resource: dict[str, Any], records: list[SpanRecord], now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        service = resource.get(sc.SERVICE_NAME)
        service = "" if service is None else str(service)
        job_id = resource.get(sc.JOB_ID)
        job_id = service if job_id in (None, "") else str(job_id)
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = JobState(job=job_id, service=service)
        job.last_arrival_ns = now
        world_size = as_int(resource.get(sc.WORLD_SIZE))
        if world_size and (job.world_size is None or world_size > job.world_size):
            job.world_size = world_size
        resource_rank = as_int(resource.get(sc.RANK))
        if resource_rank is not None:
            self._heard(job, resource_rank, now)
        for record in records:
            name = record[0]
            if name == sc.SPAN_STEP:
                self._ingest_step(job, record, resource_rank, now, completed)
            elif name == sc.SPAN_HANG:
                self._ingest_hang(job, record, resource_rank, now, completed)
            elif name == sc.SPAN_HEARTBEAT:
                self._ingest_heartbeat(job, record, resource_rank, now)
            else:  # collective.<op>: the selection keeps nothing else
                self._ingest_collective(job, record, resource_rank, now, completed)

    def _heard(self, job: JobState, rank: int, now: int) -> RankHealth:
        health = job.ranks.get(rank)
        if health is None:
            health = job.ranks[rank] = RankHealth(last_heard_ns=now)
        else:
            health.last_heard_ns = now
        return health

    def _expected(self, job: JobState) -> int | None:
        return self.expected_ranks or job.world_size

    def _ingest_step(
        self, job: JobState, record: SpanRecord, resource_rank: int | None, now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        # Runs for every rank's every step. The C picker hands Flare's own step spans
        # over in the compact form (span_select.compact_step): the values below, already
        # of their types; anything else comes as an attribute dict and is converted.
        counters = self._counters
        counters["step_spans"] += 1
        if len(record) == COMPACT_STEP_FIELDS:  # the C picker's compact step record
            _, trace_id, span_id, start_ns, end_ns, rank, step, wait, names, waits, seqs = record
            if rank is None:
                rank = resource_rank
            attrs = None
        else:
            _, trace_id, span_id, start_ns, end_ns, attrs = record
            rank = attrs.get(sc.RANK, resource_rank)
            if type(rank) is not int:
                rank = as_int(rank)
            step = attrs.get(sc.STEP)
            if type(step) is not int:
                step = as_int(step)
        if rank is None:
            counters["spans_without_rank"] += 1
            return
        if step is None:
            counters["spans_without_step"] += 1
            return
        health = job.ranks.get(rank)
        if health is None:
            health = job.ranks[rank] = RankHealth(last_heard_ns=now)
        else:
            health.last_heard_ns = now
        if end_ns > health.last_span_end_ns:
            health.last_span_end_ns = end_ns
        if health.last_step is None or step > health.last_step:
            health.last_step = step
        if health.hang and end_ns > health.hang_since_ns:
            health.hang = None  # it finished a step after the report: no longer stuck
            health.hang_collective = None
        closed = job.closed_steps.get(step)
        if closed is not None:
            counters["duplicate_spans" if _in_bitmap(closed[1], rank) else "late_spans"] += 1
            return
        learned = job.rank_pg_names.get(rank)
        if attrs is None:
            if names and learned is not None and names == learned:
                names = learned
        else:
            names, waits, seqs = _pg_summary(attrs, learned)
            wait = attrs.get(sc.STEP_COLLECTIVE_WAIT_MS)
            if type(wait) is not float:
                wait = as_float(wait)
        if names and names is not learned:
            # A rank's groups rarely change: learn them once, as the job's one tuple
            # for these names (every rank of a job usually reports the same groups, and
            # a window's summary sees that at a glance when they share the object).
            seen = job.pg_names_seen.get(names)
            if seen is not None:
                names = seen
            elif len(job.pg_names_seen) < _PG_NAME_LISTS_LIMIT:
                job.pg_names_seen[names] = names
            job.rank_pg_names[rank] = names
            self._learn_members(job, names, rank)
        entry = RankStep(span_id, trace_id, start_ns, end_ns, wait, names, waits, seqs)
        win = job.steps.get(step)
        if win is None:
            win = job.steps[step] = StepWindow(key=step, first_arrival_ns=now)
        previous = win.ranks.get(rank)
        if previous is not None:
            if previous.span_id == entry.span_id:
                counters["duplicate_spans"] += 1
                return
            # A restarted rank ran the step again: its latest attempt is what counts.
            counters["replaced_reports"] += 1
            if previous.end_ns >= entry.end_ns:
                return
            win.cost -= previous.cost()
            self._state_bytes -= previous.cost()
        win.ranks[rank] = entry
        cost = STEP_ENTRY_BYTES + PG_ENTRY_BYTES * len(names)  # entry.cost()
        win.cost += cost
        self._state_bytes += cost
        expected = self.expected_ranks or job.world_size
        if expected and len(win.ranks) >= expected and set(range(expected)) <= win.ranks.keys():
            completed.append((job, job.steps.pop(step), "complete"))

    def _learn_members(self, job: JobState, names: tuple[str, ...], rank: int) -> None:
        for name in names:
            members = job.pg_members.get(name)
            if members is None:
                if job.pg_member_count >= _PG_MEMBER_LIMIT:
                    continue
                members = job.pg_members[name] = set()
            if rank not in members and job.pg_member_count < _PG_MEMBER_LIMIT:
                members.add(rank)
                job.pg_member_count += 1

    def _ingest_collective(
        self, job: JobState, record: SpanRecord, resource_rank: int | None, now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        self._counters["collective_spans"] += 1
        _, trace_id, span_id, start_ns, end_ns, attrs = record
        rank = as_int(attrs.get(sc.RANK, resource_rank))
        seq = as_int(attrs.get(sc.COLL_SEQ))
        pg = attrs.get(sc.COLL_PG)
        if rank is None:
            self._counters["spans_without_rank"] += 1
            return
        if seq is None or pg is None:
            return  # a collective without (pg, seq) cannot be matched across ranks
        health = self._heard(job, rank, now)
        if end_ns > health.last_span_end_ns:
            health.last_span_end_ns = end_ns
        self._arrive(
            job, (pg if type(pg) is str else str(pg), seq), rank,
            RankArrival(span_id, trace_id, start_ns, end_ns), now, completed, source="spans",
            op=attrs.get(sc.COLL_OP) or "", step=as_int(attrs.get(sc.STEP)),
            group_size=as_int(attrs.get(sc.COLL_GROUP_SIZE)),
            group_ranks=attrs.get(sc.COLL_GROUP_RANKS) or (),
        )

    def _arrive(
        self, job: JobState, key: tuple[str, int], rank: int, arrival: RankArrival, now: int,
        completed: list[tuple[JobState, Window, str]], source: str, op: object,
        step: int | None, group_size: int | None = None, group_ranks: Iterable[object] = (),
    ) -> None:
        """Record that `rank` reached collective `key` = (pg, seq)."""
        closed = job.closed_collectives.get(key)
        if closed is not None:
            self._counters["duplicate_spans" if _in_bitmap(closed[1], rank) else "late_spans"] += 1
            return
        win = job.collectives.get(key)
        if win is None:
            win = job.collectives[key] = CollectiveWindow(
                key=key, first_arrival_ns=now, op=str(op), step=step, group_size=group_size,
                group_ranks=_ranks(group_ranks), source=source,
            )
        if rank in win.ranks:
            self._counters["duplicate_spans"] += 1
            return
        if win.step is None:
            win.step = step
        if not win.op:
            win.op = str(op)
        if not win.group_size:
            win.group_size = group_size
        if not win.group_ranks and group_ranks:
            win.group_ranks = _ranks(group_ranks)
        win.ranks[rank] = arrival
        win.cost += ARRIVAL_ENTRY_BYTES
        self._state_bytes += ARRIVAL_ENTRY_BYTES
        size = win.group_size or len(win.group_ranks)
        if size and len(win.ranks) >= size:
            completed.append((job, job.collectives.pop(key), "complete"))

    def _ingest_hang(
        self, job: JobState, record: SpanRecord, resource_rank: int | None, now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        self._counters["hang_spans"] += 1
        _, trace_id, span_id, start_ns, end_ns, attrs = record
        rank = as_int(attrs.get(sc.RANK, resource_rank))
        if rank is None:
            self._counters["spans_without_rank"] += 1
            return
        health = self._heard(job, rank, now)
        where = str(attrs.get(sc.HANG_OPERATION) or "unknown")
        pg, seq = attrs.get(sc.HANG_PG), as_int(attrs.get(sc.HANG_SEQ))
        if pg is not None:
            where += f" pg={pg}"
        if seq is not None:
            where += f" seq={seq}"
        health.hang = where
        health.hang_since_ns = start_ns
        health.hang_collective = None if pg is None or seq is None else (str(pg), seq)
        if health.hang_collective is None:
            return
        # A rank stuck inside collective (pg, seq) has arrived at it; the members that
        # never report arriving there are the ones the group waits for ("which rank
        # did not join?"), answered before any NCCL timeout fires.
        elapsed_ns = int((as_float(attrs.get(sc.HANG_ELAPSED_S)) or 0.0) * 1e9)
        arrival = RankArrival(
            span_id=span_id, trace_id=trace_id, start_ns=start_ns - elapsed_ns, end_ns=end_ns,
        )
        self._arrive(
            job, (str(pg), seq), rank, arrival, now, completed, source="hang",
            op=str(attrs.get(sc.HANG_COLL_OP) or ""), step=as_int(attrs.get(sc.STEP)),
        )

    def _ingest_heartbeat(
        self, job: JobState, record: SpanRecord, resource_rank: int | None, now: int
    ) -> None:
        self._counters["heartbeat_spans"] += 1
        end_ns, attrs = record[4], record[5]
        rank = as_int(attrs.get(sc.RANK, resource_rank))
        if rank is None:
            return
        health = self._heard(job, rank, now)
        health.last_span_end_ns = max(health.last_span_end_ns, end_ns)
        last_step = as_int(attrs.get(sc.HEARTBEAT_LAST_STEP))
        if last_step is not None:
            health.last_step = last_step if health.last_step is None else max(health.last_step, last_step)

    # ------------------------------------------------------------ bounds
    def _over_budget(self) -> list[tuple[JobState, Window, str]]:
        """Close the oldest open windows until the state is back under 90% of budget."""
        open_windows = sorted(
            (
                (win.first_arrival_ns, id(win), job, win)
                for job in self._jobs.values()
                for win in (*job.steps.values(), *job.collectives.values())
            ),
            key=lambda item: item[:2],
        )
        target = int(self.max_state_bytes * 0.9)
        closing = []
        state = self._state_bytes
        for _, _, job, win in open_windows:
            if state <= target:
                break
            if isinstance(win, StepWindow):
                job.steps.pop(win.key)
            else:
                job.collectives.pop(win.key)
            state -= win.cost
            self._counters["windows_evicted"] += 1
            closing.append((job, win, "budget"))
        return closing

    def _forget_closed(self, job: JobState, now: int) -> None:
        for memory in (job.closed_steps, job.closed_collectives):
            while memory and (
                len(memory) > _CLOSED_MEMORY_PER_JOB
                or now - next(iter(memory.values()))[0] >= self.window_ns
            ):
                memory.popitem(last=False)

    # ------------------------------------------------------------ output
    def _emit(self, closing: list[tuple[JobState, Window, str]], into: Any) -> None:
        """Close `closing` and add its spans to `into` (a request's `resource_spans`),
        one `ResourceSpans` per job."""
        if not closing:
            return
        now = self._clock()
        by_job: dict[str, Any] = {}  # job id -> its scope's spans container
        for job, win, closed_by in closing:
            self._state_bytes -= win.cost
            spans = by_job.get(job.job)
            if spans is None:
                spans = by_job[job.job] = output.job_scope_spans(job, into)
            counters = self._counters
            if isinstance(win, StepWindow):
                job.closed_steps[win.key] = (now, _bitmap(win.ranks))
                counters["steps_emitted"] += 1
                counters[f"steps_{closed_by}"] += 1
                counters["collectives_emitted"] += output.step_spans(
                    job, win, closed_by, self._expected(job), self.max_pg_detail, spans)
            else:
                job.closed_collectives[win.key] = (now, _bitmap(win.ranks))
                counters["collectives_emitted"] += 1
                if closed_by == "budget":
                    counters["collectives_budget"] += 1
                output.collective_span(job, win, closed_by, spans)
            self._forget_closed(job, now)
