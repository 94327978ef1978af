"""Pipelines: a signal's processors in order, then its exporters.

A request runs through the processors of every pipeline of its signal and is handed
to that pipeline's exporters. The committed log position is exact, not a guess: each
request carries its lsn through the processors. A processor of a buffering type
(`batch`, first-in first-out) holds the lsns fed to it, with their span counts; as
it emits spans, the oldest held requests are used up first and an lsn moves on with
the output that carries its last span. The commit (see worker.py) never passes the
oldest lsn still held. Other processors returning None have dropped the request on
purpose (and count it).

Batches for a durable exporter (the store) go through the ExportGate, in log order:
one the exporter refuses holds the log position before it (it stays in the
write-ahead log) and is tried again at every flush interval, with the batches after
it waiting behind; after `DELIVERY_ATTEMPTS` refusals it is written to the
dead-letter directory (dead_letter.py), counted and logged, and the rest go on. An
acknowledged request is never silently dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.collector.dead_letter import DeadLetter
from flare.collector.telemetry import Counters
from flare.collector.validate import point_count
from flare.exporters.flare_store import FlareStoreExporter

log = logging.getLogger(__name__)

# Refusals of one batch by a durable exporter before it goes to the dead-letter
# directory: one try on arrival, then one per flush interval.
DELIVERY_ATTEMPTS = 3

BUFFERING_PROCESSOR_TYPES = frozenset({"batch"})
# Processors that never rewrite the spans they are given (the correlator only appends
# spans of its own, which changes the count): behind only these, an unchanged span
# count means the request still matches the bytes it arrived as.
PRESERVING_PROCESSOR_TYPES = frozenset({"memory_limiter", "rank_correlation"})


@dataclass
class _HeldUnit:
    lsns: list[int]
    remaining: int  # spans of this unit not yet emitted


@dataclass
class Stage:
    id: str
    type: str
    processor: Any
    held: deque[_HeldUnit] = field(default_factory=deque)  # inside a buffering processor

    @property
    def buffers(self) -> bool:
        return self.type in BUFFERING_PROCESSOR_TYPES

    def hold(self, lsns: list[int], spans: int) -> None:
        if lsns:
            self.held.append(_HeldUnit(lsns, spans))

    def release(self, spans: int) -> list[int]:
        """The lsns whose spans are all out once `spans` more have been emitted.

        A buffering processor is first-in first-out (a batch appends requests and
        emits, or splits, in arrival order), so emitted spans use up the oldest held
        requests first: an lsn is released exactly when its last span has left.
        """
        released: list[int] = []
        while self.held and (spans > 0 or self.held[0].remaining == 0):
            unit = self.held[0]
            used = min(spans, unit.remaining)
            unit.remaining -= used
            spans -= used
            if unit.remaining:
                break
            released.extend(self.held.popleft().lsns)
        return released

    def oldest_held(self) -> int | None:
        return min(self.held[0].lsns) if self.held else None


class Pipeline:
    def __init__(
        self,
        pipeline_id: str,
        signal: str,
        stages: list[Stage],
        exporters: list[tuple[str, Any]],
        counters: Counters,
    ) -> None:
        self.id = pipeline_id
        self.signal = signal
        self.stages = stages
        self.exporters = exporters
        self.counters = counters
        # Exporter id -> lsn it already holds; set while replaying the log after a
        # crash so each exporter gets exactly what it is missing.
        self.skip_upto: dict[str, int] = {}
        self.gate: ExportGate | None = None

    def push(self, request: Any, lsns: list[int], payload: bytes | None = None) -> None:
        """Run `request` through the pipeline; `payload` is its encoding, if known.

        `request` None (a trace request the receiver did not parse) runs as bytes through
        the stages that take them (`process_traces_wire`) and is parsed at the first
        stage or exporter that needs the message.
        """
        if request is None and payload is None:
            raise ValueError("a request or its encoding is needed")
        self._run(request, lsns, 0, payload)

    def tick(self, now_ns: int) -> None:
        for index, stage in enumerate(self.stages):
            tick = getattr(stage.processor, "tick", None)
            if tick is None:
                continue
            self._emit(index, tick(now_ns) or [])

    def shutdown(self) -> None:
        for index, stage in enumerate(self.stages):
            self._emit(index, stage.processor.shutdown() or [])

    def oldest_held(self) -> int | None:
        held = [lsn for stage in self.stages if (lsn := stage.oldest_held()) is not None]
        return min(held) if held else None

    def _emit(self, index: int, outputs: list[Any]) -> None:
        stage = self.stages[index]
        for output in outputs:
            lsns = stage.release(_span_count(output)) if stage.buffers else []
            self._run(output, lsns, index + 1)

    def _run(self, request: Any, lsns: list[int], start: int, payload: bytes | None = None) -> None:
        for index in range(start, len(self.stages)):
            stage = self.stages[index]
            if request is None:  # trace request bytes, not parsed yet
                wire = None if stage.buffers else getattr(stage.processor, "process_traces_wire", None)
                if wire is not None:
                    out = wire(payload)
                    if out is None:
                        self.counters.add("processor_dropped_requests", processor=stage.id)
                        return
                    payload = out
                    continue
                request = ExportTraceServiceRequest.FromString(payload)
            traces = isinstance(request, ExportTraceServiceRequest)
            if stage.buffers and traces:
                stage.hold(lsns, _span_count(request))
            spans_before = _span_count(request) if payload is not None and traces else 0
            if traces and payload is not None and hasattr(stage.processor, "process_traces_encoded"):
                out = stage.processor.process_traces_encoded(request, payload)
            elif traces:
                out = stage.processor.process_traces(request)
            else:
                out = stage.processor.process_metrics(request)
            if payload is not None and not (
                stage.type in PRESERVING_PROCESSOR_TYPES and out is request
                and (not traces or _span_count(out) == spans_before)
            ):
                payload = None  # the request changed: its original bytes no longer match
            if stage.buffers and traces:
                lsns = stage.release(_span_count(out)) if out is not None else []
            if out is None:
                if not (stage.buffers and traces):
                    self.counters.add("processor_dropped_requests", processor=stage.id)
                return
            request = out
        self._export(request, lsns, payload)

    def _export(self, request: Any, lsns: list[int], payload: bytes | None = None) -> None:
        newest = max(lsns) if lsns else None
        traces = request is None or isinstance(request, ExportTraceServiceRequest)
        for exporter_id, exporter in self.exporters:
            if newest is not None and newest <= self.skip_upto.get(exporter_id, 0):
                continue
            if payload is not None and traces and isinstance(exporter, FlareStoreExporter):
                # The store decodes bytes directly: handing it the bytes the client sent
                # (plus any spans a processor added) saves parsing and re-encoding.
                request_or_bytes: Any = payload
            else:
                if request is None:  # parsed once, for every exporter that wants the message
                    request = ExportTraceServiceRequest.FromString(payload)
                request_or_bytes = request
            if self.gate is not None and exporter_id in self.gate.durable_ids:
                self.gate.submit(_Delivery(self, exporter_id, exporter, request_or_bytes, traces,
                                           list(lsns)))
                continue
            self.deliver(exporter_id, exporter, request_or_bytes, traces)

    def deliver(self, exporter_id: str, exporter: Any, request: Any, traces: bool) -> str | None:
        """Hand a batch to an exporter; None when taken, else why not (counted, logged)."""
        try:
            if traces:
                exporter.export_traces(request)
            else:
                exporter.export_metrics(request)
        except Exception as exc:
            self.counters.add("export_errors", exporter=exporter_id)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.error("exporter %s failed to take a batch: %s", exporter_id, reason)
            return reason
        return None


@dataclass
class _Delivery:
    pipeline: Pipeline
    exporter_id: str
    exporter: Any
    request: Any  # the message, or trace request bytes
    traces: bool
    lsns: list[int]
    attempts: int = 0
    reason: str = ""


class ExportGate:
    """Delivers batches to the durable exporters in log order.

    While a flush runs on its own thread (`closed`), batches wait here and are handed
    over when it returns: the flush writes what the exporter buffered when it was
    called, under the log position computed at that moment, so the recorded position
    stays exact while the processors keep working during the store's I/O.

    A batch the exporter refuses waits here too, with everything for that exporter
    behind it, and holds the log position before its lsns (`oldest_held`), so it stays
    in the write-ahead log. `retry` (every flush interval) tries it again; after
    `attempts` refusals it goes to the dead-letter directory and the rest move on.
    """

    def __init__(
        self, durable_ids: set[str], counters: Counters | None = None,
        dead_letter: DeadLetter | None = None, attempts: int = DELIVERY_ATTEMPTS,
    ) -> None:
        self.durable_ids = frozenset(durable_ids)
        self.counters = counters if counters is not None else Counters()
        self.dead_letter = dead_letter
        self.attempts = attempts
        self.closed = False
        self.waiting: deque[_Delivery] = deque()

    def submit(self, delivery: _Delivery) -> None:
        if self.closed or any(d.exporter_id == delivery.exporter_id for d in self.waiting):
            self.waiting.append(delivery)  # keeps log order behind what waits
        elif not self._try(delivery):
            self.waiting.append(delivery)

    def open(self) -> None:
        self.closed = False
        self.retry()

    def retry(self) -> None:
        """Hand over what waits, in order; an exporter that refuses again keeps the rest."""
        if self.closed or not self.waiting:
            return
        refused: set[str] = set()
        keep: deque[_Delivery] = deque()
        for delivery in self.waiting:
            if delivery.exporter_id in refused:
                keep.append(delivery)
                continue
            if self._try(delivery):
                continue
            if delivery.attempts >= self.attempts:
                self._bury(delivery)
                continue
            refused.add(delivery.exporter_id)
            keep.append(delivery)
        self.waiting = keep

    def oldest_held(self) -> int | None:
        lsns = [min(d.lsns) for d in self.waiting if d.lsns]
        return min(lsns) if lsns else None

    def _try(self, delivery: _Delivery) -> bool:
        reason = delivery.pipeline.deliver(
            delivery.exporter_id, delivery.exporter, delivery.request, delivery.traces)
        if reason is None:
            return True
        delivery.attempts += 1
        delivery.reason = reason
        return False

    def _bury(self, delivery: _Delivery) -> None:
        """Out of the way of the batches behind it, never silently: a file, a count, a line."""
        request = delivery.request
        is_bytes = isinstance(request, (bytes, bytearray, memoryview))
        payload = bytes(request) if is_bytes else request.SerializeToString()
        if delivery.traces:
            count = _span_count(ExportTraceServiceRequest.FromString(payload) if is_bytes else request)
        else:
            count = point_count(request)
        where = None
        if self.dead_letter is not None:
            where = self.dead_letter.write(
                delivery.traces, payload, delivery.lsns,
                f"exporter {delivery.exporter_id} refused it {delivery.attempts} times: "
                f"{delivery.reason}")
        unit = "spans" if delivery.traces else "metric_points"
        if where is not None:
            self.counters.add("dead_letter_requests", exporter=delivery.exporter_id)
            self.counters.add("dead_letter_" + unit, count, exporter=delivery.exporter_id)
            log.error("exporter %s refused a batch of %d %s %d times (%s); moved to %s",
                      delivery.exporter_id, count, unit.replace("_", " "), delivery.attempts,
                      delivery.reason, where)
        else:
            self.counters.add("dropped_" + unit, count, exporter=delivery.exporter_id)
            log.error("exporter %s refused a batch of %d %s %d times (%s) and there is no "
                      "write-ahead log to keep it in: dropped", delivery.exporter_id, count,
                      unit.replace("_", " "), delivery.attempts, delivery.reason)


def _span_count(request: Any) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

