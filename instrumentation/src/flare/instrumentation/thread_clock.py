"""The training thread's CPU time and its wait for a CPU, in one read.

Linux keeps per thread, in `/proc/thread-self/schedstat`, the CPU time it ran
(`sum_exec_runtime`) and the time it was *runnable but waiting for a CPU*
(`run_delay`): a host busy with other work (another process burning a core, more
busy threads than cores) shows there, while waiting for the GIL, a lock or I/O does
not (the thread sleeps). That tells "the host starved this rank" from "its own
process starved its Python side" (a GIL-holding thread), which step times alone
cannot. The file is opened once by the thread that reads it and re-read with
`pread` (~0.4 µs here, about what `time.thread_time_ns()` costs where CPU clocks are
system calls). Elsewhere (not Linux, no schedstats) `read()` gives
`time.thread_time_ns()` and None.
"""

from __future__ import annotations

import os
import threading
import time

_PATH = "/proc/thread-self/schedstat"


class ThreadClock:
    """`read()` → (CPU ns of the calling thread, ns it waited for a CPU or None)."""

    __slots__ = ("_fd", "_owner", "_usable")

    def __init__(self) -> None:
        self._fd: int | None = None
        self._owner: int | None = None
        self._usable = hasattr(os, "pread")

    def read(self) -> tuple[int, int | None]:
        if self._usable:
            owner = threading.get_ident()
            if owner != self._owner:
                self._open(owner)
            if self._fd is not None:
                try:
                    cpu, delay, _ = os.pread(self._fd, 64, 0).split()
                    return int(cpu), int(delay)
                except (OSError, ValueError):
                    self._usable = False  # not this kernel's format: the portable clock
        return time.thread_time_ns(), None

    def _open(self, owner: int) -> None:
        self.close()
        try:
            self._fd = os.open(_PATH, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._usable = False
            return
        self._owner = owner

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        self._owner = None
