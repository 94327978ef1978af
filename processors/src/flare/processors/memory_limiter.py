"""Admission control by bytes in flight, in the spirit of otelcol's `memory_limiter`.

The receiver asks `admit(nbytes)` before it accepts a request and calls
`release(nbytes)` once that request is durable (written to the store or dropped on
purpose). Counting bytes the collector has accepted but not yet finished, rather than
sampling process RSS, makes the decision deterministic and immediate: a burst is
refused with backpressure (HTTP 429 / gRPC RESOURCE_EXHAUSTED) before it is read into
memory, not after the heap has grown.

Two thresholds, as in otelcol: above the soft limit (`limit_mib - spike_limit_mib`)
new data is refused until the backlog drains; a request that would cross the hard
limit (`limit_mib`) is always refused.
"""

from __future__ import annotations

import threading

from flare.processors import options
from flare.processors.base import Processor


class MemoryLimiter(Processor):
    def __init__(
        self,
        limit_mib: float = 512,
        spike_limit_mib: float | None = None,
        check_interval: object = None,  # accepted for otelcol compatibility; admission is exact
    ) -> None:
        self.limit_bytes = options.mib_bytes(limit_mib, "memory_limiter.limit_mib")
        if self.limit_bytes <= 0:
            raise ValueError("memory_limiter.limit_mib must be positive")
        if spike_limit_mib is None:
            self.spike_bytes = self.limit_bytes // 5  # otelcol's default: 20% of the limit
        else:
            self.spike_bytes = options.mib_bytes(spike_limit_mib, "memory_limiter.spike_limit_mib")
        if self.spike_bytes >= self.limit_bytes:
            raise ValueError("memory_limiter.spike_limit_mib must be below limit_mib")
        if check_interval is not None:
            options.duration_s(check_interval, "memory_limiter.check_interval")
        self.soft_limit_bytes = self.limit_bytes - self.spike_bytes
        self._lock = threading.Lock()
        self._in_flight = 0
        self._peak = 0
        self._admitted = 0
        self._refused = 0
        self._refused_bytes = 0

    def admit(self, nbytes: int) -> bool:
        """Reserve `nbytes` of the budget; False means refuse the request (retry later)."""
        if nbytes < 0:
            raise ValueError("cannot admit a negative size")
        with self._lock:
            if self._in_flight >= self.soft_limit_bytes or self._in_flight + nbytes > self.limit_bytes:
                self._refused += 1
                self._refused_bytes += nbytes
                return False
            self._in_flight += nbytes
            self._peak = max(self._peak, self._in_flight)
            self._admitted += 1
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            # Never below zero: a double release must not open the gate wider.
            self._in_flight = max(0, self._in_flight - nbytes)

    def process_traces_wire(self, payload: bytes) -> bytes:
        """Admission happened at the receiver: the request passes as it came."""
        return payload

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {
                "in_flight_bytes": float(self._in_flight),
                "peak_in_flight_bytes": float(self._peak),
                "limit_bytes": float(self.limit_bytes),
                "soft_limit_bytes": float(self.soft_limit_bytes),
                "admitted_requests": float(self._admitted),
                "refused_requests": float(self._refused),
                "refused_bytes": float(self._refused_bytes),
            }
