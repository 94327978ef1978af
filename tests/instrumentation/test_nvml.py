"""NVML sampling. No GPU here: NVML answers are replayed from values recorded on an
H100 SXM node (nvidia-smi -q), through the real pynvml error classes."""

from __future__ import annotations

import threading
import types

import pynvml
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from flare.instrumentation import nvml as flare_nvml
from flare.wire import semconv as sc


class RecordedNvml:
    """The pynvml calls Flare makes, answering what an H100 80GB HBM3 answered."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_NVLINK_ERROR_DL_CRC_FLIT = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
    NVML_NVLINK_ERROR_DL_REPLAY = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
    NVML_NVLINK_ERROR_DL_RECOVERY = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self) -> None:
        self.clock, self.reasons, self.temperature = 1980, 0x0, 67
        self.pending_xid: list[int] = []
        self.calls: dict[str, int] = {}
        self.shutdown = False

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, handle):
        return "GPU-5f3c2a1e-8b7d-4c2f-9e61-0a4b3c2d1e0f"

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(total=85520809984, used=65740324864, free=19780485120)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 612345  # mW

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self.temperature

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return self.clock

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.reasons

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        return 0 if kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 3

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        self._count("pcie")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= 18:  # H100 SXM: 18 NVLink4 links
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, handle, link, counter):
        return 2 if (link == 5 and counter == self.NVML_NVLINK_ERROR_DL_CRC_FLIT) else 0

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle, kinds, events):
        pass

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        if self.pending_xid:
            return types.SimpleNamespace(eventData=self.pending_xid.pop(0), eventType=pynvml.nvmlEventTypeXidCriticalError)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, events):
        pass


class Runtime:
    def __init__(self, rank=5, local_rank=1):
        self.rank, self.local_rank = rank, local_rank
        self.listeners = []

    def add_step_listener(self, listener):
        self.listeners.append(listener)

    def remove_step_listener(self, listener):
        self.listeners.remove(listener)


class Span:
    def __init__(self):
        self.attributes = {}

    def set_attributes(self, attributes):
        self.attributes.update(attributes)


def _points(reader):
    out = {}
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    out.setdefault(metric.name, []).append((point.value, dict(point.attributes)))
    return out


def test_metrics_are_labelled_with_the_owning_rank(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv(sc.ENV_NVML_INTERVAL_S, "0.05")
    recorded = RecordedNvml()
    reader = InMemoryMetricReader()
    runtime = Runtime(rank=5, local_rank=1)
    sampler = flare_nvml.install(runtime, nvml=recorded, meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        assert sampler is not None and runtime.listeners == [sampler]
        assert sampler.index == 3  # local rank 1 → second visible GPU → NVML index 3
        points = _points(reader)
        (util, attrs), = points[sc.METRIC_GPU_UTILIZATION]
        assert util == 0.97 and attrs[sc.RANK] == 5 and attrs[sc.GPU_INDEX] == 3
        assert attrs[sc.HW_ID].startswith("GPU-") and attrs[sc.HW_GPU_TASK] == "general"
        assert points[sc.METRIC_GPU_MEMORY_USAGE][0][0] == 65740324864
        assert points[sc.METRIC_GPU_POWER][0][0] == pytest.approx(612.345)
        assert points[sc.METRIC_GPU_CLOCK_SM][0][0] == 1980
        errors = {a[sc.ERROR_TYPE_ATTR]: v for v, a in points[sc.METRIC_GPU_ERRORS]}
        assert errors == {"ecc_corrected": 3, "ecc_uncorrected": 0, "nvlink_crc": 2,
                          "nvlink_replay": 0, "nvlink_recovery": 0, "xid": 0}
        # NotSupported is asked once, then remembered.
        sampler.poll()
        assert recorded.calls["pcie"] == 1
        # An XID arrives through the event set the poller waits on.
        recorded.pending_xid.append(79)
        done = threading.Event()
        for _ in range(100):
            if sampler.xid_count:
                done.set()
                break
            threading.Event().wait(0.02)
        assert done.is_set() and sampler.last_xid == 79
        points = _points(reader)
        assert points[sc.METRIC_GPU_XID][0][0] == 79
    finally:
        flare_nvml.uninstall(runtime)
    assert runtime.listeners == [] and recorded.shutdown


def test_step_spans_get_the_clock_state_when_it_changes(monkeypatch):
    monkeypatch.setenv(sc.ENV_NVML_INTERVAL_S, "3600")  # polls driven by the test
    recorded = RecordedNvml()
    runtime = Runtime()
    sampler = flare_nvml.install(runtime, nvml=recorded,
                                 meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
    try:
        spans = []
        for step in range(6):
            if step == 3:  # thermal slowdown: NVML reports reason 0x20 and a lower clock
                recorded.clock, recorded.reasons, recorded.temperature = 1410, 0x20, 88
                sampler.poll()
            if step == 4:
                recorded.clock = 1425  # under 5%: not re-attached
                sampler.poll()
            span = Span()
            sampler.on_step_end(step, False, span)
            spans.append(span.attributes)
        assert spans[0] == {sc.STEP_GPU_SM_CLOCK_MHZ: 1980.0, sc.STEP_GPU_THROTTLE: 0,
                            sc.STEP_GPU_TEMPERATURE_C: 67.0, sc.STEP_GPU_POWER_W: 612.345}
        assert spans[1] == spans[2] == spans[4] == spans[5] == {}
        assert spans[3][sc.STEP_GPU_SM_CLOCK_MHZ] == 1410.0 and spans[3][sc.STEP_GPU_THROTTLE] == 0x20
    finally:
        flare_nvml.uninstall(runtime)


def test_no_nvml_is_a_silent_no_op(monkeypatch, caplog):
    runtime = Runtime()
    # The real pynvml here: no driver, nvmlInit raises NVMLError_LibraryNotFound.
    assert flare_nvml.install(runtime) is None
    assert runtime.listeners == [] and not caplog.records
    monkeypatch.setenv(sc.ENV_NVML_INTERVAL_S, "0")
    assert flare_nvml.install(runtime, nvml=RecordedNvml()) is None
    flare_nvml.uninstall(runtime)


def test_device_index_follows_cuda_visible_devices():
    assert flare_nvml.device_index(1, "") == 1
    assert flare_nvml.device_index(1, "4,6") == 6
    assert flare_nvml.device_index(0, "GPU-abc,GPU-def") == "GPU-abc"


def test_clock_state_lands_on_real_step_spans(monkeypatch):
    """Through A's Runtime and the OTel SDK: the first step span carries the NVML state."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from flare.instrumentation.config import FlareConfig
    from flare.instrumentation.identity import ProcessIdentity
    from flare.instrumentation.runtime import Runtime

    monkeypatch.setenv(sc.ENV_NVML_INTERVAL_S, "3600")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    identity = ProcessIdentity(rank=2, local_rank=0, world_size=4, node_rank=0, restart_count=0,
                               job_id="nvml", service_name="nvml", host_name="h", pid=1,
                               gpu_index=0, gpu_uuid=None)
    runtime = Runtime(provider.get_tracer("t"), identity, FlareConfig(detail_every=0), {})
    sampler = flare_nvml.install(runtime, nvml=RecordedNvml(),
                                 meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
    try:
        for _ in range(3):
            runtime.begin_step()
            runtime.end_step()
    finally:
        flare_nvml.uninstall(runtime)
    assert sampler is not None
    steps = sorted((s for s in exporter.get_finished_spans() if s.name == sc.SPAN_STEP),
                   key=lambda s: s.attributes[sc.STEP])
    assert steps[0].attributes[sc.STEP_GPU_SM_CLOCK_MHZ] == 1980.0
    assert steps[0].attributes[sc.STEP_GPU_THROTTLE] == 0
    assert sc.STEP_GPU_SM_CLOCK_MHZ not in steps[1].attributes
