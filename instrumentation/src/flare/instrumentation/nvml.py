"""GPU health from NVML, labelled with the rank that owns the GPU.

`install(runtime)` (called by the instrumentor) starts a background poller for the
rank's GPU (`local_rank`, mapped through CUDA_VISIBLE_DEVICES) and registers
observable instruments with the OTel metrics API:

    hw.gpu.utilization, hw.gpu.memory.utilization   ratio (OTel hardware semconv)
    hw.gpu.memory.usage, hw.gpu.memory.limit        By
    hw.power (W), hw.temperature (Cel)              hw.type=gpu
    hw.errors{error.type=ecc_corrected|ecc_uncorrected|nvlink_crc|nvlink_replay|
              nvlink_recovery|pcie_replay|xid}      cumulative counts
    flare.gpu.clock.sm, flare.gpu.clock.sm.max      MHz
    flare.gpu.throttle_reasons                      NVML clocks-event bitmask
    flare.gpu.xid                                   last XID code seen

Every point carries flare.rank, flare.gpu.index and hw.id (the GPU UUID). XID events
arrive through an NVML event set that the poller waits on between samples, so a fatal
XID is seen within one poll period. On the step span, the SM clock and throttle reasons
(plus temperature and power) are attached at the first step and whenever they change,
so every step's state is known by carrying the last value forward.

No `pynvml` (PyPI `nvidia-ml-py`), no driver or no GPU: a silent no-op. A counter the
GPU does not support is dropped after its first NotSupported answer.
Poll period: FLARE_NVML_INTERVAL_S (default 5 s); 0 turns NVML off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from flare.wire import semconv

_log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 5.0
CLOCK_CHANGE = 0.05  # re-attach the clock to steps when it moves by 5%
_NVLINK_COUNTERS = (("nvlink_crc", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
                    ("nvlink_replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
                    ("nvlink_recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"))
_installed: dict[int, NvmlSampler] = {}


@dataclasses.dataclass
class GpuSample:
    utilization: float | None = None  # 0..1
    memory_utilization: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    throttle_reasons: int | None = None
    errors: dict[str, int] = dataclasses.field(default_factory=dict)


class NvmlSampler:
    """Polls one GPU; serves the latest sample to metric callbacks and to step spans."""

    ordinary_steps = ("on_step_end",)  # the GPU state goes on every step span that changes it

    def __init__(self, nvml: Any, index: int, rank: int, interval_s: float = DEFAULT_INTERVAL_S,
                 meter_provider: Any = None) -> None:
        self._nvml = nvml
        self.index = index
        self.rank = rank
        self.interval_s = interval_s
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.uuid = _text(nvml.nvmlDeviceGetUUID(self._handle))
        self.model = _text(nvml.nvmlDeviceGetName(self._handle))
        self._unsupported: set[str] = set()
        self._nvlinks: list[int] | None = None
        self.xid_count = 0
        self.last_xid: int | None = None
        self.sample = GpuSample()
        self._attached: tuple[float | None, int | None] | None = None
        self._stop = threading.Event()
        self._events = self._xid_event_set()
        self.attributes = {semconv.RANK: rank, semconv.GPU_INDEX: index, semconv.HW_ID: self.uuid,
                           semconv.HW_TYPE: "gpu", semconv.GPU_MODEL: self.model}
        self.poll()
        self._register(meter_provider)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ polling
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flare-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 2)
        if self._events is not None:
            try:
                self._nvml.nvmlEventSetFree(self._events)
            except Exception:
                pass
            self._events = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait_for_xid(self.interval_s)
            if not self._stop.is_set():
                self.poll()

    def poll(self) -> GpuSample:
        nvml, handle = self._nvml, self._handle
        sample = GpuSample()
        rates = self._read("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
        if rates is not None:
            sample.utilization = rates.gpu / 100.0
            sample.memory_utilization = rates.memory / 100.0
        memory = self._read("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            sample.memory_used, sample.memory_total = int(memory.used), int(memory.total)
        power = self._read("power", nvml.nvmlDeviceGetPowerUsage, handle)
        sample.power_w = power / 1000.0 if power is not None else None
        sample.temperature_c = _float(self._read(
            "temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU))
        sample.sm_clock_mhz = _float(self._read(
            "clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM))
        sample.sm_clock_max_mhz = _float(self._read(
            "max_clock", nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM))
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        value = self._read("throttle", reasons, handle)
        sample.throttle_reasons = int(value) if value is not None else None
        for name, kind in (("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                           ("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):
            count = self._read(name, nvml.nvmlDeviceGetTotalEccErrors, handle,
                               getattr(nvml, kind), nvml.NVML_VOLATILE_ECC)
            if count is not None:
                sample.errors[name] = int(count)
        replay = self._read("pcie_replay", nvml.nvmlDeviceGetPcieReplayCounter, handle)
        if replay is not None:
            sample.errors["pcie_replay"] = int(replay)
        for name, total in self._nvlink_errors().items():
            sample.errors[name] = total
        sample.errors["xid"] = self.xid_count
        self.sample = sample
        return sample

    def _read(self, key: str, function: Any, *args: Any) -> Any:
        if key in self._unsupported:
            return None
        try:
            return function(*args)
        except self._nvml.NVMLError as error:
            if _not_supported(self._nvml, error):
                self._unsupported.add(key)
            return None

    def _nvlink_errors(self) -> dict[str, int]:
        nvml, handle = self._nvml, self._handle
        if self._nvlinks is None:  # which links exist, found once
            self._nvlinks = []
            for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link):
                        self._nvlinks.append(link)
                except nvml.NVMLError:
                    continue
        totals: dict[str, int] = {}
        for name, counter in _NVLINK_COUNTERS:
            if name in self._unsupported or not self._nvlinks:
                continue
            total = 0
            for link in self._nvlinks:
                value = self._read(name, nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link,
                                   getattr(nvml, counter))
                if value is None:
                    break
                total += int(value)
            else:
                totals[name] = total
        return totals

    # ------------------------------------------------------------ XID events
    def _xid_event_set(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self._handle, nvml.nvmlEventTypeXidCriticalError, events)
            return events
        except Exception:
            return None  # not supported (e.g. some virtualised GPUs): poll-only

    def _wait_for_xid(self, timeout_s: float) -> None:
        if self._events is None:
            self._stop.wait(timeout_s)
            return
        try:
            data = self._nvml.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except self._nvml.NVMLError:
            return  # timeout: no event in this period
        self.xid_count += 1
        self.last_xid = int(data.eventData)
        _log.warning("flare: GPU %d (rank %d) reported XID %d", self.index, self.rank, self.last_xid)

    # ------------------------------------------------------------ step spans
    def step_attributes(self) -> dict[str, Any]:
        """The clock/throttle state when it changed since last attached, else {}."""
        sample = self.sample
        state = (sample.sm_clock_mhz, sample.throttle_reasons)
        if self._attached is not None:
            clock, reasons = self._attached
            moved = clock is not None and state[0] is not None and \
                abs(state[0] - clock) > CLOCK_CHANGE * max(clock, 1.0)
            if not moved and reasons == state[1] and (clock is None) == (state[0] is None):
                return {}
        self._attached = state
        attributes: dict[str, Any] = {}
        if sample.sm_clock_mhz is not None:
            attributes[semconv.STEP_GPU_SM_CLOCK_MHZ] = sample.sm_clock_mhz
        if sample.throttle_reasons is not None:
            attributes[semconv.STEP_GPU_THROTTLE] = sample.throttle_reasons
        if sample.temperature_c is not None:
            attributes[semconv.STEP_GPU_TEMPERATURE_C] = sample.temperature_c
        if sample.power_w is not None:
            attributes[semconv.STEP_GPU_POWER_W] = sample.power_w
        return attributes

    def on_step_start(self, step: int, detail: bool) -> None:
        pass

    def on_step_end(self, step: int, detail: bool, span: Any) -> None:
        attributes = self.step_attributes()
        if attributes:
            span.set_attributes(attributes)

    # ------------------------------------------------------------ metrics
    def _register(self, meter_provider: Any) -> None:
        meter = metrics.get_meter(__name__, meter_provider=meter_provider)
        gauges = (
            (semconv.METRIC_GPU_UTILIZATION, "1", "utilization", {semconv.HW_GPU_TASK: "general"}),
            (semconv.METRIC_GPU_MEMORY_UTILIZATION, "1", "memory_utilization", {}),
            (semconv.METRIC_GPU_MEMORY_USAGE, "By", "memory_used", {}),
            (semconv.METRIC_GPU_MEMORY_LIMIT, "By", "memory_total", {}),
            (semconv.METRIC_GPU_POWER, "W", "power_w", {}),
            (semconv.METRIC_GPU_TEMPERATURE, "Cel", "temperature_c", {}),
            (semconv.METRIC_GPU_CLOCK_SM, "MHz", "sm_clock_mhz", {}),
            (semconv.METRIC_GPU_CLOCK_SM_MAX, "MHz", "sm_clock_max_mhz", {}),
            (semconv.METRIC_GPU_THROTTLE, "1", "throttle_reasons", {}),
        )
        for name, unit, field, extra in gauges:
            meter.create_observable_gauge(name, callbacks=[self._gauge(field, extra)], unit=unit)
        meter.create_observable_counter(semconv.METRIC_GPU_ERRORS, callbacks=[self._errors],
                                        unit="{error}")
        meter.create_observable_gauge(semconv.METRIC_GPU_XID, callbacks=[self._xid], unit="1")

    def _gauge(self, field: str, extra: dict[str, Any]):
        attributes = {**self.attributes, **extra}

        def observe(options: CallbackOptions) -> list[Observation]:
            value = getattr(self.sample, field)
            return [] if value is None else [Observation(value, attributes)]

        return observe

    def _errors(self, options: CallbackOptions) -> list[Observation]:
        return [Observation(count, {**self.attributes, semconv.ERROR_TYPE_ATTR: kind})
                for kind, count in self.sample.errors.items()]

    def _xid(self, options: CallbackOptions) -> list[Observation]:
        return [] if self.last_xid is None else [Observation(self.last_xid, self.attributes)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _not_supported(nvml: Any, error: Exception) -> bool:
    codes = {getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2),
             getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)}
    return getattr(error, "value", None) in codes


def device_index(local_rank: int, visible: str | None = None) -> int | str:
    """The NVML index (or UUID) of the GPU this rank uses: CUDA renumbers visible GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return local_rank
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if local_rank >= len(entries):
        return local_rank
    entry = entries[local_rank]
    return int(entry) if entry.isdigit() else entry


