"""The DataLoader worker processes a blocked training thread waits on, and where each is.

A rank whose DataLoader worker is stuck (a dataset's `__getitem__` blocked on a dead
mount, a lock, a remote read) shows only the main thread's wait on the loader's queue:
its own stack ends in `for batch in loader`, in `select`/`poll`. Where the time goes is in
the worker, a child process of the rank. The blocked thread's frames lead to the loader's
iterator (the `self` of torch's `_MultiProcessingDataLoaderIter` methods), which holds
its worker processes; py-spy (beside the rank's Python, or on PATH) dumps their Python
stacks, which a parent may read even under `kernel.yama.ptrace_scope=1`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from flare.instrumentation import native_stacks
from flare.wire import pyspy_dump

_LOADER_FILE = os.path.join("torch", "utils", "data", "dataloader.py")
TIMEOUT_S = 5.0
MAX_WORKERS = 8  # dumped per report (a loader rarely has more; the rest are listed)
MAX_CHARS = 16_000
# a frame of a py-spy dump's thread: `function (path:line)`, innermost first
_FRAME = re.compile(r"^(\S.*?) \((.+):(\d+)\)$")


def waited_workers(ident: int) -> list[int]:
    """The pids of the DataLoader workers the thread `ident` waits on (innermost loader
    first), or [] when it is not inside a multi-process DataLoader's iterator."""
    frame = sys._current_frames().get(ident)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_LOADER_FILE) and "self" in frame.f_code.co_varnames:
            workers = getattr(frame.f_locals.get("self"), "_workers", None)
            if workers:
                # .pid only: is_alive() would reap a dead worker under the loader's feet
                return [int(w.pid) for w in workers
                        if getattr(w, "pid", None) and os.path.exists(f"/proc/{w.pid}")]
        frame = frame.f_back
    return []


def worker_stacks(pids: list[int]) -> str | None:
    """Each worker's main-thread Python stack, as `File "p", line N in f` lines under a
    `DataLoader worker pid N (most recent call first):` header; None without py-spy."""
    path = native_stacks.binary()
    if path is None:
        return None
    blocks = []
    for pid in pids[:MAX_WORKERS]:
        try:
            done = subprocess.run([path, "dump", "--full-filenames", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode != 0:
            continue
        found = (pyspy_dump.thread_frames(done.stdout, "MainThread")
                 or pyspy_dump.thread_frames(done.stdout, None))
        frames = [_FRAME.match(line) for line in found]
        lines = [f'  File "{m.group(2)}", line {m.group(3)} in {m.group(1)}' for m in frames if m]
        if lines:
            blocks.append(f"DataLoader worker pid {pid} (most recent call first):\n" + "\n".join(lines))
    return "\n\n".join(blocks)[:MAX_CHARS] if blocks else None
