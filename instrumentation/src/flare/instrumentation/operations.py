"""What each thread of a rank is blocked in right now, for the hang watchdog.

The hooks push an `Operation` around a collective, a DataLoader wait, a backward pass or
a hot Python call and pop it when it returns; each thread has a stack of its own (a
collective inside a hot call is the innermost). The watchdog reads the innermost
operation of every thread (`in_flight`) and reports one that has lasted past the hang
limit. A hook on a hot path keeps the list `thread_stack()` returns and appends and pops
on it directly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(slots=True)
class Operation:
    """Something a thread is blocked in; what the watchdog reports when it is stuck."""

    name: str
    start_ns: int
    attributes: dict
    frame: object = None  # the caller's frame, formatted into a call site only if needed
    reported: bool = False


class Operations:
    """One stack of operations in flight per thread."""

    def __init__(self) -> None:
        self._stacks: dict[int, list[Operation]] = {}
        self._lock = threading.Lock()  # new threads' stacks against the watchdog's reads

    def push(self, name: str, start_ns: int, attributes: dict, frame=None) -> Operation:
        op = Operation(name, start_ns, attributes, frame)
        self.thread_stack().append(op)
        return op

    def thread_stack(self) -> list:
        """The calling thread's stack of operations in flight, for a hook that pushes
        and pops its own (append an Operation; pop it if it is still last, else pop)."""
        ident = threading.get_ident()
        stack = self._stacks.get(ident)
        if stack is None:
            with self._lock:
                stack = self._stacks.setdefault(ident, [])
        return stack

    def pop(self, op: Operation) -> None:
        stack = self._stacks.get(threading.get_ident())
        if stack and stack[-1] is op:
            stack.pop()
        elif stack and op in stack:
            stack.remove(op)

    def in_flight(self) -> list[tuple[int, Operation]]:
        """(thread id, innermost operation) for every thread blocked in something."""
        with self._lock:
            items = list(self._stacks.items())
        return [(ident, stack[-1]) for ident, stack in items if stack]
