"""Sampled kernel windows: the real torch.profiler path on CPU, and the CUDA conversion
on events recorded from a real GPU trace (no GPU here)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flare.instrumentation import kernels
from flare.wire import semconv as sc


class MinimalRuntime:
    """The listener contract of flare.instrumentation.runtime.Runtime, nothing more."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("test")
        self.rank, self.local_rank, self.job_id = 3, 3, "job"
        self.span_attributes = {sc.RANK: 3}
        self.listeners: list = []

    def add_step_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_step_listener(self, listener) -> None:
        self.listeners.remove(listener)

    def run_steps(self, count: int, detail_steps: set[int], work) -> list:
        spans = []
        for step in range(count):
            detail = step in detail_steps
            span = self.tracer.start_span(sc.SPAN_STEP, attributes={sc.STEP: step})
            with trace.use_span(span, end_on_exit=False):
                for listener in self.listeners:
                    listener.on_step_start(step, detail)
                work()
                for listener in self.listeners:
                    listener.on_step_end(step, detail, span)
            span.end()
            spans.append(span)
        return spans


def _work():
    model = torch.nn.Linear(64, 32)
    model(torch.randn(16, 64)).relu().sum().backward()


def test_cpu_windows_become_kernel_spans_parented_to_detail_steps(monkeypatch):
    monkeypatch.setenv(sc.ENV_KERNEL_WINDOWS, "1")  # CPU-only here: ask for host windows
    runtime = MinimalRuntime()
    windows = kernels.install(runtime)
    assert windows is not None and runtime.listeners == [windows]
    steps = runtime.run_steps(4, detail_steps={1, 3}, work=_work)
    windows.flush()
    spans = [s for s in runtime.exporter.get_finished_spans() if s.name == sc.SPAN_KERNEL]
    parents = {s.parent.span_id for s in spans}
    assert parents == {steps[1].context.span_id, steps[3].context.span_id}
    assert {s.attributes[sc.STEP] for s in spans} == {1, 3}
    assert all(s.attributes[sc.KERNEL_DEVICE] == sc.KERNEL_DEVICE_HOST for s in spans)
    assert all(s.attributes[sc.RANK] == 3 for s in spans)
    linear = [s for s in spans if s.attributes[sc.KERNEL_NAME] == "aten::linear"]
    assert len(linear) == 2 and linear[0].attributes[sc.KERNEL_CATEGORY] == "gemm"
    assert linear[0].attributes[sc.KERNEL_FLOPS] == 2 * 16 * 32 * 64
    # Top-level operators only: aten::addmm runs inside aten::linear.
    assert not [s for s in spans if s.attributes[sc.KERNEL_NAME] == "aten::addmm"]
    for span in spans:
        assert steps[span.attributes[sc.STEP]].start_time <= span.start_time <= span.end_time
    assert windows.windows_recorded == 2 and windows.windows_dropped == 0
    kernels.uninstall(runtime)
    assert runtime.listeners == []


def test_auto_opens_no_windows_without_cuda(monkeypatch):
    monkeypatch.delenv(sc.ENV_KERNEL_WINDOWS, raising=False)
    monkeypatch.setattr(kernels, "_cuda_available", lambda: False)
    runtime = MinimalRuntime()
    assert kernels.install(runtime) is None and runtime.listeners == []
    monkeypatch.setenv(sc.ENV_KERNEL_WINDOWS, "auto")
    assert kernels.install(runtime) is None
    monkeypatch.setattr(kernels, "_cuda_available", lambda: True)
    windows = kernels.install(runtime)
    assert windows is not None and runtime.listeners == [windows]
    kernels.uninstall(runtime)
    assert runtime.listeners == []


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(sc.ENV_KERNEL_WINDOWS, "0")
    runtime = MinimalRuntime()
    assert kernels.install(runtime) is None and runtime.listeners == []
    kernels.uninstall(runtime)  # symmetric even when nothing was installed


def test_user_profiler_takes_precedence(monkeypatch):
    monkeypatch.setenv(sc.ENV_KERNEL_WINDOWS, "1")  # CPU-only here: ask for host windows
    runtime = MinimalRuntime()
    windows = kernels.install(runtime)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        runtime.run_steps(1, detail_steps={0}, work=_work)
    windows.flush()
    assert windows.windows_recorded == 0
    assert not [s for s in runtime.exporter.get_finished_spans() if s.name == sc.SPAN_KERNEL]
    kernels.uninstall(runtime)


