"""Targeted capture: where a rank's own time goes, line by line, for a few steps, on request.

Asked by the collector over OpAMP (`opamp_agent`: `start(K)`): the rank captures the next
K steps (default 20; at most 1,000). Those are detail steps whose training thread's
Python stack is sampled every 10 ms by a thread of its own (`sys._current_frames`, as
py-spy's in-process cousins do); each sample counts the innermost frame of the user's
code (`callsite.user_frame`: outside torch, Flare and the standard library — the line
that called into the slow kernel, the blocking collective or the data loader); any other
thread of the user's that burnt CPU since the last sample (a GIL-holding logger) is
counted too, as "[thread NAME] file", so a `cpu` label names the hog's line. A sample
in which the training thread was blocked (neither on a CPU nor waiting for one: in a
collective, a queue, a lock, `sleep` or I/O) counts its line as "waiting in FILE:LINE
in FUNCTION", so the diagnosis never takes a wait for work. Each captured step gets
one `flare.capture` child: the frames and their sample counts.
Capture stops after K steps or when the collector goes away (`stop`), and nothing is
sampled on a rank that was not asked. The rank's DataLoader worker processes are
recorded over the same steps where py-spy is installed (`worker_capture`): one more
child, their lines marked `[DataLoader worker]`, spanning `flare.capture.window_steps`.

`flare run` asks the culprit ranks of a live label and one healthy peer, `flare capture`
any ranks; the diagnosis compares the two (`flare.diagnostics.hotspots`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from flare.instrumentation import worker_capture
from flare.instrumentation.callsite import user_frame
from flare.instrumentation.runtime import Runtime
from flare.wire import semconv

_log = logging.getLogger(__name__)

INTERVAL_S = 0.01
MAX_STEPS = 1000
TOP_FRAMES = 30
MAX_DEPTH = 48  # user frames kept per sampled stack
WORKER_SCAN_STEPS = 10
# The workers' recordings are asked to stop this many steps before the capture's last
# ends, and that end waits this long for their samples before dropping them. py-spy
# writes them in a few ms on a quiet host; on a loaded one it waits for a CPU too, and
# three steps ahead leave it that time without holding the training thread longer. (A
# precaution: the loaded runs whose stores were kept had all their workers' samples;
# their wrong live line came from a short episode, mended in the diagnosis.)
WORKER_STOP_AHEAD_STEPS = 3
WORKER_STOP_S = 0.5
_OWN_THREADS = ("flare-", "Otel", "pt_", "QueueFeederThread")  # Flare's, the SDK's, torch's
# The training thread was blocked over a sampling interval when it ran, or waited in the
# run queue to run, for less than this share of it (a thread descheduled on a busy host
# still wants its CPU: that is not a wait of its own).
BLOCKED_BELOW = 0.5


def _plumbing(frame) -> bool:
    from flare.instrumentation.callsite import _is_plumbing

    return _is_plumbing(frame.f_code.co_filename)


def _user_stack(frame) -> tuple[str, ...]:
    """The user's frames of a thread's stack, root first, "file:line in function" each
    (at most MAX_DEPTH, the innermost kept); the innermost frame alone when every frame
    is plumbing. Its last element is `callsite.user_frame`'s line."""
    out = []
    current = frame
    while current is not None and len(out) < MAX_DEPTH:
        code = current.f_code
        if not _plumbing(current):
            out.append(f"{code.co_filename}:{current.f_lineno} in {code.co_name}")
        current = current.f_back
    if not out:
        code = frame.f_code
        out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
    out.reverse()
    return tuple(out)


