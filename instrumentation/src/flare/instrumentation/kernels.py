"""Sampled kernel windows: on detail steps, record every kernel with its CPU launch.

A step listener on the Flare runtime (engineer A's `Runtime`): when a step is a detail
step (every `FLARE_DETAIL_EVERY`-th, on request by signal or flag file, or on the hang
watchdog's trigger) it starts `torch.profiler` — Kineto with CUPTI on CUDA builds — at
step start and stops it at step end. Nothing else runs on the training thread: the
profiler's results go to a background thread that turns them into `kernel` spans,
children of the step span:

- CUDA: every kernel, memcpy and memset, with category, stream, device, issue latency
  (GPU start − start of the `cudaLaunchKernel` call with the same CUPTI correlation id),
  launch call duration, FLOPs from the launching operator's shapes, achieved TFLOPS or
  GB/s.
- CPU-only processes, when asked for (`FLARE_KERNEL_WINDOWS=1`): the same path with CPU
  activity only; the top-level operators of each thread become `kernel` spans on device
  `KERNEL_DEVICE_HOST` (-1), so the code path is exercised and tested on machines
  without a GPU. By default (`auto`) a process without CUDA opens no windows: no
  diagnosis reads host operators, and recording them costs CPU the job needs.

Cost: between windows the listener does one boolean test per step. A window costs the
profiler's start/stop plus the (background) conversion; `benchmarks/
kernel_window_overhead.py` measures it amortized at the default rate.
Kineto's own stderr log lines are silenced (`KINETO_LOG_LEVEL=6`) unless the user set a
level. Off with `FLARE_KERNEL_WINDOWS=0`; silently absent when torch is not installed, and a
window is skipped when the user already runs a profiler.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from typing import Any

from opentelemetry import trace

from flare.wire import kernel_taxonomy as taxonomy
from flare.wire import semconv

_log = logging.getLogger(__name__)
MAX_SPANS_PER_WINDOW = int(os.environ.get("FLARE_KERNEL_MAX_SPANS", "20000"))
_PENDING_WINDOWS = 4  # windows waiting for conversion; more are dropped, and counted
_GPU_ACTIVITIES = {"kernel": None, "gpu_memcpy": taxonomy.MEMCPY, "gpu_memset": taxonomy.MEMSET}
_LAUNCH_ACTIVITIES = {"cuda_runtime", "cuda_driver"}
_installed: dict[int, KernelWindows] = {}


class KernelWindows:
    """Step listener recording one profiler window per detail step."""

    ordinary_steps = ()  # windows open and close on detail steps only

    def __init__(self, runtime: Any, cuda: bool | None = None) -> None:
        import torch  # noqa: F401  (only constructed when torch is importable)

        self._runtime = runtime
        self._cuda = _cuda_available() if cuda is None else cuda
        self._profiler: Any = None
        self._window_step: int | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=_PENDING_WINDOWS)
        self._worker: threading.Thread | None = None
        self._disabled_reason: str | None = None
        self.windows_recorded = 0
        self.windows_dropped = 0
        self.spans_emitted = 0
        self.conversion_cpu_s = 0.0  # CPU time the background thread spent converting

    # ------------------------------------------------------------ step listener
    def on_step_start(self, step: int, detail: bool) -> None:
        if not detail or self._profiler is not None or self._disabled_reason:
            return
        if _profiler_active():
            return  # the user's own profiler owns Kineto for now
        try:
            self._profiler = self._new_profiler()
            self._profiler.start()
            self._window_step = step
        except Exception as error:  # never break training over a diagnostic window
            self._profiler = None
            self._disable(f"torch.profiler could not start: {error!r}")

    def on_step_end(self, step: int, detail: bool, span: Any) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        try:
            profiler.stop()
        except Exception as error:
            self._disable(f"torch.profiler could not stop: {error!r}")
            return
        parent = trace.set_span_in_context(span)
        try:
            self._queue.put_nowait((profiler, parent, step))
        except queue.Full:
            self.windows_dropped += 1
            return
        self._ensure_worker()

    # ------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until pending windows are turned into spans (at exit, in tests)."""
        if self._worker is None:
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return
        done.wait(timeout_s)

    def close(self) -> None:
        if self._profiler is not None:
            try:
                self._profiler.stop()
            except Exception:
                pass
            self._profiler = None
        self.flush()
        # Stop the worker: a thread left holding profiler results after uninstall has
        # crashed a later gc.collect() in the same process.
        worker, self._worker = self._worker, None
        if worker is not None and worker.is_alive():
            try:
                self._queue.put(_STOP, timeout=1.0)
            except queue.Full:
                return
            worker.join(timeout=5.0)

    # ------------------------------------------------------------ internals
    def _new_profiler(self) -> _ProfilerWindow:
        return _ProfilerWindow(self._cuda)

    def _disable(self, reason: str) -> None:
        self._disabled_reason = reason
        _log.warning("flare: kernel windows off: %s", reason)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._drain, name="flare-kernel-windows",
                                            daemon=True)
            self._worker.start()

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            profiler, parent, step = item
            started = time.thread_time()
            try:
                events = profiler.result.events()
                rows = window_rows(events, self._cuda)
                self._emit(rows, parent, step)
                self.windows_recorded += 1
            except Exception as error:
                _log.warning("flare: kernel window of step %s lost: %r", step, error)
            self.conversion_cpu_s += time.thread_time() - started
            del item, profiler, parent  # release the profiler's results before waiting again

    def _emit(self, rows: list[tuple[int, int, dict]], parent: Any, step: int) -> None:
        tracer = self._runtime.tracer
        extra = dict(getattr(self._runtime, "span_attributes", {}) or {})
        extra[semconv.STEP] = step
        for start_ns, end_ns, attributes in rows[:MAX_SPANS_PER_WINDOW]:
            attributes.update(extra)
            span = tracer.start_span(semconv.SPAN_KERNEL, context=parent, start_time=start_ns,
                                     attributes=attributes)
            span.end(end_time=end_ns)
        self.spans_emitted += min(len(rows), MAX_SPANS_PER_WINDOW)


