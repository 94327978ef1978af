"""Call sites and stacks: the user's line that issued an operation, and every thread's
Python stack for hang reports."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback

from opentelemetry import trace as _otel_trace

import flare.wire

# Frames in these trees are plumbing, not the user's code: a call site skips them
# (Flare's hooks, the names and wire they call on the training thread, OpenTelemetry).
_PLUMBING_DIRS: tuple[str, ...] = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(flare.wire.__file__)),
    os.path.dirname(os.path.dirname(os.path.abspath(_otel_trace.__file__))),
)


def add_plumbing_dir(package_file: str) -> None:
    """Treat the package containing `package_file` (e.g. torch.__file__) as plumbing."""
    global _PLUMBING_DIRS
    path = os.path.dirname(os.path.abspath(package_file))
    if path not in _PLUMBING_DIRS:
        _PLUMBING_DIRS = (*_PLUMBING_DIRS, path)


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _is_plumbing(filename: str) -> bool:
    if filename.startswith(_PLUMBING_DIRS):
        return True
    # the standard library (threading, queue, selectors) but not site-packages under it
    return filename.startswith(_STDLIB) and "site-packages" not in filename


def user_frame(frame):
    """The innermost frame, starting at `frame`, outside torch, Flare and the standard
    library; the innermost frame itself when every frame is plumbing."""
    innermost = frame
    while frame is not None and _is_plumbing(frame.f_code.co_filename):
        frame = frame.f_back
    return frame if frame is not None else innermost


def caller_site(depth: int = 2) -> tuple[str, int, str] | None:
    """(file, line, function) of the user code calling into a wrapper; cheap enough to
    run on every collective (a few attribute loads per skipped frame)."""
    frame = user_frame(sys._getframe(depth))
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def format_site(site: tuple[str, int, str] | None) -> str | None:
    if site is None:
        return None
    return f"{site[0]}:{site[1]} in {site[2]}"


def frame_site(frame) -> str | None:
    """Innermost user frame of a live frame (used on a blocked thread's stack)."""
    frame = user_frame(frame)
    if frame is None:
        return None
    return format_site((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))


def traceback_site(tb) -> str | None:
    """Where an exception was raised: the innermost frame of its traceback."""
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"


def all_thread_stacks(skip_ident: int | None = None) -> str:
    """Every thread's Python stack as text (the watchdog's own thread left out)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        header = f'Thread "{names.get(ident, "?")}" (id {ident}), most recent call last:'
        parts.append(header + "\n" + "".join(traceback.format_stack(frame)).rstrip())
    return "\n\n".join(parts)
