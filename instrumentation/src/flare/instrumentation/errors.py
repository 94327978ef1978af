"""Errors: uncaught exceptions and fatal signals mark the step in progress ERROR with an
exception event and the call site, and flush before the process goes.

Signals: a Python handler runs only when the main thread next executes bytecode, which
never happens while it is blocked in a gloo/NCCL wait -- exactly when torchrun sends
SIGTERM to the survivors of a crashed rank. So the C-level handler also writes to a
wakeup fd watched by a small thread that records and flushes at once and, if the
previous disposition was the default, ends the process as the signal would have.
SIGSEGV and friends go to `faulthandler` (native-safe, writes all stacks to stderr).

Ctrl-C (SIGINT) is no error, but the same thread hands the queued spans over at once:
a launcher may SIGKILL its ranks on Ctrl-C (Lightning's rank 0 does, once its own
teardown is done), and a rank's last seconds would go with it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback

from flare.instrumentation.callsite import frame_site, traceback_site
from flare.instrumentation.runtime import Runtime
from flare.wire import semconv

_log = logging.getLogger(__name__)
FATAL_SIGNALS = (signal.SIGTERM, signal.SIGABRT)
FLUSH_TIMEOUT_MS = 5000
MAIN_THREAD_GRACE_S = 1.0


class ErrorHooks:
    def __init__(self, runtime: Runtime, flush):
        self.runtime = runtime
        self.flush = flush
        self._previous_excepthook = None
        self._previous_thread_hook = None
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._wakeup_pipe: tuple[int, int] | None = None
        self._signal_thread: threading.Thread | None = None
        self._recorded_signals: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._enabled_faulthandler = False
        self._interrupt_flush: threading.Thread | None = None

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._previous_thread_hook = threading.excepthook
        threading.excepthook = self._thread_excepthook
        if threading.current_thread() is threading.main_thread():
            self._install_signals()
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
            self._enabled_faulthandler = True

    def uninstall(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._previous_thread_hook
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous_handlers.items():
                if signal.getsignal(signum) == self._signal_handler:
                    signal.signal(signum, previous)
            if self._wakeup_pipe is not None:
                signal.set_wakeup_fd(self._previous_wakeup_fd)
        self._previous_handlers.clear()
        if self._wakeup_pipe is not None:
            _read_fd, write_fd = self._wakeup_pipe
            self._wakeup_pipe = None
            os.close(write_fd)  # wakes the signal thread, which closes read_fd
        if self._enabled_faulthandler:
            faulthandler.disable()
            self._enabled_faulthandler = False

    def _install_signals(self) -> None:
        for signum in FATAL_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN or previous is None:
                continue  # the user ignores it (or it is set outside Python): leave it
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._signal_handler)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return
        if previous_fd != -1:  # someone (asyncio) owns the wakeup fd: give it back
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._previous_wakeup_fd = previous_fd
        self._wakeup_pipe = (read_fd, write_fd)
        self._signal_thread = threading.Thread(target=self._watch_signals, args=(read_fd,),
                                               name="flare-signals", daemon=True)
        self._signal_thread.start()

    # ------------------------------------------------------------------ exceptions
    def _excepthook(self, exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt) and os.environ.get(semconv.ENV_RUN_PID):
            # Ctrl-C under flare run: its report is what the user came for, not a
            # traceback per rank above it (four ranks' made ~100 lines). One line each
            # (torch.distributed's own hook, which calls this one, prefixes it [rankN]).
            inner = tb
            while inner is not None and inner.tb_next is not None:
                inner = inner.tb_next
            site = (frame_site(inner.tb_frame) if inner is not None else None) or traceback_site(tb)
            sys.stderr.write(f"flare: rank {self.runtime.identity.rank} stopped by Ctrl-C"
                             f"{f' at {site}' if site else ''}\n")
            return
        try:
            if not issubclass(exc_type, KeyboardInterrupt):
                self.record_exception(exc, tb)
        finally:
            (self._previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)

    def _thread_excepthook(self, args) -> None:
        try:
            if args.exc_type is not SystemExit and args.exc_value is not None:
                self._record_thread_exception(args)
        finally:
            (self._previous_thread_hook or threading.__excepthook__)(args)

    def record_exception(self, exc: BaseException, tb) -> None:
        runtime = self.runtime
        if not runtime.enabled:
            return
        runtime.fail_step(exc, f"{type(exc).__name__}: {exc}", traceback_site(tb))
        self.flush(FLUSH_TIMEOUT_MS)

    def _record_thread_exception(self, args) -> None:
        runtime = self.runtime
        if not runtime.enabled:
            return
        attributes = {semconv.STEP: runtime.step_number,
                      semconv.CODE_CALLSITE: traceback_site(args.exc_traceback) or "?",
                      semconv.HANG_THREAD: getattr(args.thread, "name", "?")}
        attributes.update(runtime.span_attributes)
        span = runtime.tracer.start_span(semconv.SPAN_ERROR, context=runtime.step_context,
                                         attributes=attributes)
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{args.exc_type.__name__} in thread"))
        span.record_exception(args.exc_value, escaped=True)
        span.end()
        self.flush(FLUSH_TIMEOUT_MS)

    # ------------------------------------------------------------------ signals
    def record_signal(self, signum: int) -> bool:
        """Record a fatal signal once; True if this call recorded it. A second caller
        (the main thread's handler and the flare-signals thread both see the signal)
        waits until the first one has flushed: otherwise the handler re-raises the
        signal and the process dies with the error span still in the queue."""
        with self._lock:
            done = self._recorded_signals.get(signum)
            first = done is None
            if first:
                done = self._recorded_signals[signum] = threading.Event()
        if not first:
            done.wait(FLUSH_TIMEOUT_MS / 1000 + 1.0)
            return False
        try:
            self._record_signal(signum)
        finally:
            done.set()
        return True

    def _record_signal(self, signum: int) -> None:
        runtime = self.runtime
        if not runtime.enabled:
            return
        name = signal.Signals(signum).name
        main_frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(main_frame)) if main_frame else ""
        runtime.fail_step(None, f"killed by {name}", frame_site(main_frame) if main_frame
                          else None, {semconv.ERROR_SIGNAL: name,
                                      semconv.ERROR_STACKTRACE: stack,
                                      semconv.ERROR_TYPE: name})
        self.flush(FLUSH_TIMEOUT_MS)

    def _signal_handler(self, signum, frame) -> None:
        self.record_signal(signum)
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _watch_signals(self, read_fd: int) -> None:
        try:
            while True:
                select.select([read_fd], [], [])
                data = os.read(read_fd, 64)
                if not data:
                    return  # uninstall closed the pipe
                for signum in set(data):
                    if signum in self._previous_handlers:
                        self._on_signal_in_thread(signum)
                    elif signum == signal.SIGINT:
                        self._flush_on_interrupt()
        except OSError:
            return
        finally:
            try:
                os.close(read_fd)
            except OSError:
                pass

    def _flush_on_interrupt(self) -> None:
        """Hand the spans queued so far over, off this thread (a second signal must
        still be seen); one flush at a time."""
        with self._lock:
            if self._interrupt_flush is not None and self._interrupt_flush.is_alive():
                return
            self._interrupt_flush = threading.Thread(target=self._flush_quietly, name="flare-interrupt-flush",
                                                     daemon=True)
            self._interrupt_flush.start()

    def _flush_quietly(self) -> None:
        if not self.runtime.enabled:
            return
        try:
            self.flush(FLUSH_TIMEOUT_MS)
        except Exception as error:  # the job's Ctrl-C must go on whatever the export does
            _log.debug("flare: the flush on Ctrl-C failed: %r", error)

    def _on_signal_in_thread(self, signum: int) -> None:
        self.record_signal(signum)
        if self._previous_handlers.get(signum) is not signal.SIG_DFL:
            return  # a Python handler of the user's must run; only the main thread can
        deadline = time.monotonic() + MAIN_THREAD_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.05)  # the main thread may still run our handler (and die by it)
        os._exit(128 + signum)  # main thread stuck in C++: die as the signal would
