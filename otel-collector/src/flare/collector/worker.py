"""The pipeline worker: one thread that drives the pipelines in log order.

It consumes the ingest queue and feeds each item to the pipelines of its signal.
Every `flush_interval` it ticks the processors (the correlator emits closed windows
then) and flushes the *durable* exporters — those whose `flush` takes a
`commit_marker`, i.e. `flare_store` — with the log position everything up to which
they now hold, then frees the write-ahead log behind the lowest such position. The
periodic flush runs on a flusher thread while the worker goes on processing;
batches for the durable exporters wait at the ExportGate meanwhile, so the recorded
position stays exact.

Forwarding exporters (`otlp`) queue and send on their own threads; the worker never
waits for them except at shutdown, within the deadline, so a dead forward target
cannot stall the store path.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.collector.dead_letter import DeadLetter
from flare.collector.errors import StartError
from flare.collector.ingest import Item, ItemQueue
from flare.collector.pipeline import ExportGate, Pipeline
from flare.collector.telemetry import Counters
from flare.collector.wal import SIGNAL_METRICS, SIGNAL_TRACES, WriteAheadLog
from flare.exporters.store import ROW_GROUP_ROWS, StoreFull

# Under load the periodic flush waits for a whole DuckDB row group (written once
# instead of twice, ~2x cheaper per span), but never longer than this many flush
# intervals: readers see data at most that much later than at low load.
MAX_FLUSH_DELAY_INTERVALS = 4

log = logging.getLogger(__name__)

# Store flushes that found no room (`flare_collector_store_disk_full_errors_total`).
DISK_FULL_COUNTER = "store_disk_full_errors"
# A flush error that lasts is logged again this often (each flush counts in /metrics).
REPEAT_FLUSH_ERROR_LOG_S = 60.0


def is_durable(exporter: Any) -> bool:
    """An exporter that can record a log position atomically with its data."""
    try:
        params = inspect.signature(exporter.flush).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return "commit_marker" in params and hasattr(exporter, "read_meta")


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


class FlushErrors:
    """What the durable exporters' failed flushes leave behind: a count each in
    /metrics (full disks apart), and a log line when the cause is new (a full disk is
    one cause, whatever the space left) and again every REPEAT_FLUSH_ERROR_LOG_S while
    it lasts; "flushes again" ends it."""

    def __init__(self, counters: Counters, kept_in: str) -> None:
        self._counters = counters
        self._kept_in = kept_in  # where the rows wait meanwhile
        self._logged: dict[str, tuple[str, float]] = {}  # id -> (cause, when)

    def failed(self, exporter_id: str, exc: Exception) -> None:
        self._counters.add("flush_errors", exporter=exporter_id)
        if isinstance(exc, StoreFull):
            self._counters.add(DISK_FULL_COUNTER, exporter=exporter_id)
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        cause = "disk full" if isinstance(exc, StoreFull) else text
        now = time.monotonic()
        said = self._logged.get(exporter_id)
        if said is None or said[0] != cause or now - said[1] >= REPEAT_FLUSH_ERROR_LOG_S:
            log.error("exporter %s could not flush: %s; the rows stay in %s and are retried",
                      exporter_id, text, self._kept_in)
            self._logged[exporter_id] = (cause, now)

    def succeeded(self, exporter_id: str) -> None:
        if self._logged.pop(exporter_id, None) is not None:
            log.warning("exporter %s flushes again", exporter_id)


class Admitted:
    """Admitted items whose bytes the memory limiters still count: given back once the
    items are durable downstream (at or below the lowest committed log position)."""

    def __init__(self) -> None:
        self._items: list[Item] = []

    def hold(self, item: Item) -> None:
        self._items.append(item)

    def release(self, durable_upto: int | None) -> None:
        """None: no durable exporter, so everything fed is released."""
        keep = []
        for item in self._items:
            if durable_upto is None or item.lsn == 0 or item.lsn <= durable_upto:
                for limiter in item.admitted:
                    limiter.release(item.nbytes)
            else:
                keep.append(item)
        self._items = keep


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
        self._unreleased = Admitted()  # admitted items not yet durable downstream
        self._thread: threading.Thread | None = None
        self._flush_errors = FlushErrors(counters, "the write-ahead log" if wal is not None else "memory")
        self.flush_seconds_last = 0.0
        self.dead_letter = DeadLetter(wal.directory / "dead-letter") if wal is not None else None
        self.gate = ExportGate(set(self.durable), counters, self.dead_letter)
        for pipeline in pipelines:
            pipeline.gate = self.gate
        self._inflight: _FlushResult | None = None  # a flush running on its own thread
        self._last_flush_started = time.monotonic()
        self._last_flush_errors: set[str] = set()  # durable exporters whose last flush failed
        counters.describe(DISK_FULL_COUNTER, "store flushes that failed because the disk "
                          "(or the file size limit) had no room; the rows wait in the "
                          "write-ahead log and are retried")
        for exporter_id in self.durable:  # a panel shows 0, not "No data", until it happens
            counters.add(DISK_FULL_COUNTER, 0.0, exporter=exporter_id)

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
        # Everything up to the lowest committed position is in every store already.
        self.last_fed_lsn = max(self.last_fed_lsn, min(self.committed.values(), default=0))
        count = 0
        pending_bytes = 0
        for record in records():
            request = parse(record.signal, record.payload)
            if request is None:
                bury(record, self.counters, self.dead_letter)
                continue
            self._feed(Item(record.lsn, record.signal, request, len(record.payload), payload=record.payload))
            count += 1
            pending_bytes += len(record.payload)
            if pending_bytes >= 64 << 20:  # bound memory on a long tail
                self._replay_flush()
                pending_bytes = 0
        self.flush_cycle()
        for pipeline in self.pipelines:
            pipeline.skip_upto = {}
        return count

    def _replay_flush(self, attempts: int = 3) -> None:
        """Flush mid-replay; a store that stays unwritable stops the start, not memory."""
        for _ in range(attempts):
            if self.flush_cycle():
                return
        raise StartError(
            "cannot write the store while replaying the write-ahead log "
            "(see the error above); the log is kept for the next start"
        )

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
            now = time.monotonic()
            if now >= next_flush:
                if self._inflight is None and self._flush_due(now):
                    self._last_flush_started = now
                    self._start_background_flush()
                    next_flush = now + self.flush_interval_s
                else:
                    next_flush = now + self.flush_interval_s / 4

    def _flush_due(self, now: float) -> bool:
        """Flush on interval at low load; on a full row group (or the delay cap) at high load."""
        elapsed = now - self._last_flush_started
        buffered = max((_buffered(e) for e in self.durable.values()), default=0)
        if buffered >= ROW_GROUP_ROWS or elapsed >= MAX_FLUSH_DELAY_INTERVALS * self.flush_interval_s:
            return True
        # The rate so far would not fill a row group before the cap: waiting would only
        # make the data later for readers, so flush on the interval as usual.
        projected = buffered / max(elapsed, 1e-3) * MAX_FLUSH_DELAY_INTERVALS * self.flush_interval_s
        return projected < ROW_GROUP_ROWS

    def _feed(self, item: Item) -> None:
        pipelines = self.by_signal.get(item.signal, ())
        for index, pipeline in enumerate(pipelines):
            request = item.request
            # Later pipelines must see it unmodified (bytes, when not parsed, are never modified).
            if request is not None and index < len(pipelines) - 1:
                request = type(request)()
                request.CopyFrom(item.request)
            try:
                pipeline.push(request, [item.lsn] if item.lsn else [], item.payload)
            except Exception as exc:
                self.counters.add("pipeline_errors", pipeline=pipeline.id)
                log.error("pipeline %s failed on a request: %s", pipeline.id, exc)
        self.last_fed_lsn = max(self.last_fed_lsn, item.lsn)
        if item.admitted:
            self._unreleased.hold(item)

    def watermark(self) -> int:
        """The highest lsn such that every lsn up to it has reached the exporters."""
        held = [h for p in self.pipelines if (h := p.oldest_held()) is not None]
        if (waiting := self.gate.oldest_held()) is not None:
            held.append(waiting)
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
        self.gate.retry()  # batches a durable exporter refused, before the position is taken
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
                # Never record a lower position than the store already has.
                mark = max(result.mark, self.committed.get(exporter_id, 0))
                try:
                    self.durable[exporter_id].flush(commit_marker=(self.marker_key, str(mark)))
                except Exception as exc:
                    result.errors[exporter_id] = exc
        finally:
            result.done.set()

    def _finish(self, result: _FlushResult) -> bool:
        self._last_flush_errors = set(result.errors)
        for exporter_id in result.targets:
            exc = result.errors.get(exporter_id)
            if exc is not None:
                self._flush_errors.failed(exporter_id, exc)
                continue
            self.committed[exporter_id] = max(result.mark, self.committed.get(exporter_id, 0))
            self._flush_errors.succeeded(exporter_id)
        durable_upto = min(self.committed.values()) if self.committed else result.mark
        if self.wal is not None:
            self.wal.commit(durable_upto)
        self._unreleased.release(durable_upto if self.durable else None)
        self.flush_seconds_last = time.perf_counter() - result.started
        return not result.errors

    def _has_news(self, exporter_id: str, exporter: Any, mark: int) -> bool:
        if self.committed.get(exporter_id) != mark:
            return True
        buffered = getattr(exporter, "buffered", None)
        return bool(buffered()) if callable(buffered) else True

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
        self._shutdown_exporters(deadline, skip=set(self._last_flush_errors))
        return ok

    def _shutdown_exporters(self, deadline: float, skip: set[str]) -> None:
        """Shut exporters down in parallel; forwarders get what is left of the deadline.

        A store exporter whose final flush failed is skipped: its shutdown would flush
        the same rows without their log position, and the next start replays them.
        """
        threads = []
        for exporter_id, exporter in self.exporters.items():
            if exporter_id in skip:
                continue
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


def bury(record: Any, counters: Counters, dead_letter: DeadLetter | None) -> None:
    """A logged request that no longer parses (another protobuf runtime?): kept aside."""
    counters.add("dead_letter_requests", exporter="replay")
    if dead_letter is not None:
        where = dead_letter.write(
            record.signal == SIGNAL_TRACES, record.payload, [record.lsn],
            "the write-ahead log record does not parse as an OTLP request")
        log.error("write-ahead log record %d does not parse; moved to %s", record.lsn, where)


def _buffered(exporter: Any) -> int:
    buffered = getattr(exporter, "buffered", None)
    return int(buffered()) if callable(buffered) else 0


def _shutdown_one(exporter_id: str, exporter: Any) -> None:
    try:
        exporter.shutdown()
    except Exception as exc:
        log.error("exporter %s failed to shut down: %s", exporter_id, exc)


def parse_record(signal: int, payload: bytes) -> Any:
    """Decode a logged request; None (and a warning) for a record that will not parse
    (the worker then moves it to the dead-letter directory)."""
    cls = ExportTraceServiceRequest if signal == SIGNAL_TRACES else ExportMetricsServiceRequest
    try:
        return cls.FromString(payload)
    except Exception as exc:
        log.warning("a write-ahead log record does not parse: %s", exc)
        return None
