"""Flare's rank-aware OpenTelemetry instrumentation of PyTorch training.

Auto-instrumentation (`opentelemetry-instrument torchrun ... train.py`) needs no code
change. Custom loops without an optimizer hook can mark steps explicitly:

    from flare.instrumentation import step
    for batch in loader:
        with step():
            ...

Kept import-light: nothing here imports torch.
"""

from __future__ import annotations

import contextlib

from flare.instrumentation.version import __version__

_active_runtime = None  # set by TorchTrainingInstrumentor while instrumented


def active_runtime():
    """The instrumented process's Runtime, or None (not a rank, or not instrumented)."""
    return _active_runtime


@contextlib.contextmanager
def step():
    """Mark one training step explicitly. Once used, it alone defines step boundaries
    (the optimizer hook stops opening and closing steps). A no-op when not instrumented."""
    runtime = _active_runtime
    if runtime is None or not runtime.enabled:
        yield
        return
    if not runtime.explicit_steps:
        runtime.explicit_steps = True
        if runtime.step_open:
            runtime.abandon_step()  # opened implicitly, never to be closed
    runtime.begin_step()
    try:
        yield
    except BaseException as error:
        from flare.instrumentation.callsite import traceback_site

        if runtime.step_open and not isinstance(error, (KeyboardInterrupt, GeneratorExit)):
            runtime.fail_step(error, f"{type(error).__name__}: {error}",
                              traceback_site(error.__traceback__))
        raise
    else:
        runtime.end_step()


__all__ = ["__version__", "active_runtime", "step"]
