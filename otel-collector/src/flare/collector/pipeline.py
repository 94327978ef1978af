"""Pipelines: a signal's processors in order, then its exporters.

A request runs through the processors of every pipeline of its signal and is handed
to that pipeline's exporters. The committed log position is exact, not a guess: each
request carries its lsn through the processors. A processor of a buffering type
(`batch`, first-in first-out) holds the lsns fed to it, with their span counts; as
it emits spans, the oldest held requests are used up first and an lsn moves on with
the output that carries its last span. The commit (see worker.py) never passes the
oldest lsn still held. Other processors returning None have dropped the request on
purpose (and count it).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.collector.telemetry import Counters
from flare.exporters.flare_store import FlareStoreExporter

log = logging.getLogger(__name__)

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
            if self.gate is not None and self.gate.holds(exporter_id):
                self.gate.waiting.append((self, exporter_id, exporter, request_or_bytes, traces))
                continue
            self.deliver(exporter_id, exporter, request_or_bytes, traces)

    def deliver(self, exporter_id: str, exporter: Any, request: Any, traces: bool) -> None:
        try:
            if traces:
                exporter.export_traces(request)
            else:
                exporter.export_metrics(request)
        except Exception as exc:
            self.counters.add("export_errors", exporter=exporter_id)
            log.error("exporter %s failed to take a batch: %s", exporter_id, exc)


class ExportGate:
    """Holds batches for the durable exporters while their flush runs on its own thread.

    The flush writes what the exporter buffered when it was called, under the log
    position computed at that moment; batches fed meanwhile wait here and are handed
    over when it returns, so the recorded position stays exact while the processors
    keep working during the store's I/O.
    """

    def __init__(self, durable_ids: set[str]) -> None:
        self.durable_ids = frozenset(durable_ids)
        self.closed = False
        self.waiting: list[tuple[Pipeline, str, Any, Any, bool]] = []

    def holds(self, exporter_id: str) -> bool:
        return self.closed and exporter_id in self.durable_ids

    def open(self) -> None:
        self.closed = False
        waiting, self.waiting = self.waiting, []
        for pipeline, exporter_id, exporter, request, traces in waiting:
            pipeline.deliver(exporter_id, exporter, request, traces)


def _span_count(request: Any) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
