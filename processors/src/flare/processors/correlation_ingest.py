"""What the rank correlator does with each span it reads: the per-job state it keeps
(`RankIngest`: jobs, their open windows, each rank's health, the state's byte
estimate and the counters), and how a `train.step`, `collective.<op>`, `flare.hang` or
heartbeat span updates it. Runs for every selected span, under the processor's lock;
a window that just became complete is handed back to be emitted
(`correlation_closing`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flare.processors.correlation_state import JobState, RankHealth, in_bitmap
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
from flare.processors.span_select import COMPACT_STEP_FIELDS, SpanRecord
from flare.wire import semconv as sc

_PG_MEMBER_LIMIT = 65536  # distinct (pg, rank) memberships remembered per job
_PG_NAME_LISTS_LIMIT = 1024  # distinct PG-name lists shared per job

# What metrics() reports as counters (besides its gauges).
COUNTERS = (
    "step_spans", "collective_spans", "hang_spans", "heartbeat_spans",
    "duplicate_spans", "late_spans", "replaced_reports", "spans_without_rank",
    "spans_without_step", "steps_emitted", "steps_complete", "steps_grace",
    "steps_budget", "steps_shutdown", "collectives_emitted", "collectives_budget",
    "windows_evicted", "jobs_evicted",
)

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


def _ranks(values: Iterable[object]) -> tuple[int, ...]:
    return tuple(r for r in (as_int(v) for v in values) if r is not None)



class RankIngest:
    """Per job: its open windows, the windows it recently closed, each rank's health and
    the process groups its ranks reported; and what feeds them, span by span."""

    __slots__ = ("counters", "expected_ranks", "jobs", "state_bytes")

    def __init__(self, expected_ranks: int | None) -> None:
        self.expected_ranks = expected_ranks
        self.jobs: dict[str, JobState] = {}
        self.state_bytes = 0
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)

    def ingest_resource(
        self, resource: dict[str, Any], records: list[SpanRecord], now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        service = resource.get(sc.SERVICE_NAME)
        service = "" if service is None else str(service)
        job_id = resource.get(sc.JOB_ID)
        job_id = service if job_id in (None, "") else str(job_id)
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobState(job=job_id, service=service)
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

    def _ingest_step(
        self, job: JobState, record: SpanRecord, resource_rank: int | None, now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        # Runs for every rank's every step. The C picker hands Flare's own step spans
        # over in the compact form (span_select.compact_step): the values below, already
        # of their types; anything else comes as an attribute dict and is converted.
        counters = self.counters
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
            counters["duplicate_spans" if in_bitmap(closed[1], rank) else "late_spans"] += 1
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
            self.state_bytes -= previous.cost()
        win.ranks[rank] = entry
        cost = STEP_ENTRY_BYTES + PG_ENTRY_BYTES * len(names)  # entry.cost()
        win.cost += cost
        self.state_bytes += cost
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
        self.counters["collective_spans"] += 1
        _, trace_id, span_id, start_ns, end_ns, attrs = record
        rank = as_int(attrs.get(sc.RANK, resource_rank))
        seq = as_int(attrs.get(sc.COLL_SEQ))
        pg = attrs.get(sc.COLL_PG)
        if rank is None:
            self.counters["spans_without_rank"] += 1
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
            self.counters["duplicate_spans" if in_bitmap(closed[1], rank) else "late_spans"] += 1
            return
        win = job.collectives.get(key)
        if win is None:
            win = job.collectives[key] = CollectiveWindow(
                key=key, first_arrival_ns=now, op=str(op), step=step, group_size=group_size,
                group_ranks=_ranks(group_ranks), source=source,
            )
        if rank in win.ranks:
            self.counters["duplicate_spans"] += 1
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
        self.state_bytes += ARRIVAL_ENTRY_BYTES
        size = win.group_size or len(win.group_ranks)
        if size and len(win.ranks) >= size:
            completed.append((job, job.collectives.pop(key), "complete"))

    def _ingest_hang(
        self, job: JobState, record: SpanRecord, resource_rank: int | None, now: int,
        completed: list[tuple[JobState, Window, str]],
    ) -> None:
        self.counters["hang_spans"] += 1
        _, trace_id, span_id, start_ns, end_ns, attrs = record
        rank = as_int(attrs.get(sc.RANK, resource_rank))
        if rank is None:
            self.counters["spans_without_rank"] += 1
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
        self.counters["heartbeat_spans"] += 1
        end_ns, attrs = record[4], record[5]
        rank = as_int(attrs.get(sc.RANK, resource_rank))
        if rank is None:
            return
        health = self._heard(job, rank, now)
        health.last_span_end_ns = max(health.last_span_end_ns, end_ns)
        last_step = as_int(attrs.get(sc.HEARTBEAT_LAST_STEP))
        if last_step is not None:
            health.last_step = last_step if health.last_step is None else max(health.last_step, last_step)