_STOP = object()


class _ProfilerWindow:
    """One Kineto session through torch.autograd's low-level profiler calls.

    `torch.profiler.profile` wraps a session in Python objects that form reference
    cycles; the garbage collector later freed them in an order that crashed the
    process (reproduced with windows on consecutive steps followed by gc.collect()).
    The low-level calls leave a single `_ProfilerResult`, freed by reference counting
    on the conversion thread. They also skip the device synchronise that
    `torch.profiler` does at stop: kernels still running then are simply not in the
    window, and the training stream is never synchronised.
    """

    def __init__(self, cuda: bool) -> None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState

        self._activities = {ProfilerActivity.CPU}
        if cuda:
            self._activities.add(ProfilerActivity.CUDA)
        # state, record shapes, memory, stack, flops, modules, experimental
        self._config = ProfilerConfig(
            ProfilerState.KINETO, True, False, False, False, False, _ExperimentalConfig()
        )
        self.result: Any = None

    def start(self) -> None:
        from torch.autograd import _enable_profiler, _prepare_profiler

        _prepare_profiler(self._config, self._activities)
        _enable_profiler(self._config, self._activities)

    def stop(self) -> None:
        from torch.autograd import _disable_profiler

        self.result = _disable_profiler()


def window_rows(events: list[Any], cuda: bool) -> list[tuple[int, int, dict]]:
    """(start_ns, end_ns, attributes) of the kernel spans of one profiler window.

    `events` are torch's `_KinetoEvent`s. GPU activities when there are any, else the
    top-level CPU operators of each thread (CPU-only builds).
    """
    ops: dict[int, Any] = {}
    launches: dict[int, Any] = {}
    gpu: list[Any] = []
    for event in events:
        kind = event.activity_type()
        if kind in _GPU_ACTIVITIES:
            gpu.append(event)
        elif kind in _LAUNCH_ACTIVITIES:
            launches[event.correlation_id()] = event
        elif kind == "cpu_op":
            ops[event.correlation_id()] = event
    if gpu:
        return _gpu_rows(gpu, launches, ops)
    return _cpu_rows(list(ops.values()))


