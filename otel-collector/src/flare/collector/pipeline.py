"""Pipelines (processors → exporters) and the worker thread that drives them.

One worker consumes the ingest queue in log order. Each item runs through the
processors of every pipeline of its signal and is handed to that pipeline's
exporters. Every `flush_interval` the worker ticks the processors (the correlator
emits closed windows then), flushes the *durable* exporters (on a flusher thread,
while it goes on processing; see ExportGate) — those whose `flush`
takes a `commit_marker`, i.e. `flare_store` — with the log position everything up to
which they now hold, and frees the write-ahead log behind the lowest such position.

The committed position is exact, not a guess: each request carries its lsn through
the processors. A processor of a buffering type (`batch`, first-in first-out) holds
the lsns fed to it, with their span counts; as it emits spans, the oldest held
requests are used up first and an lsn moves on with the output that carries its last
span. The commit never passes the oldest lsn still held. Other processors returning
None have dropped the request on purpose (and count it).

Forwarding exporters (`otlp`) queue and send on their own threads; the worker never
waits for them except at shutdown, within the deadline, so a dead forward target
cannot stall the store path.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.collector.ingest import Item, ItemQueue
from flare.collector.telemetry import Counters
from flare.collector.wal import SIGNAL_METRICS, SIGNAL_TRACES, WriteAheadLog

log = logging.getLogger(__name__)

BUFFERING_PROCESSOR_TYPES = frozenset({"batch"})


def is_durable(exporter: Any) -> bool:
    """An exporter that can record a log position atomically with its data."""
    try:
        params = inspect.signature(exporter.flush).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return "commit_marker" in params and hasattr(exporter, "read_meta")


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

    def push(self, request: Any, lsns: list[int]) -> None:
        self._run(request, lsns, 0)

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

    def _run(self, request: Any, lsns: list[int], start: int) -> None:
        for index in range(start, len(self.stages)):
            stage = self.stages[index]
            traces = isinstance(request, ExportTraceServiceRequest)
            if stage.buffers and traces:
                stage.hold(lsns, _span_count(request))
            if traces:
                out = stage.processor.process_traces(request)
            else:
                out = stage.processor.process_metrics(request)
            if stage.buffers and traces:
                lsns = stage.release(_span_count(out)) if out is not None else []
            if out is None:
                if not (stage.buffers and traces):
                    self.counters.add("processor_dropped_requests", processor=stage.id)
                return
            request = out
        self._export(request, lsns)

    def _export(self, request: Any, lsns: list[int]) -> None:
        newest = max(lsns) if lsns else None
        traces = isinstance(request, ExportTraceServiceRequest)
        for exporter_id, exporter in self.exporters:
            if newest is not None and newest <= self.skip_upto.get(exporter_id, 0):
                continue
            if self.gate is not None and self.gate.holds(exporter_id):
                self.gate.waiting.append((self, exporter_id, exporter, request, traces))
                continue
            self.deliver(exporter_id, exporter, request, traces)

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


@dataclass
class _FlushResult:
    mark: int
    targets: list[str]
    started: float
    errors: dict[str, Exception] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _FlushDone:
    """Queued by the flusher thread to wake the worker."""

    result: _FlushResult


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


@dataclass
class _Stop:
    deadline: float  # time.monotonic() by which draining must end
    done: threading.Event = field(default_factory=threading.Event)
    drained: bool = False


class Worker:
    def __init__(
        self,
        queue: ItemQueue,
        pipelines: list[Pipeline],
        exporters: dict[str, Any],
        wal: WriteAheadLog | None,
        marker_key: str,
        counters: Counters,
        flush_interval_s: float,
    ) -> None:
        self.queue = queue
        self.pipelines = pipelines
        self.by_signal = {
            SIGNAL_TRACES: [p for p in pipelines if p.signal == "traces"],
            SIGNAL_METRICS: [p for p in pipelines if p.signal == "metrics"],
        }
        self.exporters = exporters
        self.durable = {eid: e for eid, e in exporters.items() if is_durable(e)}
        self.wal = wal
        self.marker_key = marker_key
        self.counters = counters
        self.flush_interval_s = flush_interval_s
        self.last_fed_lsn = 0
        self.committed: dict[str, int] = {}  # durable exporter id -> lsn it holds
        self._unreleased: list[Item] = []  # admitted items not yet durable downstream
        self._thread: threading.Thread | None = None
        self._flush_error_logged: dict[str, str] = {}
        self.flush_seconds_last = 0.0
        self.gate = ExportGate(set(self.durable))
        for pipeline in pipelines:
            pipeline.gate = self.gate
        self._inflight: _FlushResult | None = None  # a flush running on its own thread

    # ------------------------------------------------------------ start-up
    def load_markers(self) -> int:
        """Read each durable exporter's committed lsn; return where replay starts."""
        for exporter_id, exporter in self.durable.items():
            value = exporter.read_meta(self.marker_key)
            self.committed[exporter_id] = int(value) if value else 0
        return min(self.committed.values()) if self.committed else 0

    def replay(self, records: Callable[[], Any], parse: Callable[[int, bytes], Any]) -> int:
        """Feed the log tail through the pipelines before receivers open; return count."""
        for pipeline in self.pipelines:
            pipeline.skip_upto = dict(self.committed)
        count = 0
        pending_bytes = 0
        for record in records():
            request = parse(record.signal, record.payload)
            if request is None:
                continue
            self._feed(Item(record.lsn, record.signal, request, len(record.payload)))
            count += 1
            pending_bytes += len(record.payload)
            if pending_bytes >= 64 << 20:  # bound memory on a long tail
                self.flush_cycle()
                pending_bytes = 0
        self.flush_cycle()
        for pipeline in self.pipelines:
            pipeline.skip_upto = {}
        return count

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flare-pipeline", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ control
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Process everything queued so far and flush it durably; True on success."""
        request = _Flush()
        self.queue.put(request)
        if not request.done.wait(timeout_s):
            return False
        return request.ok

    def stop(self, deadline_s: float) -> bool:
        """Drain the queue and shut the processors and exporters down; True if drained."""
        request = _Stop(time.monotonic() + deadline_s)
        self.queue.put(request)
        if self._thread is None:
            return True
        self._thread.join(deadline_s + 1.0)
        return request.drained

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_interval_s
        while True:
            item = self.queue.get(max(0.0, next_flush - time.monotonic()))
            if isinstance(item, Item):
                self._feed(item)
            elif isinstance(item, _FlushDone):
                if item.result is self._inflight:
                    self._complete(item.result)
            elif isinstance(item, _Flush):
                item.ok = self.flush_cycle()
                item.done.set()
                next_flush = time.monotonic() + self.flush_interval_s
            elif isinstance(item, _Stop):
                item.drained = self._drain(item.deadline)
                item.done.set()
                return
            if time.monotonic() >= next_flush:
                if self._inflight is None:
                    self._start_background_flush()
                next_flush = time.monotonic() + self.flush_interval_s

    def _feed(self, item: Item) -> None:
        pipelines = self.by_signal.get(item.signal, ())
        for index, pipeline in enumerate(pipelines):
            request = item.request
            if index < len(pipelines) - 1:  # later pipelines must see it unmodified
                request = type(request)()
                request.CopyFrom(item.request)
            try:
                pipeline.push(request, [item.lsn] if item.lsn else [])
            except Exception as exc:
                self.counters.add("pipeline_errors", pipeline=pipeline.id)
                log.error("pipeline %s failed on a request: %s", pipeline.id, exc)
        self.last_fed_lsn = max(self.last_fed_lsn, item.lsn)
        if item.admitted:
            self._unreleased.append(item)

    def watermark(self) -> int:
        """The highest lsn such that every lsn up to it has reached the exporters."""
        held = [h for p in self.pipelines if (h := p.oldest_held()) is not None]
        return min(min(held) - 1, self.last_fed_lsn) if held else self.last_fed_lsn

    def flush_cycle(self, final: bool = False) -> bool:
        """Tick (or shut down) the processors and flush the durable exporters, in this thread."""
        self._await_inflight()
        result = self._prepare(final)
        self._write(result)
        return self._finish(result)

    def _start_background_flush(self) -> None:
        """The periodic flush: store I/O on its own thread while processing continues."""
        result = self._prepare(final=False)
        if not result.targets:
            self._finish(result)
            return
        self._inflight = result
        self.gate.closed = True

        def run() -> None:
            self._write(result)
            self.queue.put(_FlushDone(result), front=True)

        threading.Thread(target=run, name="flare-flush", daemon=True).start()

    def _await_inflight(self) -> None:
        if self._inflight is not None:
            self._inflight.done.wait()
            self._complete(self._inflight)

    def _complete(self, result: _FlushResult) -> None:
        self._inflight = None
        self._finish(result)
        self.gate.open()

    def _prepare(self, final: bool) -> _FlushResult:
        started = time.perf_counter()
        now_ns = time.time_ns()
        for pipeline in self.pipelines:
            try:
                if final:
                    pipeline.shutdown()
                else:
                    pipeline.tick(now_ns)
            except Exception as exc:
                self.counters.add("pipeline_errors", pipeline=pipeline.id)
                log.error("pipeline %s failed while ticking: %s", pipeline.id, exc)
        mark = self.watermark()
        targets = [
            exporter_id for exporter_id, exporter in self.durable.items()
            # An idle collector leaves the store file alone, free for readers.
            if final or self._has_news(exporter_id, exporter, mark)
        ]
        return _FlushResult(mark, targets, started)

    def _write(self, result: _FlushResult) -> None:
        try:
            for exporter_id in result.targets:
                try:
                    self.durable[exporter_id].flush(commit_marker=(self.marker_key, str(result.mark)))
                except Exception as exc:
                    result.errors[exporter_id] = exc
        finally:
            result.done.set()

    def _finish(self, result: _FlushResult) -> bool:
        for exporter_id in result.targets:
            exc = result.errors.get(exporter_id)
            if exc is not None:
                self.counters.add("flush_errors", exporter=exporter_id)
                self._log_flush_error(exporter_id, exc)
                continue
            self.committed[exporter_id] = result.mark
            if self._flush_error_logged.pop(exporter_id, None) is not None:
                log.warning("exporter %s flushes again", exporter_id)
        durable_upto = min(self.committed.values()) if self.committed else result.mark
        if self.wal is not None:
            self.wal.commit(durable_upto)
        self._release(durable_upto if self.durable else None)
        self.flush_seconds_last = time.perf_counter() - result.started
        return not result.errors

    def _has_news(self, exporter_id: str, exporter: Any, mark: int) -> bool:
        if self.committed.get(exporter_id) != mark:
            return True
        buffered = getattr(exporter, "buffered", None)
        return bool(buffered()) if callable(buffered) else True

    def _release(self, durable_upto: int | None) -> None:
        """Give admitted bytes back to the memory limiters once they are durable."""
        keep = []
        for item in self._unreleased:
            if durable_upto is None or item.lsn == 0 or item.lsn <= durable_upto:
                for limiter in item.admitted:
                    limiter.release(item.nbytes)
            else:
                keep.append(item)
        self._unreleased = keep

    def _log_flush_error(self, exporter_id: str, exc: Exception) -> None:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._flush_error_logged.get(exporter_id) != text:
            log.error("exporter %s could not flush (data stays in the write-ahead log): %s", exporter_id, text)
            self._flush_error_logged[exporter_id] = text

    def _drain(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            item = self.queue.get(0.0)
            if item is None:
                break
            if isinstance(item, Item):
                self._feed(item)
            elif isinstance(item, _Flush):
                item.done.set()
        else:
            log.warning("drain deadline reached with %d requests queued; they stay in the write-ahead log", len(self.queue))
            self.flush_cycle()
            return False
        ok = self.flush_cycle(final=True)
        self._shutdown_exporters(deadline)
        return ok

    def _shutdown_exporters(self, deadline: float) -> None:
        """Shut exporters down in parallel; forwarders get what is left of the deadline."""
        threads = []
        for exporter_id, exporter in self.exporters.items():
            thread = threading.Thread(
                target=_shutdown_one, args=(exporter_id, exporter), daemon=True,
                name=f"flare-shutdown-{exporter_id}",
            )
            thread.start()
            threads.append((exporter_id, thread))
        for exporter_id, thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("exporter %s did not shut down within the deadline", exporter_id)


def _shutdown_one(exporter_id: str, exporter: Any) -> None:
    try:
        exporter.shutdown()
    except Exception as exc:
        log.error("exporter %s failed to shut down: %s", exporter_id, exc)


def _span_count(request: Any) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def parse_record(signal: int, payload: bytes) -> Any:
    """Decode a logged request; None (and a warning) for a record that will not parse."""
    cls = ExportTraceServiceRequest if signal == SIGNAL_TRACES else ExportMetricsServiceRequest
    try:
        return cls.FromString(payload)
    except Exception as exc:
        log.warning("skipping an undecodable write-ahead log record: %s", exc)
        return None
