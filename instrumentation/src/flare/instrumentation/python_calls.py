"""`python.call`: curated hot functions (device synchronisation, checkpoint saves), the
training frameworks' phases, and the user's `FLARE_TRACED_FUNCTIONS=module:qualname,...`
list.

A phase (PHASES: a checkpoint save, an evaluation) is timed by its outermost function
only — the Trainer's `_save_checkpoint` holds the `torch.save` and `save_file` calls it
makes — and its own time (less what it waited in collectives or in garbage collection,
which the step counts already; the batches an evaluation loads are its own) leaves the
step's compute and data loading for `flare.step.checkpoint_ms` / `flare.step.evaluation_ms`. The diagnosis names a slowdown
there as the phase's, not as slower compute.

User entries are resolved lazily: what is importable at instrumentation time is patched
then, the rest (e.g. `__main__:train_step`) at the first step, when the user's modules
exist. A malformed or unresolvable entry gets one warning and the others still work.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import time

from flare.instrumentation.callsite import caller_site, format_site
from flare.instrumentation.patching import Patches
from flare.instrumentation.runtime import Runtime
from flare.wire import semconv

_log = logging.getLogger(__name__)

# (module, qualname) of the functions the paper times through the profiling hook.
CURATED = (
    ("torch.cuda", "synchronize"),
    ("torch.cuda", "Event.synchronize"),
    ("torch.cuda", "Event.wait"),
    ("torch.cuda", "Stream.synchronize"),
    ("torch.cuda", "Stream.wait_event"),
    ("torch.cuda", "Stream.wait_stream"),
)

# (module, qualname) -> phase: the frameworks' checkpoint and evaluation entry points
# (patched where the framework is imported; tested: tests/e2e/test_frameworks.py), then
# the generic writers a loop of the user's own calls.
PHASES = {
    ("transformers.trainer", "Trainer._save_checkpoint"): semconv.PHASE_CHECKPOINT,
    ("transformers.trainer", "Trainer.evaluate"): semconv.PHASE_EVALUATION,
    ("lightning.pytorch.trainer.trainer", "Trainer.save_checkpoint"): semconv.PHASE_CHECKPOINT,
    ("lightning.pytorch.loops.evaluation_loop", "_EvaluationLoop.run"): semconv.PHASE_EVALUATION,
    ("lightning.fabric.fabric", "Fabric.save"): semconv.PHASE_CHECKPOINT,
    ("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint"): semconv.PHASE_CHECKPOINT,
    ("torch", "save"): semconv.PHASE_CHECKPOINT,
    ("torch.distributed.checkpoint", "save"): semconv.PHASE_CHECKPOINT,
    ("torch.distributed.checkpoint", "async_save"): semconv.PHASE_CHECKPOINT,
    ("torch.distributed.checkpoint", "save_state_dict"): semconv.PHASE_CHECKPOINT,
    ("safetensors.torch", "save_file"): semconv.PHASE_CHECKPOINT,
}


def parse_entry(entry: str) -> tuple[str, str] | None:
    module, sep, qualname = entry.partition(":")
    module, qualname = module.strip(), qualname.strip()
    if not sep or not module or not qualname or any(not p.isidentifier()
                                                    for p in qualname.split(".")):
        return None
    return module, qualname


class PythonCallHook:
    def __init__(self, runtime: Runtime, user_entries: tuple[str, ...]):
        self.runtime = runtime
        self._patches = Patches()
        self._pending_user: list[tuple[str, str, str]] = []
        self._patched_ids: set[int] = set()
        for entry in user_entries:
            parsed = parse_entry(entry)
            if parsed is None:
                _log.warning("flare: %s entry %r is not module:qualname; ignoring it",
                             semconv.ENV_TRACED_FUNCTIONS, entry)
            else:
                self._pending_user.append((entry, *parsed))

    def install(self) -> None:
        for module, qualname in (*CURATED, *PHASES):
            if module in sys.modules or module in ("torch", "torch.cuda"):
                self._patch(module, qualname, import_module=True)
        self._resolve_user(final=False)

    def on_first_step(self) -> None:
        for module, qualname in (*CURATED, *PHASES):
            if module in sys.modules:
                self._patch(module, qualname, import_module=False)
        self._resolve_user(final=True)

    def uninstall(self) -> None:
        self._patches.restore_all()
        self._patched_ids.clear()

    # ------------------------------------------------------------------ resolution
    def _resolve_user(self, final: bool) -> None:
        still_pending = []
        for entry, module, qualname in self._pending_user:
            if module not in sys.modules and not final and module != "__main__":
                try:
                    importlib.import_module(module)
                except Exception:
                    still_pending.append((entry, module, qualname))
                    continue
            if module == "__main__" and not final:
                still_pending.append((entry, module, qualname))
                continue
            if not self._patch(module, qualname, import_module=final):
                _log.warning("flare: %s entry %r cannot be resolved; ignoring it",
                             semconv.ENV_TRACED_FUNCTIONS, entry)
        self._pending_user = still_pending

    def _patch(self, module_name: str, qualname: str, import_module: bool) -> bool:
        try:
            module = (importlib.import_module(module_name) if import_module
                      else sys.modules[module_name])
            *owner_path, attribute = qualname.split(".")
            owner = module
            for part in owner_path:
                owner = getattr(owner, part)
            target = getattr(owner, attribute)
        except Exception:
            return False
        if not callable(target):
            return False
        if id(target) in self._patched_ids or getattr(target, "_flare_traced", False):
            return True
        name = f"{module_name}.{qualname}"
        phase = PHASES.get((module_name, qualname))
        wrapper = self._wrap(target, name) if phase is None else self._wrap_phase(target, name, phase)
        self._patches.replace(owner, attribute, wrapper)
        self._patched_ids.add(id(target))
        return True

    def _wrap(self, original, name: str):
        runtime = self.runtime

        @functools.wraps(original)
        def traced(*args, **kwargs):
            if not runtime.enabled:
                return original(*args, **kwargs)
            start = time.time_ns()
            site = caller_site()
            op = runtime.operations.push(semconv.SPAN_PYTHON_CALL, start,
                                 {semconv.CODE_FUNCTION: name}, site)
            try:
                return original(*args, **kwargs)
            finally:
                end = time.time_ns()
                runtime.operations.pop(op)
                totals = runtime.totals
                totals.pycall_ns += end - start
                totals.pycall_count += 1
                if runtime.step_open:
                    _emit(runtime, start, end, {semconv.CODE_FUNCTION: name}, site)

        traced._flare_traced = True
        return traced

    def _wrap_phase(self, original, name: str, phase: str):
        """A phase's function: a `python.call` span with `flare.phase`, and its own time
        in the step's phase total when it is the outermost phase running (the calls it
        makes inside — `torch.save` under the Trainer's save — are its own time)."""
        runtime = self.runtime
        field = "checkpoint_ns" if phase == semconv.PHASE_CHECKPOINT else "evaluation_ns"

        @functools.wraps(original)
        def traced(*args, **kwargs):
            if not runtime.enabled or runtime.phase is not None:
                return original(*args, **kwargs)
            start = time.time_ns()
            site = caller_site()
            runtime.phase = phase
            totals = runtime.totals
            inner = _inner_ns(totals)
            op = runtime.operations.push(semconv.SPAN_PYTHON_CALL, start,
                                 {semconv.CODE_FUNCTION: name, semconv.PHASE: phase}, site)
            try:
                return original(*args, **kwargs)
            finally:
                end = time.time_ns()
                runtime.operations.pop(op)
                runtime.phase = None
                now = runtime.totals
                own = end - start
                if now is totals:  # (a phase across a step boundary, rare, keeps its wall time)
                    # the wait in collectives and GC stay theirs; the batches the phase
                    # loaded (an evaluation's) are the phase's time, not the step's loading
                    waited, loaded = _inner_ns(now)
                    own -= waited - inner[0]
                    now.dataloader_ns -= loaded - inner[1]
                setattr(now, field, getattr(now, field) + max(0, own))
                if runtime.step_open:
                    _emit(runtime, start, end, {semconv.CODE_FUNCTION: name, semconv.PHASE: phase}, site)

        traced._flare_traced = True
        return traced


def _emit(runtime: Runtime, start: int, end: int, attributes: dict, site) -> None:
    """The call's `python.call` span, with where it was called from."""
    if site is not None:
        attributes[semconv.CODE_FILEPATH] = site[0]
        attributes[semconv.CODE_LINENO] = site[1]
        attributes[semconv.CODE_CALLSITE] = format_site(site)
    # a function that runs the optimizer step (a whole `train_step`) returns in the next
    # step: its span keeps its whole duration, starting before that step's (the summary
    # counts it there too)
    runtime.emit_child(semconv.SPAN_PYTHON_CALL, start, end, attributes, keep_start=True)


def _inner_ns(totals) -> tuple[int, int]:
    """What the step's other counters hold so far: collective wait and GC, and data loading."""
    wait = 0
    for pg in totals.pg.values():
        wait += pg.wait_ns
    return wait + totals.gc_ns, totals.dataloader_ns
