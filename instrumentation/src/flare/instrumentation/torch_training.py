"""`TorchTrainingInstrumentor`: the `torch_training` entry point of
`opentelemetry_instrumentor`, loaded by `opentelemetry-instrument` in every process.

It does nothing outside a training rank (no RANK: the torchrun agent, tools), in a
helper process a rank started (DataLoader workers, which inherit RANK: the rank marks
itself in FLARE_RANK_PID), or without torch. In a rank it wires the hooks to one Runtime; every
patch has its unpatch in `_uninstrument`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Collection

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.sdk.resources import Resource

import flare.instrumentation as flare_instrumentation
from flare.instrumentation import flight_recorder, opamp_agent
from flare.instrumentation.callsite import add_plumbing_dir
from flare.instrumentation.config import FlareConfig
from flare.instrumentation.flush_deadline import FlushDeadline
from flare.instrumentation.identity import current_identity, in_training_rank
from flare.instrumentation.runtime import Runtime
from flare.instrumentation.version import __version__
from flare.wire import semconv

_log = logging.getLogger(__name__)
_INSTRUMENTS = ("torch >= 2.1",)
GPU_LAYER_MODULES = ("flare.instrumentation.kernels", "flare.instrumentation.nvml")


def _disable_in_forked_child() -> None:
    """A forked child (DataLoader worker) inherits the patches but is not the rank."""
    runtime = flare_instrumentation._active_runtime
    if runtime is not None:
        runtime.enabled = False


os.register_at_fork(after_in_child=_disable_in_forked_child)


def _rank_marker() -> str:
    """What an instrumented rank leaves in its environment for the processes it starts:
    its pid, its local rank and its RANK as its environment gave it ("" for a job of one
    process, which has none)."""
    return (f"{os.getpid()}:{os.environ.get('LOCAL_RANK', '').strip() or '0'}:"
            f"{os.environ.get('RANK', '').strip()}")


def _is_helper_of_a_rank() -> bool:
    """A process started by an instrumented rank (a spawned DataLoader worker) inherits
    its environment, RANK included; the rank's marker tells it apart. A process of
    another local rank that a rank started is a rank itself (Lightning's rank 0
    starting ranks 1..), and so is one given a RANK of its own (the ranks of a launcher
    Flare does not know, which first took itself for a job of one process)."""
    marker = os.environ.get(semconv.ENV_RANK_PID, "")
    if not marker:
        return False
    pid, _, rest = marker.partition(":")
    local_rank, has_rank, rank = rest.partition(":")
    if has_rank and os.environ.get("RANK", "").strip() != rank:
        return False
    mine = os.environ.get("LOCAL_RANK", "").strip() or "0"
    return pid != str(os.getpid()) and local_rank in ("", mine)


class _FirstStepListener:
    """Resolves what needs the user's modules loaded, once, at the first step."""

    ordinary_steps = ("on_step_start",)

    def __init__(self, runtime: Runtime, python_calls):
        self.runtime = runtime
        self.python_calls = python_calls

    def on_step_start(self, step: int, detail: bool) -> None:
        self.runtime.remove_step_listener(self)
        self.python_calls.on_first_step()

    def on_step_end(self, step: int, detail: bool, span) -> None:
        pass


def _say_job(identity) -> None:
    """Rank 0 names the job it derived (no FLARE_JOB_ID, run or Slurm id), once: the
    name to give `flare diagnose --job`, and the same in every backend."""
    from flare.instrumentation.identity import job_id_source

    if identity.rank == 0 and job_id_source() == "derived":
        print(f"flare: job {identity.job_id} (rank 0 of {identity.world_size}; set FLARE_JOB_ID "
              "to name it)", file=sys.stderr, flush=True)


