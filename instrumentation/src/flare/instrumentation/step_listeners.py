"""The step listeners a `Runtime` calls at every step's start and end (the GPU layer's
kernel windows and NVML, the collective tracker's detail steps, the capture agent).

Their bound hooks are looked up once, when the set changes, not at every step boundary;
a listener's `ordinary_steps` (default: both hooks) names the hooks it needs on steps
that are not detail steps, so the others are not even called there. A listener that
raises is logged once and never breaks training.
"""

from __future__ import annotations

import logging

_log = logging.getLogger("flare.instrumentation.runtime")


class StepListeners:
    __slots__ = (
        "_failed",
        "listeners",
        "on_end",
        "on_end_ordinary",
        "on_start",
        "on_start_ordinary",
    )

    def __init__(self) -> None:
        # replaced, never mutated: iterated without a copy
        self.listeners: tuple = ()
        self.on_start: tuple = ()  # (listener, its bound on_step_start)
        self.on_end: tuple = ()
        self.on_start_ordinary: tuple = ()  # the same, for steps that are not detail steps
        self.on_end_ordinary: tuple = ()
        self._failed: set[int] = set()

    def add(self, listener) -> None:
        self._set((*self.listeners, listener))

    def remove(self, listener) -> None:
        if listener in self.listeners:
            listeners = list(self.listeners)
            listeners.remove(listener)
            self._set(tuple(listeners))

    def _set(self, listeners: tuple) -> None:
        self.listeners = listeners
        self.on_start = tuple((listener, listener.on_step_start) for listener in listeners)
        self.on_end = tuple((listener, listener.on_step_end) for listener in listeners)
        wanted = [getattr(listener, "ordinary_steps", ("on_step_start", "on_step_end"))
                  for listener in listeners]
        self.on_start_ordinary = tuple(
            hook for hook, names in zip(self.on_start, wanted, strict=True)
            if "on_step_start" in names)
        self.on_end_ordinary = tuple(
            hook for hook, names in zip(self.on_end, wanted, strict=True)
            if "on_step_end" in names)

    def notify(self, methods: tuple, *args) -> None:
        """Call one hook (`on_start`, `on_end` or their ordinary-step sets) of every
        listener in `methods`."""
        for listener, method in methods:
            try:
                method(*args)
            except Exception as error:  # a listener must never break training
                if id(listener) not in self._failed:
                    self._failed.add(id(listener))
                    _log.warning("flare: step listener %r failed in %s: %r",
                                 listener, method.__name__, error)
