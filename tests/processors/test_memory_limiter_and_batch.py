"""memory_limiter admission and batch size/time behaviour."""

from __future__ import annotations

import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.processors import REGISTRY
from flare.processors.base import span_count
from flare.processors.batch import BatchProcessor, split_request
from flare.processors.memory_limiter import MemoryLimiter

MIB = 1 << 20


def test_memory_limiter_soft_and_hard_limits():
    limiter = REGISTRY["memory_limiter"](limit_mib=10, spike_limit_mib=2)
    assert limiter.admit(5 * MIB)
    assert not limiter.admit(6 * MIB)  # would cross the hard limit
    assert limiter.admit(3 * MIB)  # 8 MiB in flight: at the soft limit
    assert not limiter.admit(1)  # above soft: refuse until it drains
    limiter.release(5 * MIB)
    assert limiter.admit(1 * MIB)
    m = limiter.metrics()
    assert m["refused_requests"] == 2 and m["in_flight_bytes"] == 4 * MIB
    assert m["peak_in_flight_bytes"] == 8 * MIB
    limiter.release(100 * MIB)  # an over-release never goes negative
    assert limiter.in_flight_bytes == 0


def test_memory_limiter_options():
    assert MemoryLimiter(limit_mib="64MiB").limit_bytes == 64 * MIB
    assert MemoryLimiter(limit_mib=100).spike_bytes == 20 * MIB
    with pytest.raises(ValueError, match="spike_limit_mib"):
        MemoryLimiter(limit_mib=10, spike_limit_mib=10)
    with pytest.raises(ValueError, match="limit_mib"):
        MemoryLimiter(limit_mib="lots")
    with pytest.raises(ValueError):
        MemoryLimiter(limit_mib=0)


def test_memory_limiter_is_exact_under_threads():
    limiter = MemoryLimiter(limit_mib=1, spike_limit_mib=0.5)
    admitted = []

    def worker():
        for _ in range(1000):
            if limiter.admit(1000):
                admitted.append(1)
                limiter.release(1000)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert limiter.in_flight_bytes == 0 and len(admitted) == 4000


def req(n: int, service: str = "svc") -> ExportTraceServiceRequest:
    spans = [Span(trace_id=b"\x01" * 16, span_id=i.to_bytes(8, "big"), name=f"s{i}") for i in range(1, n + 1)]
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": [KeyValue(key="service.name", value=AnyValue(string_value=service))]},
        scope_spans=[ScopeSpans(spans=spans)],
    )])


class Clock:
    now = 0

    def __call__(self) -> int:
        return self.now


def test_batch_by_size_and_by_timeout():
    clock = Clock()
    batch = BatchProcessor(send_batch_size=10, timeout="200ms", clock=clock)
    assert batch.process_traces(req(4)) is None
    assert batch.process_traces(req(4, "other")) is None
    out = batch.process_traces(req(4))
    assert out is not None and span_count(out) == 12
    assert len(out.resource_spans) == 3  # resources kept apart
    assert batch.process_traces(req(3)) is None
    clock.now += 100_000_000
    assert batch.tick(clock.now) == []
    clock.now += 100_000_000
    (late,) = batch.tick(clock.now)
    assert span_count(late) == 3
    assert batch.metrics()["batches_sent_timeout"] == 1
    assert batch.process_traces(req(2)) is None
    (rest,) = batch.shutdown()
    assert span_count(rest) == 2 and batch.pending_spans() == 0


def test_batch_max_size_splits_in_order():
    batch = BatchProcessor(send_batch_size=5, send_batch_max_size=5)
    first = batch.process_traces(req(12))
    assert span_count(first) == 5
    rest = batch.tick(0)
    assert [span_count(r) for r in rest] == [5, 2]
    names = [s.name for r in (first, *rest) for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert names == [f"s{i}" for i in range(1, 13)]


def test_split_keeps_resource_and_scope():
    pieces = list(split_request(req(7, "x"), 3))
    assert [span_count(p) for p in pieces] == [3, 3, 1]
    assert all(p.resource_spans[0].resource.attributes[0].value.string_value == "x" for p in pieces)


def test_batch_options_are_checked():
    with pytest.raises(ValueError, match="timeout"):
        BatchProcessor(timeout="soon")
    with pytest.raises(ValueError, match="send_batch_size"):
        BatchProcessor(send_batch_size=0)
    with pytest.raises(ValueError, match="send_batch_max_size"):
        BatchProcessor(send_batch_size=100, send_batch_max_size=10)
    assert REGISTRY["batch"](timeout=1).timeout_ns == 10**9
