"""The front door every receiver goes through: admit, log, enqueue — then reply OK.

An accepted request is (1) admitted by the pipelines' memory limiters and the queue's
byte budget, (2) appended to the write-ahead log, (3) queued for the pipeline worker.
Only then does the receiver answer OK, so an OK means "in the log" (see wal.py for
what that survives). Anything that does not fit is refused with a retry delay before
it touches the log, so a refused request leaves no trace and the client resends it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flare.collector.errors import Refused
from flare.collector.telemetry import Counters
from flare.collector.wal import WalFull, WriteAheadLog

RETRY_AFTER_OVERLOADED_S = 1.0
RETRY_AFTER_UNAVAILABLE_S = 5.0


@dataclass
class Item:
    """One accepted request on its way through the pipelines."""

    lsn: int  # 0 when no write-ahead log is configured
    signal: int  # wal.SIGNAL_TRACES | wal.SIGNAL_METRICS
    # ExportTraceServiceRequest | ExportMetricsServiceRequest; None for a trace request
    # the receiver did not parse (its `payload` is all there is, see Pipeline.push)
    request: Any
    nbytes: int
    admitted: list[Any] = field(default_factory=list)  # limiters to release later
    payload: bytes | None = None  # the logged encoding of `request`


class ItemQueue:
    """FIFO of accepted items bounded by their encoded size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[Any] = deque()
        self._ready = threading.Condition(threading.Lock())

    def __len__(self) -> int:
        return len(self._items)

    def has_room(self, nbytes: int) -> bool:
        # An empty queue takes any single request, so one large request cannot wedge it.
        return self.bytes + nbytes <= self.max_bytes or not self._items

    def put(self, item: Any, nbytes: int = 0, front: bool = False) -> None:
        with self._ready:
            if front:
                self._items.appendleft(item)
            else:
                self._items.append(item)
            self.bytes += nbytes
            self._ready.notify()

    def get(self, timeout_s: float) -> Any | None:
        with self._ready:
            if not self._items:
                self._ready.wait(timeout_s)
            if not self._items:
                return None
            item = self._items.popleft()
            if isinstance(item, Item):
                self.bytes -= item.nbytes
            return item


class Ingest:
    def __init__(
        self,
        queue: ItemQueue,
        wal: WriteAheadLog | None,
        limiters: dict[int, list[Any]],
        counters: Counters,
    ) -> None:
        self.queue = queue
        self.wal = wal
        self.limiters = limiters  # signal -> memory limiters of the pipelines it feeds
        self.counters = counters
        self.closed = False
        self._lock = threading.Lock()  # keeps log order == queue order

    def submit(self, signal: int, request: Any, payload: bytes) -> None:
        """Accept `request` (whose encoding is `payload`; None: not parsed) or raise Refused."""
        if self.closed:
            raise _shutting_down()
        nbytes = len(payload)
        admitted = []
        for limiter in self.limiters.get(signal, ()):
            if not limiter.admit(nbytes):
                for done in admitted:
                    done.release(nbytes)
                raise Refused("memory limit reached", RETRY_AFTER_OVERLOADED_S, overloaded=True, code="memory_limit")
            admitted.append(limiter)
        try:
            with self._lock:
                if self.closed:
                    raise _shutting_down()
                if not self.queue.has_room(nbytes):
                    raise Refused("pipeline queue is full", RETRY_AFTER_OVERLOADED_S, overloaded=True, code="queue_full")
                lsn = 0
                if self.wal is not None:
                    try:
                        lsn = self.wal.append(signal, payload)
                    except WalFull as exc:
                        raise Refused(str(exc), RETRY_AFTER_UNAVAILABLE_S, overloaded=False, code="wal_full")
                    except OSError as exc:
                        raise Refused(
                            f"cannot write the write-ahead log: {exc.strerror}",
                            RETRY_AFTER_UNAVAILABLE_S, overloaded=False, code="wal_error",
                        )
                self.queue.put(Item(lsn, signal, request, nbytes, admitted, payload), nbytes)
        except Refused:
            for done in admitted:
                done.release(nbytes)
            raise

    def close(self) -> None:
        """Refuse from now on; after this returns nothing more enters the queue."""
        with self._lock:
            self.closed = True


def _shutting_down() -> Refused:
    return Refused("collector is shutting down", RETRY_AFTER_UNAVAILABLE_S, overloaded=False, code="shutdown")
