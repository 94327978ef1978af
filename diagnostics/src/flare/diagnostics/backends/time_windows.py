"""Time windows for backends that search by time while diagnosis asks by step
(Jaeger, Tempo): what time each step happened at, learnt from the spans already fetched,
and a window split in two when a search comes back full."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa

# Allowance for clocks of different nodes disagreeing (NTP keeps them within ~1 s).
_SKEW_NS = 10_000_000_000


class StepClock:
    """What time each step happened at, learnt from the spans already fetched.

    Jaeger and Tempo search by time, diagnosis asks by step; once a step has been seen,
    later questions about nearby steps get a narrow time window instead of the whole
    look-back period.
    """

    def __init__(self) -> None:
        self._start_ns: dict[int, int] = {}

    def learn(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        for step, start in zip(
            table.column("step").to_pylist(), table.column("start_ns").to_pylist(), strict=True
        ):
            if step is not None and start is not None:
                known = self._start_ns.get(step)
                if known is None or start < known:
                    self._start_ns[step] = start

    def window(
        self, first_step: int | None, last_step: int | None, default: tuple[int, int]
    ) -> tuple[int, int]:
        """A [min, max] start-time window (ns) certain to hold steps first..last."""
        lo, hi = default
        if not self._start_ns:
            return lo, hi
        steps = sorted(self._start_ns)
        if first_step is not None:
            before = [s for s in steps if s <= first_step]
            if before:
                # Spans of a step start no earlier than the skew allowance before any
                # rank's step span seen for an earlier step (clocks of nodes differ).
                lo = max(lo, self._start_ns[before[-1]] - _SKEW_NS)
        if last_step is not None:
            after = [s for s in steps if s > last_step]
            if after:
                hi = min(hi, self._start_ns[after[0]] + _SKEW_NS)
        return lo, max(hi, lo + 1_000_000)


def rfc3339(ns: int) -> str:
    seconds, rest = divmod(ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{rest:09d}Z"


def split_window(lo: int, hi: int) -> list[tuple[int, int]]:
    mid = lo + (hi - lo) // 2
    return [(lo, mid), (mid, hi)]
