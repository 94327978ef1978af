"""The user's line in a stack dump: `path:line in function` of the innermost frame
that belongs to the user's program (not Python, torch, or Flare itself).

Reads both Python formats: tracebacks (`File "p", line N, in f`, innermost last)
and faulthandler / py-spy style dumps (`File "p", line N in f`, innermost first
when the block says "most recent call first"). In an all-threads dump the main
thread's block is preferred: that is where the training loop runs.
"""

from __future__ import annotations

import re

_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in ([^\s(]+)')
_THREAD_HEADER = re.compile(r"^[ \t]*(?:#[ \t]*)?(?:Thread|Current thread|Stack for thread)\b.*$", re.M)
_NOT_USER = ("site-packages", "dist-packages", "/lib/python3", "<frozen", "/flare/instrumentation/", "/flare/wire/",
             "/torch/", "/opentelemetry/", "threading.py", "<string>")


def frames(text: str) -> list[tuple[str, int, str]]:
    """(path, line, function) innermost first."""
    found = [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME.finditer(text)]
    innermost_first = "most recent call first" in text
    return found if innermost_first else list(reversed(found))


def main_thread_block(text: str) -> str:
    headers = list(_THREAD_HEADER.finditer(text))
    if not headers:
        return text
    blocks = []
    for i, header in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        blocks.append((header.group(0), text[header.start():end]))
    for title, block in blocks:
        if "MainThread" in title or "Current thread" in title or "main" in title.lower().split():
            return block
    return blocks[0][1]


def user_callsite(text: str | None) -> str | None:
    if not text:
        return None
    block = main_thread_block(text)
    stack = frames(block) or frames(text)
    for path, line, function in stack:
        if not any(marker in path for marker in _NOT_USER):
            return f"{path}:{line} in {function}"
    if stack:
        path, line, function = stack[0]
        return f"{path}:{line} in {function}"
    return None


def user_frames(text: str | None, limit: int = 6) -> list[str]:
    """A short innermost-first list of the main thread's user frames, for evidence."""
    if not text:
        return []
    stack = frames(main_thread_block(text)) or frames(text)
    return [f"{p}:{n} in {f}" for p, n, f in stack if not any(m in p for m in _NOT_USER)][:limit]