def _adopt_flare_resource(provider, identity) -> None:
    """The SDK ran without Flare's resource detector (`OTEL_EXPERIMENTAL_RESOURCE_DETECTORS`
    lacks `flare`): the resource has no job, so a collector files every such process
    under `service.name` (`unknown_service:python3` for all jobs alike) and derives the
    step's trace id from it. Flare's attributes are merged into the SDK provider's
    resource, which its tracers take when created (there is no public setter); tracers
    made before keep the old one. The spans keep their own rank attributes too."""
    from flare.wire import sdk_adapter as sdk

    current = sdk.provider_resource(provider)
    if not isinstance(current, Resource) or not sdk.internals_ok():
        return  # the spans carry Flare's attributes themselves (span_fallback_attributes)
    attributes = identity.resource_attributes()
    if str(current.attributes.get(semconv.SERVICE_NAME, "")).startswith("unknown_service"):
        attributes[semconv.SERVICE_NAME] = identity.service_name  # the job, not the SDK's default
    sdk.set_provider_resource(provider, current.merge(Resource(attributes)))
    _log.info("flare: 'flare' is not in OTEL_EXPERIMENTAL_RESOURCE_DETECTORS; Flare's "
              "resource attributes were added to the tracer provider's resource")


def _stopped_while_starting() -> None:
    """Ctrl-C while the rank imports torch, which it does inside Python's start-up
    (sitecustomize): Python would end with "Fatal Python error: init_import_site" and a
    list of every extension module loaded, 84-115 lines for a 2-rank job (seen). One line
    instead, and a SIGINT's exit status; nothing has been traced yet."""
    sys.stderr.write(f"flare: rank {os.environ.get('RANK', '?')} stopped by Ctrl-C while starting\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


class TorchTrainingInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return _INSTRUMENTS

    # ------------------------------------------------------------------ instrument
    def _instrument(self, **kwargs) -> None:
        self._parts: list = []
        self._runtime = None
        if not in_training_rank() or _is_helper_of_a_rank():
            from flare.instrumentation.launcher import keep_for_children, quiet_interrupts

            keep_for_children()  # a launcher (torchrun): its ranks are instrumented too
            if not _is_helper_of_a_rank():
                quiet_interrupts()
            return
        try:
            import torch
        except ImportError:
            return
        except KeyboardInterrupt:
            _stopped_while_starting()
        add_plumbing_dir(torch.__file__)
        provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        identity = current_identity()
        _say_job(identity)
        resource = getattr(provider, "resource", None)
        has_rank = resource is not None and semconv.RANK in (resource.attributes or {})
        if not has_rank:
            _adopt_flare_resource(provider, identity)
        tracer = trace.get_tracer(__name__, __version__, tracer_provider=provider)
        config = FlareConfig.from_env()
        runtime = Runtime(tracer, identity, config,
                          {} if has_rank else identity.span_fallback_attributes())
        self._runtime = runtime
        self._provider = provider
        if runtime._finished is not None and runtime._finished.asynchronous():
            runtime._finished.add_drain_on_flush(provider, runtime.drain)
        self._flush_deadline = FlushDeadline(provider)
        flight_recorder.enable_if_unset()

        from flare.instrumentation.dataloader_hook import DataLoaderHook
        from flare.instrumentation.errors import ErrorHooks
        from flare.instrumentation.gc_hook import GcHook
        from flare.instrumentation.python_calls import PythonCallHook
        from flare.instrumentation.step_hooks import StepHooks
        from flare.instrumentation.watchdog import Watchdog

        collectives = self._collective_tracker(runtime)
        python_calls = PythonCallHook(runtime, config.traced_functions)
        parts = [StepHooks(runtime, collectives), DataLoaderHook(runtime), GcHook(runtime),
                 python_calls]
        if collectives is not None:
            parts.append(collectives)
        parts.append(ErrorHooks(runtime, self._flush))
        for part in parts:
            self._install(part)
        runtime.add_step_listener(_FirstStepListener(runtime, python_calls))
        self._watchdog = Watchdog(runtime, self._flush, collectives)
        self._watchdog.on_launcher = self._stop_opamp  # (the collector must not ask it for captures)
        self._opamp = None
        if os.environ.get(opamp_agent.ENV_ENDPOINT):  # the collector can ask for a capture
            from flare.instrumentation.stack_capture import StackCapture

            capture = StackCapture(runtime)
            self._install(capture)
            self._opamp = opamp_agent.start(runtime.identity, capture)
        self._watchdog.start()
        self._install_detail_signal(runtime)
        self._install_gpu_layer(runtime)
        flare_instrumentation._active_runtime = runtime
        os.environ[semconv.ENV_RANK_PID] = _rank_marker()
        atexit.register(self._at_exit)

    def _collective_tracker(self, runtime: Runtime):
        try:
            import torch.distributed as dist

            if not dist.is_available():
                return None
            from flare.instrumentation.collectives import CollectiveTracker

            return CollectiveTracker(runtime)
        except Exception as error:
            _log.warning("flare: collectives are not traced (%r)", error)
            return None

    def _install(self, part) -> None:
        try:
            part.install()
            self._parts.append(part)
        except Exception as error:  # one hook failing must not cost the others
            _log.warning("flare: %s could not be installed: %r", type(part).__name__, error)

    def _install_detail_signal(self, runtime: Runtime) -> None:
        self._sigusr2_installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL:
            _log.info("flare: SIGUSR2 already has a handler; use %s to toggle detail",
                      semconv.ENV_DETAIL_FLAG_FILE)
            return

        def toggle_detail(signum, frame):
            runtime.detail_toggled = not runtime.detail_toggled

        signal.signal(signal.SIGUSR2, toggle_detail)
        self._sigusr2_installed = True

    def _install_gpu_layer(self, runtime: Runtime) -> None:
        import importlib

        self._gpu_modules = []
        for name in GPU_LAYER_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            try:
                module.install(runtime)
                self._gpu_modules.append(module)
            except Exception as error:
                _log.warning("flare: %s.install failed: %r", name, error)

    def _flush(self, timeout_millis: int) -> None:
        """Flare's own flushes (hang, error, signal): never longer than asked, even
        against an unreachable collector (the SDK's flush ignores its timeout)."""
        if self._runtime is not None:
            self._runtime.drain()  # deferred step spans first
        self._flush_deadline.flush(timeout_millis / 1000)

    def _at_exit(self) -> None:
        """Interpreter exit: the step in progress never ends, so stop the watchdog and
        let the GPU layer close any capture window it opened for it (a profiler left
        running into interpreter teardown crashes the process). The SDK's exit flush runs
        after this handler: bound it, so an unreachable collector cannot hold the rank."""
        runtime = getattr(self, "_runtime", None)
        if runtime is not None and not runtime.recent_step_s and runtime.rank == 0:
            # (an inference loop, or a loop whose optimizer Flare does not see: from the
            # outside it looks the same as instrumentation that never loaded)
            _log.warning("flare: no training step ended in this process, so no step was "
                         "traced: steps end at an optimizer's step() or a "
                         "flare.instrumentation.step() block")
        deadline = getattr(self, "_flush_deadline", None)
        if deadline is not None and self._runtime is not None:
            deadline.meter_provider = metrics.get_meter_provider()
            deadline.arm_exit_deadline(self._runtime.config.exit_flush_timeout_s)
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        self._stop_opamp()
        if runtime is not None:
            runtime.stop_finisher()  # deferred step spans reach the SDK before its flush
        for module in reversed(getattr(self, "_gpu_modules", [])):
            try:
                module.uninstall(runtime)
            except Exception as error:
                _log.warning("flare: %s.uninstall at exit failed: %r", module.__name__, error)
        self._gpu_modules = []

    def _stop_opamp(self) -> None:
        agent, self._opamp = getattr(self, "_opamp", None), None
        if agent is not None:
            agent.stop()  # says the agent disconnects (the collector drops its requests)

    # ------------------------------------------------------------------ uninstrument
    def _uninstrument(self, **kwargs) -> None:
        runtime = getattr(self, "_runtime", None)
        if runtime is None:
            return
        atexit.unregister(self._at_exit)
        self._watchdog.stop()
        self._stop_opamp()
        runtime.stop_finisher()
        hook = getattr(self._provider, "_flare_drain_on_flush", None)
        if hook is not None:
            hook._drain = lambda: False
        for module in reversed(self._gpu_modules):
            try:
                module.uninstall(runtime)
            except Exception as error:
                _log.warning("flare: %s.uninstall failed: %r", module.__name__, error)
        for part in reversed(self._parts):
            part.uninstall()
        self._parts = []
        if self._sigusr2_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        runtime.enabled = False
        flare_instrumentation._active_runtime = None
        if os.environ.get(semconv.ENV_RANK_PID, "").partition(":")[0] == str(os.getpid()):
            del os.environ[semconv.ENV_RANK_PID]
        self._runtime = None
