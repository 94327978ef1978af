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
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.processors.base import Processor
from flare.processors.correlation_closing import WindowCloser
from flare.processors.correlation_config import CorrelationConfig
from flare.processors.correlation_ingest import RankIngest
from flare.processors.correlation_output import SCOPE_NAME
from flare.processors.correlation_state import JobState, RankHealth
from flare.processors.correlation_windows import Window
from flare.processors.span_select import Selection
from flare.wire import semconv as sc

__all__ = ["SCOPE_NAME", "JobState", "RankCorrelation", "RankHealth"]

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
    # What correlation_ingest's RankIngest._ingest_step reads: the C picker hands such
    # spans over as these values.
    step=(sc.SPAN_STEP, sc.RANK, sc.STEP, sc.STEP_COLLECTIVE_WAIT_MS, sc.STEP_PG_NAMES,
          sc.STEP_PG_WAIT_MS, sc.STEP_PG_LAST_SEQ),
)


class RankCorrelation(Processor):
    """The processor: its options (`CorrelationConfig`), the per-job state and what
    ingests spans into it (`RankIngest`), what closes and emits windows
    (`WindowCloser`), all under one lock."""

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
        config = CorrelationConfig.parse(
            grace_period, hang_grace_period, window, max_state_mib, max_pg_detail, expected_ranks,
        )
        self.grace_ns = config.grace_ns
        self.hang_grace_ns = config.hang_grace_ns
        self.window_ns = config.window_ns
        self.max_state_bytes = config.max_state_bytes
        self.max_pg_detail = config.max_pg_detail
        self.expected_ranks = config.expected_ranks
        self._clock = clock
        self._lock = threading.Lock()
        self._state = RankIngest(config.expected_ranks)
        self._closer = WindowCloser(self._state, config, clock)

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
        state = self._state
        ingest = state.ingest_resource
        with self._lock:
            completed: list[tuple[JobState, Window, str]] = []
            for resource, records in selected:
                ingest(resource, records, now, completed)
            if state.state_bytes > self.max_state_bytes:
                completed.extend(self._closer.over_budget())
            # Built in place: a span extended into a request later is copied whole,
            # and a train.step.ranks span carries one link per rank.
            self._closer.emit(completed, into)

    def tick(self, now_ns: int) -> list[ExportTraceServiceRequest]:
        """Close windows whose grace period ran out; forget what fell out of `window`.

        `now_ns` is the collector's wall clock (`time.time_ns()`), the clock arrival
        times are taken with.
        """
        with self._lock:
            closing = self._closer.due(now_ns)
            out = ExportTraceServiceRequest()
            self._closer.emit(closing, out.resource_spans)
        return [out] if out.resource_spans else []

    def shutdown(self) -> list[ExportTraceServiceRequest]:
        with self._lock:
            closing = self._closer.all_open()
            out = ExportTraceServiceRequest()
            self._closer.emit(closing, out.resource_spans)
        return [out] if out.resource_spans else []

    def metrics(self) -> dict[str, float]:
        with self._lock:
            state = self._state
            jobs = state.jobs
            out = dict(state.counters)
            out["state_bytes"] = float(state.state_bytes)
            out["jobs"] = float(len(jobs))
            out["open_step_windows"] = float(sum(len(j.steps) for j in jobs.values()))
            out["open_collective_windows"] = float(
                sum(len(j.collectives) for j in jobs.values())
            )
            out["hanging_ranks"] = float(
                sum(1 for j in jobs.values() for h in j.ranks.values() if h.hang)
            )
            now = self._clock()
            silences = [now - h.last_heard_ns for j in jobs.values() for h in j.ranks.values()]
            out["max_rank_silence_s"] = max(silences, default=0) / 1e9
        out["picker_fallbacks"] = float(_SELECTION.fallbacks)
        return out

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per job: each rank's last-heard times and hang location, and open windows."""
        with self._lock:
            jobs = self._state.jobs
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
                for job_id, job in jobs.items()
            }
