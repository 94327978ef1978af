"""`batch`: merge small trace requests into bigger ones, by size or after a timeout.

Bigger requests make every later stage cheaper (one store transaction, one forward
call per batch instead of per rank export). Options as in otelcol:
`send_batch_size` (spans that trigger a send), `timeout` (oldest buffered data is sent
after this long), `send_batch_max_size` (0 = no cap; bigger requests are split).
Metrics requests pass through unbatched: they are a handful per rank per interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flare.processors import options
from flare.processors.base import Processor, span_count


def split_request(
    request: ExportTraceServiceRequest, max_spans: int
) -> Iterator[ExportTraceServiceRequest]:
    """`request` cut into requests of at most `max_spans` spans, resources kept."""
    out = ExportTraceServiceRequest()
    room = max_spans
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            spans = list(scope_spans.spans)
            start = 0
            while start < len(spans):
                if room == 0:
                    yield out
                    out, room = ExportTraceServiceRequest(), max_spans
                take = spans[start:start + room]
                target_rs = out.resource_spans.add()
                target_rs.resource.CopyFrom(resource_spans.resource)
                target_rs.schema_url = resource_spans.schema_url
                target_ss = target_rs.scope_spans.add()
                target_ss.scope.CopyFrom(scope_spans.scope)
                target_ss.schema_url = scope_spans.schema_url
                target_ss.spans.extend(take)
                start += len(take)
                room -= len(take)
    if len(out.resource_spans):
        yield out


class BatchProcessor(Processor):
    def __init__(
        self,
        send_batch_size: int = 8192,
        timeout: object = "200ms",
        send_batch_max_size: int = 0,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.send_batch_size = options.count(send_batch_size, "batch.send_batch_size", minimum=1)
        self.timeout_ns = int(options.duration_s(timeout, "batch.timeout") * 1e9)
        self.send_batch_max_size = options.count(send_batch_max_size, "batch.send_batch_max_size")
        if self.send_batch_max_size and self.send_batch_max_size < self.send_batch_size:
            raise ValueError("batch.send_batch_max_size must be 0 or at least send_batch_size")
        self._clock = clock
        self._pending = ExportTraceServiceRequest()
        self._pending_spans = 0
        self._oldest_ns: int | None = None
        self._ready: list[ExportTraceServiceRequest] = []
        self._counters = {"batches_sent_size": 0.0, "batches_sent_timeout": 0.0, "spans_batched": 0.0}

    def process_traces(self, request: ExportTraceServiceRequest) -> ExportTraceServiceRequest | None:
        spans = span_count(request)
        if spans == 0:
            return None
        if self._oldest_ns is None:
            self._oldest_ns = self._clock()
        # Appending the ResourceSpans messages moves them without re-encoding.
        self._pending.resource_spans.extend(request.resource_spans)
        self._pending_spans += spans
        self._counters["spans_batched"] += spans
        if self._pending_spans < self.send_batch_size:
            return None
        self._counters["batches_sent_size"] += 1
        return self._take()

    def _take(self) -> ExportTraceServiceRequest:
        batch = self._pending
        self._pending = ExportTraceServiceRequest()
        self._pending_spans = 0
        self._oldest_ns = None
        if self.send_batch_max_size and span_count(batch) > self.send_batch_max_size:
            first, *rest = split_request(batch, self.send_batch_max_size)
            # The first piece goes out now; the others on the next tick, in order.
            self._ready.extend(rest)
            return first
        return batch

    def tick(self, now_ns: int) -> list[ExportTraceServiceRequest]:
        out, self._ready = self._ready, []
        if self._oldest_ns is not None and self._clock() - self._oldest_ns >= self.timeout_ns:
            self._counters["batches_sent_timeout"] += 1
            taken = self._take()
            out.append(taken)
            out.extend(self._ready)
            self._ready = []
        return out

    def pending_spans(self) -> int:
        """Spans held here: the open batch plus split-off pieces the next tick sends."""
        return self._pending_spans + sum(span_count(r) for r in self._ready)

    def metrics(self) -> dict[str, float]:
        out = dict(self._counters)
        out["pending_spans"] = float(self._pending_spans)
        return out

    def shutdown(self) -> list[ExportTraceServiceRequest]:
        out, self._ready = self._ready, []
        if self._pending_spans:
            out.append(self._take())
            out.extend(self._ready)
            self._ready = []
        return out