class StackCapture:
    """A step listener (detail steps): samples while a capture is on, one child per step."""

    ordinary_steps = ()

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.steps_left = 0
        self.stacks = True  # False: detail steps only (collectives, kernel windows), no sampling
        self.on_finished = None  # called (training thread) when a capture ends
        self._counts: dict[tuple[str, tuple[str, ...]], int] = {}  # (thread, stack) -> samples
        self._samples = 0
        self._lock = threading.Lock()
        self._sampling = threading.Event()
        self._thread: threading.Thread | None = None
        self._target: int | None = None  # the training thread
        self._target_native: int | None = None  # its kernel thread id (its schedstat)
        self._workers = worker_capture.WorkerRecorder()
        self._worker_steps = 0  # captured steps the workers were recorded over
        self._worker_step_ns = 0  # ...and their wall time
        self._worker_scan = 0  # captured steps until the next look for forked workers

    # ------------------------------------------------------------ requests (agent's thread)
    def start(self, steps: int, request: str, stacks: bool = True) -> None:
        """Capture the next `steps` steps (a request already running is replaced): detail
        steps, with the stacks sampled unless `stacks` is False."""
        with self._lock:
            self.steps_left = max(1, min(MAX_STEPS, int(steps)))
            self.stacks = stacks
            self._worker_scan = WORKER_SCAN_STEPS
        if stacks and self.steps_left > 1:
            # before the first captured step, so that every one says its workers'
            # capture is coming (a line read before it came is not the final one)
            self._workers.start(worker_capture.forked_children())
        _log.info("flare: rank %d: %s of %d steps requested (%s)", self.runtime.identity.rank,
                  "capture" if stacks else "detail", self.steps_left, request)
        self.runtime.request_detail()

    def stop(self, why: str) -> bool:
        """End a capture in progress; whether one was."""
        with self._lock:
            if self.steps_left <= 0:
                return False
            self.steps_left = 0
        if self._workers.active:  # (its samples are not the whole capture's: dropped)
            self._workers.stop()
            self._worker_steps = self._worker_step_ns = 0
        _log.info("flare: rank %d: capture stopped: %s", self.runtime.identity.rank, why)
        return True

    # ------------------------------------------------------------ steps (training thread)
    def install(self) -> None:
        self.runtime.add_step_listener(self)

    def uninstall(self) -> None:
        self.runtime.remove_step_listener(self)
        self._sampling.clear()
        if self._workers.active:
            self._workers.stop()

    def on_step_start(self, step: int, detail: bool) -> None:
        if self.steps_left <= 0 or not self.stacks:
            return
        self._target = threading.get_ident()
        self._target_native = threading.get_native_id()
        with self._lock:
            self._counts, self._samples = {}, 0
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flare-stack-sampler", daemon=True)
            self._thread.start()
        self._sampling.set()

    def on_step_end(self, step: int, detail: bool, span) -> None:
        if not self.stacks and self.steps_left > 0:  # detail only: count the step, ask the next
            with self._lock:
                self.steps_left = max(0, self.steps_left - 1)
            if self.steps_left > 0:
                self.runtime.request_detail()
            elif self.on_finished is not None:
                self.on_finished()
            return
        if not self._sampling.is_set():
            return
        self._sampling.clear()
        with self._lock:  # (stop() may end the capture from the agent's thread meanwhile)
            counts, samples = self._counts, self._samples
            self._counts, self._samples = {}, 0
            self.steps_left = max(0, self.steps_left - 1)
        if self.steps_left > 0:
            self.runtime.request_detail()  # the next step is captured too
        elif self.on_finished is not None:
            self.on_finished()
        recording = len(self._workers.pids)
        self._worker_step(span)
        if not samples:
            return
        leaves: dict[str, int] = {}
        for (thread, stack), count in counts.items():
            leaf = f"[thread {thread}] {stack[-1]}" if thread else stack[-1]
            leaves[leaf] = leaves.get(leaf, 0) + count
        top = sorted(leaves.items(), key=lambda item: -item[1])[:TOP_FRAMES]
        stacks = sorted(counts.items(), key=lambda item: -item[1])[:TOP_FRAMES]
        now = time.time_ns()
        self.runtime.emit_child(semconv.SPAN_CAPTURE, self.runtime.step_start_ns, now, {
            semconv.CAPTURE_FRAMES: [frame for frame, _ in top],
            semconv.CAPTURE_SAMPLES: [count for _, count in top],
            semconv.CAPTURE_STACKS: [";".join((f"[thread {thread}]", *stack) if thread else stack)
                                     for (thread, stack), _ in stacks],
            semconv.CAPTURE_STACK_SAMPLES: [count for _, count in stacks],
            semconv.CAPTURE_TOTAL: samples,
            semconv.CAPTURE_INTERVAL_MS: INTERVAL_S * 1e3,
            **({semconv.CAPTURE_WORKERS: recording} if recording else {}),
        })

    def _worker_step(self, span) -> None:
        """Count a captured step the workers were recorded over; WORKER_STOP_AHEAD_STEPS
        before the capture's last, ask their recordings to stop (they write their samples
        while the last steps run); at its last, read them into one child."""
        if not self._workers.active:
            return
        self._worker_steps += 1
        self._worker_step_ns += max(0, time.time_ns() - self.runtime.step_start_ns)
        if self.steps_left > 0:
            if self.steps_left <= WORKER_STOP_AHEAD_STEPS and not self._workers.stopping:
                self._workers.signal_stop()
            return
        pids = self._workers.pids
        stacks, per_worker = self._workers.stop(timeout_s=WORKER_STOP_S)
        steps, wall_ns = self._worker_steps, self._worker_step_ns
        self._worker_steps = self._worker_step_ns = 0
        if not pids or not wall_ns:
            return
        # (emitted with no line too: the diagnosis waits for it, see CAPTURE_WORKERS)
        # the steps the samples span: each worker's recorded time over the mean step
        window = max(per_worker * (1e9 / worker_capture.RATE_HZ) / (wall_ns / steps), 1e-3)
        leaves: dict[str, int] = {}
        for stack, count in stacks.items():
            leaf = worker_capture.WORKER_MARK + stack[-1]
            leaves[leaf] = leaves.get(leaf, 0) + count
        top = sorted(leaves.items(), key=lambda item: -item[1])[:TOP_FRAMES]
        ranked = sorted(stacks.items(), key=lambda item: -item[1])[:TOP_FRAMES]
        self.runtime.emit_child(semconv.SPAN_CAPTURE, self.runtime.step_start_ns, time.time_ns(), {
            semconv.CAPTURE_FRAMES: [frame for frame, _ in top],
            semconv.CAPTURE_SAMPLES: [count for _, count in top],
            semconv.CAPTURE_STACKS: [";".join((worker_capture.WORKER_MARK.strip(), *stack))
                                     for stack, _ in ranked],
            semconv.CAPTURE_STACK_SAMPLES: [count for _, count in ranked],
            semconv.CAPTURE_TOTAL: round(per_worker * len(pids)),
            semconv.CAPTURE_INTERVAL_MS: 1e3 / worker_capture.RATE_HZ,
            semconv.CAPTURE_PROCESS: semconv.CAPTURE_PROCESS_DATALOADER_WORKER,
            semconv.CAPTURE_PIDS: pids,
            semconv.CAPTURE_WINDOW_STEPS: round(window, 2),
        })

    # ------------------------------------------------------------ the sampler thread
    def _run(self) -> None:
        frames_of = sys._current_frames
        me = threading.get_ident()
        cpu_seen: dict[int, int] = {}  # other thread -> its CPU clock at the last sample
        names: dict[int, str] = {}
        clock = _ThreadActivity()
        # A sample is counted one interval late: whether the training thread was blocked
        # on the line it was sampled at is read from what it did over the intervals on
        # both sides of the sample (its active share, averaged): one side alone misreads
        # a line sampled just before or after it blocks.
        pending: tuple[tuple[str, ...] | None, list, float | None] | None = None
        while True:
            if not self._sampling.is_set():
                cpu_seen.clear()
                pending = None  # a step's last sample has no interval after it in the step
                self._sampling.wait()
                names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
                clock.reset()  # the gap between captured steps is no sampling interval
                # The rank's forked workers, at the capture's first step and every
                # WORKER_SCAN_STEPS after it (a new epoch's workers are added): a look at
                # /proc costs a few ms of this thread, not the training thread's.
                if self.steps_left > 1 and self._worker_scan <= 0:
                    self._worker_scan = WORKER_SCAN_STEPS
                    self._workers.start(worker_capture.forked_children())
                self._worker_scan -= 1
            target = self._target
            active = clock.active_share(self._target_native, target)
            if pending is not None:
                self._count(pending, active)
            frames = frames_of()
            own: tuple[str, ...] | None = None
            others = []
            for ident, frame in frames.items():
                if ident == target:
                    own = _user_stack(frame)
                elif ident != me and self._busy(ident, cpu_seen):
                    # another thread that burnt CPU since the last sample (a GIL holder,
                    # a busy logger): its own line, marked with its name
                    code = user_frame(frame)
                    if code is frame and _plumbing(frame):
                        continue  # library machinery (exporters, the profiler), not the user's
                    name = names.get(ident, str(ident))
                    if name.startswith(_OWN_THREADS):
                        continue
                    others.append((name, _user_stack(frame)))
            del frames
            pending = (own, others, active)
            time.sleep(INTERVAL_S)

    def _count(self, sample: tuple[tuple[str, ...] | None, list, float | None],
               after: float | None) -> None:
        own, keys, before = sample
        if own is not None:
            shares = [share for share in (before, after) if share is not None]
            if shares and sum(shares) / len(shares) < BLOCKED_BELOW:
                own = (*own[:-1], semconv.CAPTURE_WAITING + own[-1])
            keys = [("", own), *keys]
        if keys:
            with self._lock:
                for key in keys:
                    self._counts[key] = self._counts.get(key, 0) + 1
                self._samples += 1

    @staticmethod
    def _busy(ident: int, cpu_seen: dict[int, int]) -> bool:
        """Whether the thread burnt at least half a sampling interval of CPU since the
        last look (Linux thread CPU clocks; elsewhere other threads are not sampled)."""
        try:
            now = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
        except (AttributeError, OSError, OverflowError):
            return False
        before = cpu_seen.get(ident)
        cpu_seen[ident] = now
        return before is not None and now - before >= INTERVAL_S * 0.5e9