DATA = Path(os.environ.get("FLARE_KINETO_DATA", Path(__file__).resolve().parents[3] / "shared/data/kineto"))
TRACE = DATA / "nccl2ranks_rank0.json.gz"


class RecordedEvent:
    """A `_KinetoEvent` read back from a real CUDA trace (the CUPTI path cannot run here)."""

    def __init__(self, event: dict, ops_by_external: dict) -> None:
        self.e, self.args = event, event.get("args", {})
        self._ops = ops_by_external

    def activity_type(self):
        return self.e["cat"]

    def name(self):
        return self.e["name"]

    def start_ns(self):
        return round(self.e["ts"] * 1000)

    def duration_ns(self):
        return round(self.e.get("dur", 0) * 1000)

    def end_ns(self):
        return self.start_ns() + self.duration_ns()

    def correlation_id(self):
        if self.e["cat"] == "cpu_op":
            return self.args.get("External id", 0)
        return self.args.get("correlation", 0)

    def linked_correlation_id(self):
        return 0 if self.e["cat"] == "cpu_op" else self.args.get("External id", 0)

    def device_resource_id(self):
        return self.args.get("stream", self.e.get("tid"))

    def device_index(self):
        return self.args.get("device", -1)

    def start_thread_id(self):
        return self.e.get("tid")

    def shapes(self):
        return self.args.get("Input Dims", [])

    def dtypes(self):
        return self.args.get("Input type", [])

    def nbytes(self):
        return self.args.get("bytes", 0)


@pytest.mark.skipif(not TRACE.exists(), reason="shared Kineto traces absent")
def test_cuda_window_conversion_on_recorded_events():
    with gzip.open(TRACE, "rt") as f:
        raw = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    events = [RecordedEvent(e, {}) for e in raw
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cpu_op")]
    rows = kernels.window_rows(events, cuda=True)
    gpu = [e for e in raw if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert len(rows) == len(gpu)
    attributes = [a for _, _, a in rows]
    assert {a[sc.KERNEL_CATEGORY] for a in attributes} >= {"gemm", "communication", "memcpy",
                                                          "elementwise"}
    latency = [a[sc.KERNEL_ISSUE_LATENCY_US] for a in attributes if sc.KERNEL_ISSUE_LATENCY_US in a]
    assert len(latency) > 0.85 * len(rows) and min(latency) >= 0
    memcpy = [a for a in attributes if a[sc.KERNEL_CATEGORY] == "memcpy"]
    assert memcpy and all(a[sc.KERNEL_ACHIEVED_GBPS] > 0 for a in memcpy if sc.KERNEL_BYTES in a)
    assert all(a[sc.KERNEL_DEVICE] >= 0 and a[sc.KERNEL_SOURCE] == "profiler" for a in attributes)


def test_window_on_request_through_the_real_runtime(monkeypatch):
    """A's Runtime: periodic detail off, request_detail() makes the next step a window."""
    from flare.instrumentation.config import FlareConfig
    from flare.instrumentation.identity import ProcessIdentity
    from flare.instrumentation.runtime import Runtime

    monkeypatch.setenv(sc.ENV_KERNEL_WINDOWS, "1")  # CPU-only here: ask for host windows
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    identity = ProcessIdentity(rank=0, local_rank=0, world_size=1, node_rank=0, restart_count=0,
                               job_id="req", service_name="req", host_name="h", pid=1,
                               gpu_index=None, gpu_uuid=None)
    runtime = Runtime(provider.get_tracer("t"), identity, FlareConfig(detail_every=0), {})
    windows = kernels.install(runtime)
    try:
        for step in range(4):
            if step == 2:
                runtime.request_detail()
            runtime.begin_step()
            _work()
            runtime.end_step()
        windows.flush()
    finally:
        kernels.uninstall(runtime)
    finished = exporter.get_finished_spans()
    steps = {s.attributes[sc.STEP]: s for s in finished if s.name == sc.SPAN_STEP}
    spans = [s for s in finished if s.name == sc.SPAN_KERNEL]
    assert spans and {s.attributes[sc.STEP] for s in spans} == {2}
    assert {s.parent.span_id for s in spans} == {steps[2].context.span_id}
    assert steps[2].attributes[sc.STEP_DETAIL] is True
