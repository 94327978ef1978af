"""The records a step leaves: its always-on totals (`StepTotals`, one `PgTotals` per
process group), filled by the hooks while it runs, and what the training thread captures
at its end (`StepRecord`), for the span built then or later by the finisher thread
(`step_finisher.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(slots=True)
class PgTotals:
    wait_ns: int = 0
    python_count: int = 0
    bytes: int = 0
    device_ns: int = 0  # CUDA only: device time of collectives that completed this step
    # Sequence numbers covered by calls Flare timed (a wrapped call may advance it more
    # than once), and whether C++-issued ones were accounted (DDP's reducer: its wait is
    # the tail of backward): what is left of the group's advance was not seen at all.
    covered: int = 0
    p2p_count: int = 0
    cpp_accounted: bool = False


@dataclass(slots=True)
class StepTotals:
    """Always-on counters of one step; cheap to update from any hook."""

    dataloader_ns: int = 0
    dataloader_count: int = 0
    gc_ns: int = 0
    gc_count: int = 0
    pycall_ns: int = 0
    pycall_count: int = 0
    # the framework's phases (python_calls.PHASES): their own time, outside compute
    checkpoint_ns: int = 0
    evaluation_ns: int = 0
    backward_ns: int = 0
    pg: dict[str, PgTotals] = field(default_factory=dict)
    # (function, args): bookkeeping a hook left for when the step's span is built, off
    # the training thread where possible; each runs as function(totals, *args) first.
    pending: list = field(default_factory=list)
    # The process groups' sequence numbers (name -> number) at the step's start and
    # end, read by the runtime (`Runtime.sequence_reader`); a step that begins where
    # the last one ended shares that read.
    seq_start: dict | None = None
    seq_end: dict | None = None
    # Detail steps only, created when first needed: (pg name, start, end) of the
    # Python-issued collectives, and (start, graph done, end) of the backwards.
    python_windows: list | None = None
    backward_windows: list | None = None

    def pg_totals(self, pg_name: str) -> PgTotals:
        totals = self.pg.get(pg_name)
        if totals is None:
            totals = self.pg[pg_name] = PgTotals()
        return totals


class StepRecord(NamedTuple):
    """What the training thread captures of a step at its end, for the span built then
    or later by the finisher."""

    step: int
    start_ns: int
    end_ns: int
    totals: StepTotals
    cpu_start: tuple  # process and thread CPU clocks at the step's start
    cpu_end: tuple  # ... and at its end
    detail: bool
