"""The text of `py-spy dump`, read: what a hang report's native frames and a DataLoader
worker's stack are made of. The rank writes the dump (flare.instrumentation.
native_stacks, loader_workers) and the diagnosis reads it (the hang detector), so the
one reader lives here, beside the names both sides share.
"""

from __future__ import annotations


def thread_frames(dump: str | None, thread: str | None) -> list[str]:
    """The frames of one thread (its name, or the first thread) in a py-spy dump,
    innermost first: `function (file:line)` for Python, `function (library)` for C."""
    if not dump:
        return []
    frames: list[str] = []
    inside = False
    for line in dump.splitlines():
        if line.startswith("Thread "):
            if inside:
                break
            inside = thread is None or f'"{thread}"' in line
            continue
        if inside and line.startswith("    ") and line.strip():
            frames.append(line.strip())
    return frames
