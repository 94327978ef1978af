"""A targeted capture's view into the rank's DataLoader worker processes.

An input-bound rank's training thread only waits on the loader's queue: its own stack
ends in `for batch in loader`. The time is spent in the workers, child processes of
the rank, in the dataset's `__getitem__`, the collate function, a transform. While a
capture samples the training thread (`stack_capture`), the workers it waits on are
recorded by `py-spy record` (`--nonblocking`: the worker is never paused; `--idle`: a
worker asleep in a read or a `sleep` is where the batch's time goes too), and their
samples become one more `flare.capture` child of the rank: the innermost line of the
user's code in each sample, marked `[DataLoader worker]`, with the number of steps the
recording spanned so the diagnosis can put it per step beside the training thread's.
Samples of a worker idle in torch's own loop (waiting for the next index) name no line
of the user's and are left out. Nothing runs where py-spy is not installed
(`native_stacks.binary`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading

from flare.instrumentation import native_stacks
from flare.instrumentation.callsite import _is_plumbing

_log = logging.getLogger(__name__)

RATE_HZ = 100
MAX_WORKERS = 4  # recorded per capture (a loader rarely needs more to show its line)
STOP_TIMEOUT_S = 2.0
WORKER_MARK = "[DataLoader worker] "
_WORKER_LOOP = os.path.join("torch", "utils", "data", "_utils", "worker.py")
# a frame of py-spy's raw (folded) output: `function (path:line)`
_FRAME = re.compile(r"^(.*) \((.+):(\d+)\)$")


class WorkerRecorder:
    """`py-spy record` of a few worker processes, from `start` until `stop`."""

    def __init__(self) -> None:
        self._recording: dict[int, tuple[subprocess.Popen, str]] = {}
        self._stopping = False
        self._lock = threading.Lock()  # started by the sampler, stopped by the training thread

    @property
    def active(self) -> bool:
        return bool(self._recording)

    @property
    def stopping(self) -> bool:
        """Asked to stop (`signal_stop`), not yet stopped."""
        return self._stopping

    @property
    def pids(self) -> list[int]:
        return sorted(self._recording)

    def start(self, pids: list[int]) -> bool:
        """Record these workers (those not recorded yet, up to MAX_WORKERS); whether any
        recording runs."""
        binary = native_stacks.binary()
        with self._lock:
            if binary is None or self._stopping:
                return self.active
            self._start(binary, pids)
            return self.active

    def _start(self, binary: str, pids: list[int]) -> None:
        for pid in pids:
            if pid in self._recording or len(self._recording) >= MAX_WORKERS:
                continue
            handle, path = tempfile.mkstemp(prefix="flare-worker-", suffix=".txt")
            os.close(handle)
            try:
                process = subprocess.Popen(
                    [binary, "record", "--pid", str(pid), "--idle", "--nonblocking", "--format", "raw",
                     "--rate", str(RATE_HZ), "--full-filenames", "--output", path],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError as exc:
                _remove(path)
                _log.info("flare: DataLoader worker %d not recorded: %s", pid, exc)
                continue
            self._recording[pid] = (process, path)

    def signal_stop(self) -> None:
        """Ask each recording to end and write its samples (returns at once)."""
        with self._lock:
            self._stopping = True
            recording = list(self._recording.values())
        for process, _ in recording:
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    process.send_signal(signal.SIGINT)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> tuple[dict[tuple[str, ...], int], float]:
        """End the recordings; the workers' user stacks (root first, "file:line in
        function" each) with their sample counts, and how long they were recorded: the
        mean over the workers of the samples taken of each (py-spy's first samples come
        a few tens of ms after it starts, and fewer on a busy host: counting what it
        took, not the wall time, keeps the share of each line right)."""
        self.signal_stop()
        with self._lock:
            recording, self._recording = self._recording, {}
        stacks: dict[tuple[str, ...], int] = {}
        taken = []
        for pid, (process, path) in recording.items():
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                _log.info("flare: DataLoader worker %d: py-spy did not stop in time; its samples are lost", pid)
            try:
                with open(path, encoding="utf-8", errors="replace") as lines:
                    counted, samples = parse_raw(lines)
            except OSError:
                counted, samples = {}, 0
            _remove(path)
            if samples:
                taken.append(samples)
            for stack, count in counted.items():
                stacks[stack] = stacks.get(stack, 0) + count
        with self._lock:
            self._stopping = False
        return stacks, sum(taken) / len(taken) if taken else 0.0


def parse_raw(lines) -> tuple[dict[tuple[str, ...], int], int]:
    """py-spy's raw output (one `frame;frame;… count` line per distinct stack, root
    first) → the worker main threads' user stacks and their counts, and every sample of
    those threads (user's or not). Threads other than the worker's loop are not the
    batch's (a queue feeder, a resource sharer) and are left out."""
    stacks: dict[tuple[str, ...], int] = {}
    total = 0
    for line in lines:
        text, _, count_text = line.rstrip("\n").rpartition(" ")
        if not text or not count_text.isdigit():
            continue
        frames = [_FRAME.match(frame) for frame in text.split(";")]
        loop = [i for i, m in enumerate(frames) if m and m.group(2).endswith(_WORKER_LOOP)]
        if not loop:
            continue
        count = int(count_text)
        total += count
        # (the frames above the worker's loop are the parent's, copied by the fork)
        user = tuple(f"{m.group(2)}:{m.group(3)} in {m.group(1).rsplit('.', 1)[-1]}"
                     for m in frames[loop[-1] + 1:] if m and not _is_plumbing(m.group(2)))
        if user:
            stacks[user] = stacks.get(user, 0) + count
    return stacks, total


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def forked_children(pid: int | None = None) -> list[int]:
    """The child processes `pid` (this process) forked without exec'ing another program:
    a DataLoader's workers (and any other multiprocessing fork of the user's), not the
    compiler's or py-spy's, which run programs of their own."""
    pid = pid or os.getpid()
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as own:
            command = own.read()
    except OSError:
        return []
    out = []
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as theirs:
                if theirs.read() == command:
                    out.append(child)
        except OSError:
            continue
    return out


def child_pids(pid: int) -> list[int]:
    """`pid`'s children: from /proc/PID/task/*/children where the kernel keeps it,
    else by the parent field of every process's /proc/N/stat."""
    found: list[int] = []
    listed = False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found.extend(int(child) for child in listing.read().split())
            listed = True
        except (OSError, ValueError):
            continue
    if listed:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # pid (comm) state ppid …: comm may hold spaces and parentheses
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid).encode():
            found.append(int(entry))
    return found
