"""The collectives only PyTorch's flight recorder saw (issued from C++: DDP's buckets),
read off the training thread on detail and hung steps only: a detail step's become
`collective.<op>` spans, children of its step; a hang's is the oldest one in flight."""

from __future__ import annotations

import logging

from flare.instrumentation.flight_recorder import (
    FlightRecorder,
    entry_bytes,
    entry_pg_desc,
    entry_pg_name,
    op_name,
)
from flare.wire import semconv
from flare.wire.bandwidth import busbw_gbps

# The tracker's logger: what is said here keeps the name it always had.
_log = logging.getLogger("flare.instrumentation.collectives")


def _python_issued_all(totals) -> bool:
    """Each group's sequence number advanced over the step exactly by the collectives
    the Python wrappers saw (FSDP, Megatron and `dist.*` calls; not DDP's reducer, which
    issues from C++). Then the flight recorder, whose dump costs milliseconds (linear in
    its buffer, not in the step), holds nothing of this step that is not a span already."""
    started, ended = totals.seq_start, totals.seq_end
    if not started or ended is None:
        return False  # a read failed: the recorder decides
    for name, seq in ended.items():
        issued = seq - started.get(name, seq)
        if issued <= 0:
            continue
        pg = totals.pg.get(name)
        if pg is None or pg.python_count != issued:
            return False
    return True


class RecordedCollectives:
    """The flight recorder's collectives of a CollectiveTracker's process groups."""

    def __init__(self, runtime, groups):
        self.runtime = runtime
        self.groups = groups  # ProcessGroups
        self.recorder = FlightRecorder()
        self.recorder_truncated_steps = 0  # detail steps whose first entries were overwritten

    def emit_flight_recorder(self, step_start_ns: int, step_end_ns: int, totals,
                             step: int, parent, labels: dict) -> None:
        """Detail step: C++-issued collectives of this step, as spans."""
        if _python_issued_all(totals):
            return  # every one is a span from the Python wrapper: the dump would add none
        entries = self.recorder.entries()
        if not entries:
            now_seqs, started = totals.seq_end or {}, totals.seq_start or {}
            if self.recorder.available and any(s > started.get(n, s) for n, s in now_seqs.items()):
                self.recorder.note_empty()
            return
        if self.recorder.overwrote(entries, step_start_ns):
            self.recorder_truncated_steps += 1
            if self.recorder_truncated_steps == 1:
                _log.info("flare: detail step %d issued more collectives than the flight "
                          "recorder keeps (%s=%d); its earliest C++-issued ones have no "
                          "span (raise %s to keep them: each entry costs every detail step "
                          "~7-20 µs to read)", step, semconv.ENV_FR_BUFFER_SIZE, len(entries),
                          semconv.ENV_FR_BUFFER_SIZE)
        infos = self.groups.infos_by_name()
        windows = totals.backward_windows or ()
        python_windows = totals.python_windows or ()
        for entry in entries:
            created = entry.get("time_created_ns") or 0
            if created < step_start_ns or created > step_end_ns or entry.get("is_p2p"):
                continue  # another step's (the dump runs up to a second later)
            pg_name, seq = entry_pg_name(entry), entry.get("collective_seq_id")
            if any(pg == pg_name and start <= created <= end
                   for pg, start, end in python_windows):
                continue  # already a span from the Python wrapper
            self._emit_recorded(entry, pg_name, seq, created, infos.get(pg_name), windows,
                                step, parent, labels)

    def _emit_recorded(self, entry, pg_name, seq, created, info, windows, step, parent,
                       labels) -> None:
        op = op_name(entry.get("profiling_name", ""))
        nbytes = entry_bytes(entry)
        completed = entry.get("time_discovered_completed_ns") or 0
        end = completed
        if not end:  # gloo records no completion: bounded by the enclosing backward's end
            end = next((w_end for w_start, _, w_end in windows if w_start <= created <= w_end),
                       created)
        attributes = {
            semconv.COLL_OP: op, semconv.COLL_PG: pg_name,
            semconv.COLL_PG_DESC: entry_pg_desc(entry), semconv.COLL_SEQ: int(seq or 0),
            semconv.COLL_BYTES: nbytes, semconv.COLL_SOURCE: "flight_recorder",
            semconv.COLL_ASYNC: True,
        }
        dtypes = entry.get("input_dtypes") or ()
        if dtypes:
            attributes[semconv.COLL_DTYPE] = str(dtypes[0]).lower()
        if info is not None:
            attributes[semconv.COLL_GROUP_SIZE] = info.size
            attributes[semconv.COLL_GROUP_RANKS] = list(info.ranks)
            attributes[semconv.COLL_BACKEND] = info.backend
            if completed:
                started = entry.get("time_discovered_started_ns") or created
                bandwidth = busbw_gbps(op, nbytes, info.size, completed - started)
                if bandwidth is not None:
                    attributes[semconv.COLL_BUSBW_GBPS] = round(bandwidth, 4)
        attributes.update(labels)
        attributes[semconv.STEP] = step
        span = self.runtime.tracer.start_span(semconv.collective_span_name(op), context=parent,
                                              start_time=created, attributes=attributes)
        span.end(end_time=max(end, created))

    # ------------------------------------------------------------------ hangs
    def collective_in_flight(self, since_ns: int) -> dict | None:
        """For a thread blocked in C++ (backward waiting on DDP buckets): the oldest
        collective the flight recorder saw issued since `since_ns` and not completed."""
        candidates = [e for e in self.recorder.entries()
                      if (e.get("time_created_ns") or 0) >= since_ns
                      and not e.get("time_discovered_completed_ns")
                      and e.get("state") != "completed"]
        if not candidates:
            return None
        entry = min(candidates, key=lambda e: e.get("time_created_ns") or 0)
        return {semconv.HANG_COLL_OP: op_name(entry.get("profiling_name", "")),
                semconv.HANG_PG: entry_pg_name(entry),
                semconv.HANG_SEQ: int(entry.get("collective_seq_id") or 0)}