class _ThreadActivity:
    """The share of the wall time since the last look that the training thread was
    active: running, or runnable and waiting for a CPU (`/proc/self/task/TID/schedstat`:
    a thread descheduled on a busy host is not blocked). Without schedstat its CPU clock
    alone is read, and without that nothing is said (None: samples count as running)."""

    __slots__ = ("_fd", "_ident", "_last", "_native")

    def __init__(self) -> None:
        self._native: int | None = None
        self._ident: int | None = None
        self._fd: int | None = None
        self._last: tuple[int, int] | None = None  # (wall ns, ns run or wanting to run)

    def reset(self) -> None:
        self._last = None

    def active_share(self, native: int | None, ident: int | None) -> float | None:
        if native != self._native:
            self._switch(native, ident)
        active = self._active()
        if active is None:
            return None
        now = time.monotonic_ns()
        last, self._last = self._last, (now, active)
        if last is None or now <= last[0]:
            return None
        return (active - last[1]) / (now - last[0])

    def _switch(self, native: int | None, ident: int | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._native, self._ident, self._fd, self._last = native, ident, None, None
        if native is None:
            return
        try:
            self._fd = os.open(f"/proc/self/task/{native}/schedstat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = None

    def _active(self) -> int | None:
        if self._fd is not None:
            try:
                run, wait, _ = os.pread(self._fd, 64, 0).split()
                return int(run) + int(wait)
            except (OSError, ValueError):
                os.close(self._fd)
                self._fd = None
        if self._ident is None:
            return None
        try:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(self._ident))
        except (AttributeError, OSError, OverflowError):
            return None
