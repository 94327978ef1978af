"""Native frames of a hung rank, through py-spy, where it is installed and allowed.

A Python stack stops at the call into C: a rank blocked in a collective, in CUDA or in
a read shows only the Python line that called it. `py-spy dump --native` also walks the
C and C++ frames under it (libc's wait, NCCL, the CUDA driver). The watchdog asks for it
once per hang report, from its own thread: py-spy pauses the process for the dump (well
under a second) and its text goes on the `flare.hang` span. `FLARE_PY_SPY` names the
binary (default: `py-spy` beside the rank's Python, else on PATH); `FLARE_PY_SPY=0` turns it off. Where py-spy is not
installed nothing is tried; where the kernel refuses it (ptrace), one warning, then no
more tries.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

_log = logging.getLogger(__name__)

ENV_PY_SPY = "FLARE_PY_SPY"
TIMEOUT_S = 20.0
MAX_CHARS = 32 * 1024
_refused = False


def binary() -> str | None:
    setting = os.environ.get(ENV_PY_SPY, "")
    if setting == "0" or _refused:
        return None
    # beside this Python first (a virtual environment's bin/ need not be on PATH)
    search = os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", "")))
    return shutil.which(setting or "py-spy", path=search)


def dump_native(pid: int | None = None) -> str | None:
    """`py-spy dump --native` of `pid` (this process), or None."""
    global _refused
    path = binary()
    if path is None:
        return None
    try:
        done = subprocess.run([path, "dump", "--native", "--pid", str(pid or os.getpid())],
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _refused = True
        _log.warning("flare: py-spy could not dump this rank's native frames (%s); not tried again", exc)
        return None
    if done.returncode != 0 or not done.stdout.strip():
        _refused = True
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        _log.warning("flare: py-spy could not dump this rank's native frames (%s); not tried "
                     "again (it needs ptrace: root, CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0)",
                     reason[:200])
        return None
    return done.stdout[:MAX_CHARS]
