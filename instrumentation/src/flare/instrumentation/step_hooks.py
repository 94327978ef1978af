"""Step boundaries without code changes: global optimizer step hooks, plus the autograd
backward entry point (which also measures the gradient all-reduce wait hidden in it).

A step runs from the end of the previous optimizer step to the end of this one, so the
batch fetch, forward and backward all fall inside it. The first step begins at the
first batch fetch, backward or optimizer step. With several optimizers, the first one
to step is the step clock (its post-hook closes the step); all ranks pick the same one.
When the clock optimizer is gone (replaced after a warm-up phase), the next one to step
becomes the clock.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from types import MappingProxyType

from flare.instrumentation.operations import Operation
from flare.instrumentation.patching import Patches
from flare.instrumentation.runtime import Runtime

_log = logging.getLogger(__name__)

OP_BACKWARD = "autograd.backward"
_NO_ATTRIBUTES = MappingProxyType({})  # a backward in flight has none
_MARKER_MISSES = 3  # consecutive unmarked backwards before the per-backward hook takes over
_NOTHING = MappingProxyType({})  # no gradient bytes (DDP inside no_sync())


class StepHooks:
    def __init__(self, runtime: Runtime, collectives=None):
        self.runtime = runtime
        self.collectives = collectives  # CollectiveTracker or None (no torch.distributed)
        self._clock: weakref.ref | None = None
        self._tensor_type = None  # torch.Tensor, and the autograd engine's queue_callback,
        self._queue_callback = None  # looked up once at install (backward runs them cold)
        self._handles: list = []
        self._patches = Patches()
        self._record_failed = False  # warned once
        # DDP jobs: when a backward's graph is done, from a hook kept across steps
        # (ddp_gradients.GraphDoneMarker); None without torch.distributed
        self._marker = collectives.ddp_gradients.marker if collectives is not None else None
        if self._marker is not None:  # the Operation a marked backward reuses
            self._marker.op = Operation(OP_BACKWARD, 0, _NO_ATTRIBUTES)

    # -------------------------------------------------------------- install/uninstall
    def install(self) -> None:
        import torch
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles.append(register_optimizer_step_pre_hook(self._pre_step))
        self._handles.append(register_optimizer_step_post_hook(self._post_step))
        original = torch.autograd.backward
        self._tensor_type = torch.Tensor
        self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback
        self._patches.replace(torch.autograd, "backward", self._make_backward(original))

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._patches.restore_all()

    # -------------------------------------------------------------- optimizer hooks
    def _pre_step(self, optimizer, args, kwargs) -> None:
        runtime = self.runtime
        if runtime.enabled and not runtime.explicit_steps and not runtime.step_open:
            runtime.begin_step()

    def _post_step(self, optimizer, args, kwargs) -> None:
        runtime = self.runtime
        if not runtime.enabled or runtime.explicit_steps:
            return
        clock = self._clock() if self._clock is not None else None
        if clock is None:
            self._clock = weakref.ref(optimizer)
        elif clock is not optimizer:
            return
        runtime.step_boundary(time.time_ns())

    # -------------------------------------------------------------- backward
    def _make_backward(self, original):
        """The wrapper of `torch.autograd.backward`: it times the backward and splits
        off the tail spent after the gradient computation finished, which is DDP/FSDP
        waiting for its bucket collectives (the reducer's wait runs as an autograd
        final callback, queued after ours). With DDP wrappers, the final callback that
        marks the graph done is queued by a gradient hook kept across steps
        (`GraphDoneMarker`); otherwise by a hook on this backward's root node
        (`_hooked_backward`). The usual case runs right after the forward, with cold
        caches, where every object touched costs ~1 µs: it is written out here, in one
        frame, touching as few objects as it can."""
        runtime = self.runtime
        hooks = self
        marker = self._marker  # GraphDoneMarker (slots) or None
        collectives = self.collectives
        add_backward = collectives._add_backward if collectives is not None else None
        time_ns = time.time_ns
        get_ident = threading.get_ident

        def backward(tensors, *args, **kwargs):
            if not runtime.enabled:
                return original(tensors, *args, **kwargs)
            if not runtime.step_open and not runtime.explicit_steps:
                runtime.begin_step()
            totals = runtime.totals
            m = marker
            if (m is None or m.active or not m._handles or m.misses >= _MARKER_MISSES
                    or m.op.start_ns):  # (the op in use: a backward on another thread)
                return hooks._hooked_backward(original, tensors, args, kwargs, totals)
            # GraphDoneMarker.start(), inline: folded into a GraphDoneMarker.start() it
            # costs +1.8 µs per step in situ (hook_cost_in_situ.py, 2026-12-05)
            m.done_ns = 0
            m.queued = False
            m.active = True
            seq_start = totals.seq_start
            several = seq_start is not None and len(seq_start) > 1
            seqs_before = collectives.sequences_before_backward(totals) if several else None
            # Operations.push, inline (the watchdog reads the thread's stack): folded into
            # Operations.push()/pop() costs +16 µs per step in situ (hook_cost_in_situ.py,
            # 2026-12-05)
            stack = m.stack
            if m.stack_owner != get_ident():
                stack = m.stack = runtime.operations.thread_stack()
                m.stack_owner = get_ident()
            op = m.op
            start = op.start_ns = time_ns()
            op.reported = False
            stack.append(op)
            try:
                return original(tensors, *args, **kwargs)
            finally:
                end = time_ns()
                if stack and stack[-1] is op:
                    stack.pop()
                else:
                    runtime.operations.pop(op)
                op.start_ns = 0  # free for the next backward
                m.active = False
                done_ns = m.done_ns
                if done_ns:
                    m.misses = 0
                else:
                    hooks._missed_mark()
                totals.backward_ns += end - start
                sync = m.sync
                if (sync is not None and seq_start and not several
                        and not runtime.step_detail):
                    # CollectiveTracker.record_backward's usual case, inline: one group,
                    # one DDP wrapper (synchronising unless inside its no_sync()); folded
                    # into CollectiveTracker.record_backward() (through _record) it costs
                    # +16 µs per step in situ (hook_cost_in_situ.py, 2026-12-05)
                    totals.pending.append((add_backward, (
                        done_ns, end, None, None,
                        sync[1] if getattr(sync[0](), "require_backward_grad_sync", True)
                        else _NOTHING)))
                elif collectives is not None:
                    hooks._record(collectives, totals, start, done_ns, end, seqs_before)

        backward.__wrapped__ = original
        backward.__doc__ = original.__doc__
        return backward

    def _hooked_backward(self, original, tensors, args, kwargs, totals):
        """No armed DDP marker, or a backward nested in another (or running on another
        thread meanwhile): a final callback queued by a pre-hook on this backward's root
        node marks the graph done."""
        runtime, marker = self.runtime, self._marker
        nested = marker is not None and marker.active
        if nested:  # inside another backward: its marker must not fire in this graph
            marker.active = False
        graph_done = [0]
        queue_callback = self._queue_callback

        def mark_graph_done() -> None:
            graph_done[0] = time.time_ns()

        def queue_marker(*_):
            queue_callback(mark_graph_done)

        handle = None
        roots = (tensors,) if isinstance(tensors, self._tensor_type) else tuple(tensors or ())
        for root in roots:
            grad_fn = getattr(root, "grad_fn", None)
            if grad_fn is not None:
                handle = grad_fn.register_prehook(queue_marker)
                break
        collectives = self.collectives
        seqs_before = (collectives.sequences_before_backward(totals)
                       if collectives is not None else None)
        start = time.time_ns()
        op = runtime.operations.push(OP_BACKWARD, start, _NO_ATTRIBUTES)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            end = time.time_ns()
            runtime.operations.pop(op)
            if nested:
                marker.active = True
            # A graph that is not retained is freed with its hooks: removing ours
            # would only cost the training thread (it runs cold here). A retained
            # one may be walked again, so there it goes.
            if handle is not None and _retains_graph(args, kwargs):
                handle.remove()
            totals.backward_ns += end - start
            if collectives is not None:
                self._record(collectives, totals, start, graph_done[0], end, seqs_before)

    def _record(self, collectives, totals, start, done_ns, end, seqs_before) -> None:
        try:
            collectives.record_backward(totals, start, done_ns, end, seqs_before)
        except Exception as error:  # bookkeeping must never fail the user's backward
            if not self._record_failed:
                self._record_failed = True
                _log.warning("flare: a backward's collective bookkeeping failed (%r); "
                             "training continues", error)

    def _missed_mark(self) -> None:
        self._marker.misses += 1
        if self._marker.misses == _MARKER_MISSES:
            _log.info("flare: the DDP gradient hook did not mark %d backwards in a row (a "
                      "parameter the forward does not use?); backwards get a hook each",
                      _MARKER_MISSES)


def _retains_graph(args: tuple, kwargs: dict) -> bool:
    """torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph, ...):
    whether the graph outlives this call (retain_graph defaults to create_graph)."""
    retain = kwargs.get("retain_graph", args[1] if len(args) > 1 else None)
    create = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
    return bool(create if retain is None else retain)
