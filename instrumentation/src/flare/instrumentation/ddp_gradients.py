"""Bytes of DDP's gradient all-reduces for the always-on step summary.

DDP's reducer issues its bucket all-reduces from C++, where no Python wrapper sees them;
the flight recorder sizes them, but reading it costs a dump, so only detail steps do.
Yet the buckets are exactly the module's gradients: their size is fixed when the
`DistributedDataParallel` wrapper is built. So Flare wraps `DistributedDataParallel.__init__`
(and nothing DDP runs per step: no comm hook, no forward hook), notes each wrapper's
process group and gradient bytes once, and when a backward advanced that group's
sequence counter while the wrapper synchronises (under `no_sync()` it does not) adds
those bytes to the step's total for the group: one dict lookup and an add per backward.

The bytes are the logical gradient payload, in the dtype DDP reduces in
(`mixed_precision.reduce_dtype` when set, else each parameter's dtype), before any
compression a user's comm hook applies.
"""

from __future__ import annotations

import logging
import time
import weakref

from flare.instrumentation.patching import Patches
from flare.instrumentation.process_groups import ProcessGroups

_log = logging.getLogger(__name__)


def gradient_bytes(ddp) -> int:
    """Bytes DDP all-reduces per synchronised backward: every parameter it manages that
    requires a gradient (ignored parameters excluded, as DDP excludes them)."""
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        ignored = getattr(ddp, "parameters_to_ignore", set())
        params = [p for name, p in ddp.module.named_parameters() if name not in ignored]
    reduce_dtype = getattr(getattr(ddp, "mixed_precision", None), "reduce_dtype", None)
    total = 0
    for param in params:
        if not param.requires_grad:
            continue
        itemsize = reduce_dtype.itemsize if reduce_dtype is not None else param.element_size()
        total += param.numel() * itemsize
    return total


def _first_trained_parameter(ddp):
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        params = ddp.module.parameters()
    return next((p for p in params if p.requires_grad), None)


def _live_wrappers(ddp_class) -> list:
    """DDP wrappers that already exist (`instrument()` called after the model was
    wrapped): one pass over the garbage collector's objects (~56 ms for a torch process
    of 170k objects here), once per install, and only once a process group exists (a
    wrapper needs one): under `opentelemetry-instrument` the install comes first."""
    import gc

    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return []
        # type(), not isinstance(): that would read `__class__` of every object, and
        # some (deprecated torch aliases) warn when it is read
        found = [obj for obj in gc.get_objects() if issubclass(type(obj), ddp_class)]
        return [ddp for ddp in found if _group_alive(dist, ddp)]
    except Exception:  # never fail the install over it
        return []


def _group_alive(dist, ddp) -> bool:
    """Whether the wrapper's process group is still one of this process's: a model
    of a group since destroyed (a notebook's earlier run, not yet collected) never
    runs a backward again, and counting its bytes would inflate every step's."""
    try:
        dist.get_process_group_ranks(ddp.process_group)
        return True
    except Exception:  # KeyError: a destroyed group (or no group attribute at all)
        return False


class GraphDoneMarker:
    """When a backward's gradient computation ended, in a job with DDP wrappers, for
    the price of one hook call per backward instead of a hook registered per backward.

    The tail of a backward after its graph is done is DDP waiting for its bucket
    all-reduces (the reducer's wait runs as an autograd final callback, queued when
    its last bucket is ready). To time it, a final callback queued earlier must note
    the time: final callbacks run in the order they were queued, once the graph is
    done. Registering a hook on each backward's root node costs ~36 µs of the training
    thread per backward in situ (an OrderedDict, a RemovableHandle, two closures),
    while a gradient hook on a parameter stays registered across steps: one per DDP
    wrapper, on its first trained parameter, set when the wrapper is built. It queues
    the marking callback when the parameter's gradient is accumulated, which happens
    before the wrapper's last bucket is ready (that needs every parameter's gradient),
    so the marking callback runs before DDP's wait. `StepHooks` uses it only for the
    outermost backward in progress (a backward nested in another, e.g. a reentrant
    checkpoint's, pauses it) and falls back to a per-backward hook after a few
    backwards it did not mark (a parameter unused by the model's forward)."""

    # Slots: the backward reads and writes several of these right after the forward,
    # with cold caches; in one object's slots they share a cache line or two.
    __slots__ = (
        "_handles",
        "_queue_callback",
        "active",
        "done_ns",
        "misses",
        "op",
        "queued",
        "stack",
        "stack_owner",
        "sync",
    )

    def __init__(self):
        # Set by StepHooks around a backward (start: done_ns = 0, queued = False,
        # active = True; end: active = False, then done_ns is read), inline there.
        self.done_ns = 0
        self.active = False  # an outermost, wrapped backward is in progress
        self.queued = False
        self.misses = 0  # consecutive marked backwards it did not mark (StepHooks)
        # StepHooks' Operation for the marked backward (start_ns 0 while free), and the
        # operation stack of the thread that ran the last one (its ident)
        self.op = None
        self.stack = None
        self.stack_owner = None
        # With one DDP wrapper: (its weak reference, {group: gradient bytes}), for the
        # backward to read `require_backward_grad_sync` inline instead of calling
        # DdpGradients.syncing; None otherwise. (inline: folded into syncing(), with
        # record_backward's usual case, +16 µs per step in situ (hook_cost_in_situ.py,
        # 2026-12-05))
        self.sync = None
        self._queue_callback = None
        self._handles: dict[int, object] = {}

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def watch(self, key: int, ddp) -> None:
        param = _first_trained_parameter(ddp)
        register = getattr(param, "register_post_accumulate_grad_hook", None)
        if register is None:  # no trained parameter (or torch < 2.1): per-backward hooks
            return
        if self._queue_callback is None:
            import torch

            self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback
        self._handles[key] = register(self._on_gradient)

    def forget(self, key: int) -> None:
        handle = self._handles.pop(key, None)
        if handle is not None:
            handle.remove()

    def clear(self) -> None:
        for key in list(self._handles):
            self.forget(key)

    def _on_gradient(self, _param) -> None:  # during backward, on the autograd thread
        if self.active and not self.queued:
            self.queued = True
            self._queue_callback(self._mark)

    def _mark(self) -> None:
        if not self.done_ns:
            self.done_ns = time.time_ns()