def _gpu_rows(gpu: list[Any], launches: dict[int, Any], ops: dict[int, Any]) -> list:
    per_op: dict[int, int] = {}
    categories = []
    for event in gpu:
        category = _GPU_ACTIVITIES[event.activity_type()] or taxonomy.categorize(event.name())
        categories.append(category)
        if category in (taxonomy.GEMM, taxonomy.ATTENTION):
            link = event.linked_correlation_id()
            per_op[link] = per_op.get(link, 0) + 1
    rows = []
    for event, category in zip(gpu, categories, strict=True):
        start, duration = event.start_ns(), event.duration_ns()
        attributes: dict[str, Any] = {
            semconv.KERNEL_NAME: event.name(),
            semconv.KERNEL_CATEGORY: category,
            semconv.KERNEL_STREAM: int(event.device_resource_id()),
            semconv.KERNEL_DEVICE: int(event.device_index()),
            semconv.KERNEL_CORRELATION: int(event.correlation_id()),
            semconv.KERNEL_SOURCE: "profiler",
        }
        launch = launches.get(event.correlation_id())
        if launch is not None:
            attributes[semconv.KERNEL_LAUNCH_NS] = int(launch.start_ns())
            attributes[semconv.KERNEL_LAUNCH_DUR_US] = round(launch.duration_ns() / 1e3, 3)
            attributes[semconv.KERNEL_ISSUE_LATENCY_US] = round((start - launch.start_ns()) / 1e3, 3)
        op = ops.get(event.linked_correlation_id())
        if op is not None and category in (taxonomy.GEMM, taxonomy.ATTENTION):
            flops = taxonomy.op_flops(op.name(), op.shapes())
            if flops:
                flops //= per_op.get(event.linked_correlation_id(), 1)
                attributes[semconv.KERNEL_FLOPS] = flops
                attributes[semconv.KERNEL_SHAPE] = str(op.shapes())
                types = [t for t in op.dtypes() if t and t != "Scalar"]
                if types:
                    attributes[semconv.KERNEL_DTYPE] = types[-1]
                if duration > 0:
                    attributes[semconv.KERNEL_ACHIEVED_TFLOPS] = round(flops / duration / 1e3, 3)
        nbytes = event.nbytes() if category in (taxonomy.MEMCPY, taxonomy.MEMSET) else 0
        if nbytes:
            attributes[semconv.KERNEL_BYTES] = int(nbytes)
            if duration > 0:
                attributes[semconv.KERNEL_ACHIEVED_GBPS] = round(nbytes / duration, 3)
        rows.append((start, start + duration, attributes))
    return rows


def _cpu_rows(ops: list[Any]) -> list:
    by_thread: dict[int, list[Any]] = {}
    for op in ops:
        by_thread.setdefault(op.start_thread_id(), []).append(op)
    rows = []
    for thread_id, thread_ops in by_thread.items():
        thread_ops.sort(key=lambda o: (o.start_ns(), -o.end_ns()))
        outer_end = -1
        for op in thread_ops:
            start, end = op.start_ns(), op.end_ns()
            if start < outer_end:
                continue  # nested in the previous top-level operator
            outer_end = end
            attributes: dict[str, Any] = {
                semconv.KERNEL_NAME: op.name(),
                semconv.KERNEL_CATEGORY: taxonomy.categorize(op.name()),
                semconv.KERNEL_STREAM: int(thread_id),
                semconv.KERNEL_DEVICE: semconv.KERNEL_DEVICE_HOST,
                semconv.KERNEL_SOURCE: "profiler",
            }
            flops = taxonomy.op_flops(op.name(), op.shapes())
            if flops:
                attributes[semconv.KERNEL_FLOPS] = flops
                attributes[semconv.KERNEL_SHAPE] = str(op.shapes())
                if end > start:
                    attributes[semconv.KERNEL_ACHIEVED_TFLOPS] = round(flops / (end - start) / 1e3, 6)
            rows.append((start, end, attributes))
    rows.sort(key=lambda r: r[0])
    return rows


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _profiler_active() -> bool:
    try:
        import torch

        # The C-level flag: true for the user's torch.profiler and for raw sessions alike.
        return bool(torch.autograd._profiler_enabled())
    except Exception:
        return False


def install(runtime: Any) -> KernelWindows | None:
    """Attach kernel windows to `runtime`; None (and no cost) when off, when torch is
    absent, or by default (`auto`) when this process has no CUDA device."""
    setting = os.environ.get(semconv.ENV_KERNEL_WINDOWS, "auto").strip().lower()
    if setting in ("0", "false", "off"):
        return None
    cuda = _cuda_available()
    if setting in ("", "auto") and not cuda:
        return None
    if id(runtime) in _installed:
        return _installed[id(runtime)]
    # Kineto prints two log lines per profiler start/stop on stderr of every rank; read
    # when the profiler first initialises, so this quiets Flare's windows unless the
    # user chose a level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        windows = KernelWindows(runtime, cuda=cuda)
    except ImportError:
        return None
    runtime.add_step_listener(windows)
    _installed[id(runtime)] = windows
    atexit.register(windows.flush, 5.0)
    return windows


def uninstall(runtime: Any) -> None:
    windows = _installed.pop(id(runtime), None)
    if windows is None:
        return
    runtime.remove_step_listener(windows)
    atexit.unregister(windows.flush)
    windows.close()
