"""CUDA event timing without a GPU: the events are the one part that cannot run here, so
a stand-in with the same three calls (record, query, elapsed_time) replaces them."""

from __future__ import annotations

import threading
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flare.instrumentation.collectives import CollectiveRecord, CollectiveTracker
from flare.instrumentation.config import FlareConfig
from flare.instrumentation.device_timing import CudaEventTimer
from flare.instrumentation.identity import ProcessIdentity
from flare.instrumentation.process_groups import PgInfo
from flare.instrumentation.runtime import Runtime
from flare.wire import semconv


class StandInEvent:
    """Completes `delay_s` after it is recorded, like a kernel queued on a stream."""

    def __init__(self, delay_s: float = 0.02):
        self.delay_s = delay_s
        self.recorded_at = None
        self.records = 0

    def record(self):
        self.recorded_at = time.perf_counter()
        self.records += 1

    def query(self):
        return time.perf_counter() >= self.recorded_at + self.delay_s

    def elapsed_time(self, end):
        return (end.recorded_at - self.recorded_at) * 1000.0


def test_timer_polls_without_blocking_and_reuses_events():
    created = []

    def factory():
        created.append(StandInEvent(delay_s=0.2))
        return created[-1]

    timer = CudaEventTimer(factory)
    results = []
    done = threading.Event()
    for calls in range(3):
        token = timer.begin()
        time.sleep(0.005)
        timer.end(token, lambda ms: (results.append(ms), len(results) == 3 and done.set()))
        # end() never waits for the device: it returned while the end event (completing
        # 0.2 s after its record) was still pending, and reported nothing yet
        assert not created[-1].query() and len(results) <= calls
    assert done.wait(5)
    timer.stop()
    assert all(ms >= 4.0 for ms in results)
    # later pairs reuse the first pair's events once they completed
    time_before = len(created)
    token = timer.begin()
    timer.end(token, lambda ms: None)
    assert len(created) == time_before
    timer.stop()


def test_device_time_reaches_the_span_and_the_step_summary():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    identity = ProcessIdentity(0, 0, 2, 0, 0, "job", "svc", "host", 1, None, None)
    runtime = Runtime(provider.get_tracer("t"), identity, FlareConfig(detail_every=1), {})
    tracker = CollectiveTracker(runtime)  # not installed: nothing patched
    runtime.summary_adders = (tracker.add_step_summary,)
    runtime.begin_step()
    record = CollectiveRecord("all_reduce", PgInfo("0", "default_pg", (0, 1), "nccl"), 7,
                              1 << 20, "float32", time.time_ns(), time.time_ns(), None, False)
    tracker._launched(record, None)  # emitted as a detail child, device time pending
    tracker.device_done(record, 2.0)  # the poller thread reports it
    runtime.end_step()
    child = next(s for s in exporter.get_finished_spans() if s.name == "collective.all_reduce")
    assert child.attributes[semconv.COLL_DEVICE_MS] == 2.0
    # 1 MiB all-reduce over 2 ranks in 2 ms: bus factor 1
    assert abs(child.attributes[semconv.COLL_BUSBW_GBPS] - (1 << 20) / 2e6) < 1e-3
    step = next(s for s in exporter.get_finished_spans() if s.name == "train.step")
    assert list(step.attributes[semconv.STEP_PG_DEVICE_MS]) == [2.0]