class DdpGradients:
    """Registry of live DDP wrappers: process group name -> gradient bytes per sync."""

    def __init__(self, groups: ProcessGroups):
        self.groups = groups
        self.marker = GraphDoneMarker()
        self._patches = Patches()
        # id(ddp) -> (weak reference, group name, bytes); weak so a dropped model is forgotten
        self._wrappers: dict[int, tuple[weakref.ref, str, int]] = {}
        self._bytes_by_group: dict[str, int] = {}

    def install(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        original = DistributedDataParallel.__init__
        registry = self

        def __init__(ddp, *args, **kwargs):
            original(ddp, *args, **kwargs)
            registry.register(ddp)

        __init__.__wrapped__ = original
        __init__.__doc__ = original.__doc__
        self._patches.replace(DistributedDataParallel, "__init__", __init__)
        for ddp in _live_wrappers(DistributedDataParallel):  # built before instrument()
            self.register(ddp)

    def uninstall(self) -> None:
        self._patches.restore_all()
        self.marker.clear()
        self._wrappers.clear()
        self._bytes_by_group = {}  # replaced, never mutated: see current()
        self.marker.sync = None

    def register(self, ddp) -> None:
        """Note a DDP wrapper's group and gradient bytes (once, at construction)."""
        try:
            info = self.groups.info(getattr(ddp, "process_group", None))
            nbytes = gradient_bytes(ddp)
        except Exception as error:  # never break the user's model construction
            _log.info("flare: cannot size DDP gradients (%r); its all-reduces are counted "
                      "but not sized off detail steps", error)
            return
        if info is None or nbytes <= 0:
            return
        key = id(ddp)
        self._wrappers[key] = (weakref.ref(ddp, lambda _ref: self._forget(key)), info.name,
                               nbytes)
        self._recompute()
        try:
            self.marker.watch(key, ddp)
        except Exception as error:  # its backwards get a hook each instead
            _log.info("flare: cannot watch the DDP wrapper's gradients (%r)", error)

    def _forget(self, key: int) -> None:
        self.marker.forget(key)
        if self._wrappers.pop(key, None) is not None:
            self._recompute()

    def _recompute(self) -> None:
        by_group: dict[str, int] = {}
        for _ref, group, nbytes in self._wrappers.values():
            by_group[group] = by_group.get(group, 0) + nbytes
        self._bytes_by_group = by_group
        self.marker.sync = (next(iter(self._wrappers.values()))[0], by_group) \
            if len(self._wrappers) == 1 else None

    def syncing(self) -> dict[str, int]:
        """Group name -> gradient bytes of the wrappers that synchronise their gradients
        now (not inside `no_sync()`): one attribute read per wrapper. The mapping is
        replaced, never mutated, so a caller may keep it and read it later (after the
        model is gone); it is the shared one when every wrapper synchronises. (With one
        wrapper the backward reads `marker.sync` instead, inline.)"""
        # a snapshot: a dropped model's weakref callback may pop one from another thread
        paused = [(group, nbytes) for ref, group, nbytes in tuple(self._wrappers.values())
                  if not getattr(ref(), "require_backward_grad_sync", True)]
        if not paused:
            return self._bytes_by_group
        by_group = dict(self._bytes_by_group)
        for group, nbytes in paused:  # (never below 0, were one forgotten meanwhile)
            by_group[group] = max(0, by_group.get(group, 0) - nbytes)
        return by_group
