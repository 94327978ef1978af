"""Functional collectives (`torch.distributed._functional_collectives`): what DTensor,
tensor parallel and compiled-away-from-Python code issue, outside `torch.distributed.*`.

They return a tensor whose wait happens later, at its first use (`wait_tensor`, called
by `AsyncCollectiveTensor` or the autograd functions): that wait is where a rank blocks
for the slowest member of its tensor-parallel group. Without it, a TP peer's blocked
time reads as its own compute and the culprit cannot be told from its victims (an FSDP2
+ TP job with one slow rank was labelled a job-wide fail-slow).

Per collective: the issuing wrapper resolves the group's name (the c10d group name, as
the per-group arrays use) and counts it as seen from Python (so the backward tail is
never charged again for it: backward_records.py `_issued_from_cpp`); it remembers the
output tensor's id until its wait. The issuing call's own time (where the backend runs the
collective in it, as gloo on CPU does) and `wait_tensor`'s blocked time are the group's
wait. No span per call: the step summary carries them.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time

from flare.instrumentation.patching import Patches
from flare.instrumentation.runtime import Runtime

_log = logging.getLogger(__name__)

# The issuing functions (names of torch 2.1 … 2.13; those missing are skipped).
ISSUERS = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
           "reduce_scatter_single", "all_to_all_single", "broadcast", "all_gather_tensor_autograd",
           "reduce_scatter_tensor_autograd", "all_to_all_single_autograd")
MAX_PENDING = 4096


class FunctionalCollectives:
    def __init__(self, runtime: Runtime, patches: Patches) -> None:
        self.runtime = runtime
        self.patches = patches
        self._pending: dict[int, tuple[object, str]] = {}  # id(output) -> (output, group)
        self._names: dict[object, str] = {}  # group argument -> resolved name
        self._local = threading.local()  # an issuer calling another counts once
        self.last_group: str | None = None  # of the latest functional collective

    def install(self) -> bool:
        try:
            from torch.distributed import _functional_collectives as funcol
        except ImportError:
            return False
        resolve = getattr(funcol, "_resolve_group_name", None)
        original_wait = getattr(funcol, "wait_tensor", None)
        if resolve is None or original_wait is None:
            _log.info("flare: this torch's functional collectives are not understood; their "
                      "waits are not timed (tensor-parallel waits read as compute)")
            return False
        installed = 0
        for name in ISSUERS:
            original = getattr(funcol, name, None)
            if original is None or getattr(original, "_flare_traced", False):
                continue
            try:
                parameters = list(inspect.signature(original).parameters)
            except (TypeError, ValueError):
                continue
            if "group" not in parameters:
                continue
            self.patches.replace(funcol, name, self._wrap_issue(original, parameters, resolve))
            installed += 1
        self.patches.replace(funcol, "wait_tensor", self._wrap_wait(original_wait))
        return installed > 0

    def _group_name(self, resolve, group, tag) -> str | None:
        key = (id(group), tag) if not isinstance(group, (str, int)) else (group, tag)
        name = self._names.get(key)
        if name is None:
            try:
                name = str(resolve(group, tag))
            except Exception:  # an unknown group form: not timed, never an error
                return None
            if len(self._names) < 1024:
                self._names[key] = name
        return name

    def _wrap_issue(self, original, parameters: list[str], resolve):
        runtime = self.runtime
        pending = self._pending
        group_index = parameters.index("group")
        tag_index = parameters.index("tag") if "tag" in parameters else None
        tracker = self

        local = self._local

        def traced(*args, **kwargs):
            if not runtime.enabled or getattr(local, "depth", 0):
                return original(*args, **kwargs)
            local.depth = 1
            start = time.time_ns()
            try:
                result = original(*args, **kwargs)
            finally:
                local.depth = 0
            issued_ns = time.time_ns() - start
            group = args[group_index] if len(args) > group_index else kwargs.get("group")
            tag = (args[tag_index] if tag_index is not None and len(args) > tag_index
                   else kwargs.get("tag", ""))
            name = tracker._group_name(resolve, group, tag)
            if name is None:
                return result
            totals = runtime.totals.pg_totals(name)
            totals.python_count += 1
            totals.covered += 1
            # The call itself blocks where the backend runs it at once (gloo on CPU
            # waits for every member inside it); elsewhere it is the enqueue.
            totals.wait_ns += issued_ns
            output = getattr(result, "elem", result)  # an AsyncCollectiveTensor's tensor
            if len(pending) >= MAX_PENDING:
                pending.clear()  # outputs never waited for (traced code): let them go
            pending[id(output)] = (output, name)
            tracker.last_group = name
            return result

        traced._flare_traced = True
        traced.__wrapped__ = original
        traced.__name__ = getattr(original, "__name__", "functional_collective")
        traced.__doc__ = original.__doc__
        return traced

    def _wrap_wait(self, original_wait):
        runtime = self.runtime
        pending = self._pending

        tracker = self

        def wait_tensor(tensor):
            if not runtime.enabled:
                return original_wait(tensor)
            entry = pending.pop(id(tensor), None) if pending else None
            # A view of a waiting output (AsyncCollectiveTensor wraps each view of it)
            # is a new tensor: its wait is the latest collective's.
            group = entry[1] if entry is not None and entry[0] is tensor else tracker.last_group
            start = time.time_ns()
            try:
                return original_wait(tensor)
            finally:
                if group is not None:
                    runtime.totals.pg_totals(group).wait_ns += time.time_ns() - start

        wait_tensor._flare_traced = True
        wait_tensor.__wrapped__ = original_wait
        return wait_tensor
