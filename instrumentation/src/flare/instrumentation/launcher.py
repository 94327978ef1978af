"""Ranks started by an instrumented launcher stay instrumented.

`opentelemetry-instrument torchrun … train.py` instruments torchrun's own process
through a `sitecustomize` on PYTHONPATH, and torchrun's children — the ranks — through
the same PYTHONPATH. Before opentelemetry-instrumentation 0.63b0 that `sitecustomize`
took its folder off PYTHONPATH for good as it ran (against a loop of processes spawned
while initialising), so no rank was instrumented and the job sent nothing; 0.63b0 puts
it back once initialised (open-telemetry/opentelemetry-python-contrib#4469). Under an
older version Flare, loaded in the launcher as an instrumentor, puts it back itself,
as the newer versions do: after initialisation, only when it was there at start.
"""

from __future__ import annotations

import logging
import os
import sys

from flare.wire.sdk_adapter import major_minor

_log = logging.getLogger(__name__)

RESTORES_ITSELF = (0, 63)  # opentelemetry-instrumentation 0.63b0


def _version() -> tuple[int, int] | None:
    try:
        from opentelemetry.instrumentation.version import __version__
    except ImportError:
        return None
    return major_minor(__version__)


def quiet_interrupts(environ=os.environ) -> bool:
    """Under `flare run` (FLARE_RUN_PID set), a launcher stopped by Ctrl-C or SIGTERM
    says so in one line instead of its traceback (torchrun's SignalException, twice:
    ~50 lines above flare run's report). Anything else is printed as before."""
    if not environ.get("FLARE_RUN_PID"):
        return False
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or exc_type.__name__ == "SignalException":
            what = str(exc).rsplit(": ", 1)[-1] if exc_type.__name__ == "SignalException" else "2"
            name = {"2": "Ctrl-C", "15": "SIGTERM"}.get(what, f"signal {what}")
            sys.stderr.write(f"flare: {os.path.basename(sys.argv[0] or 'launcher')} stopped by {name}\n")
            return
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    return True


def keep_for_children(environ=os.environ) -> bool:
    """Put the auto-instrumentation folder back on PYTHONPATH when this process was
    started through it and an older opentelemetry-instrumentation took it off; True
    when it did."""
    version = _version()
    if version is None or version >= RESTORES_ITSELF:
        return False
    site = sys.modules.get("sitecustomize")
    try:
        from opentelemetry.instrumentation import auto_instrumentation
    except ImportError:
        return False
    folder = os.path.dirname(os.path.abspath(auto_instrumentation.__file__))
    started_through_it = site is not None and os.path.dirname(
        os.path.abspath(getattr(site, "__file__", "") or "")) == folder
    current = environ.get("PYTHONPATH", "")
    if not started_through_it or folder in current.split(os.pathsep):
        return False
    environ["PYTHONPATH"] = folder + os.pathsep + current if current else folder
    _log.debug("flare: auto-instrumentation kept on PYTHONPATH for this process's children")
    return True


def rank_child(pid: int | None = None) -> tuple[int, str] | None:
    """A process `pid` (this one) started, or one of those started, that is a rank
    (RANK in its environment): its pid and rank, None when there is none. A process
    that starts ranks is a launcher, whatever its name."""
    from flare.instrumentation.worker_capture import child_pids

    pid = pid or os.getpid()
    children = child_pids(pid)
    for child in [*children, *(grandchild for c in children for grandchild in child_pids(c))]:
        try:
            with open(f"/proc/{child}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK=") and item[5:].strip().isdigit():
                return child, item[5:].decode()
    return None