def _interval() -> float:
    try:
        return float(os.environ.get(semconv.ENV_NVML_INTERVAL_S, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


def install(runtime: Any, nvml: Any = None, meter_provider: Any = None) -> NvmlSampler | None:
    """Start NVML sampling for the rank's GPU; None when NVML or a GPU is unavailable."""
    interval = _interval()
    if interval <= 0 or id(runtime) in _installed:
        return _installed.get(id(runtime))
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception:
        return None  # no library, no driver, no GPU: silently nothing
    try:
        index = device_index(int(getattr(runtime, "local_rank", 0) or 0))
        if isinstance(index, str):  # a UUID in CUDA_VISIBLE_DEVICES
            index = nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(index))
        sampler = NvmlSampler(nvml, int(index), int(getattr(runtime, "rank", 0) or 0), interval,
                              meter_provider)
    except Exception as error:
        _log.debug("flare: NVML unavailable for this rank: %r", error)
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
        return None
    sampler.start()
    runtime.add_step_listener(sampler)
    _installed[id(runtime)] = sampler
    return sampler


def uninstall(runtime: Any) -> None:
    sampler = _installed.pop(id(runtime), None)
    if sampler is None:
        return
    runtime.remove_step_listener(sampler)
    sampler.stop()
    try:
        sampler._nvml.nvmlShutdown()
    except Exception:
        pass
