"""The follow service's local window of step spans (`flare diagnose --follow`).

Every rank's `train.step` spans — the bulk of what detectors read — are kept in a
local window and each poll fetches only the steps not yet complete (every rank has
moved past them), so a poll costs what arrived since the last one, not the whole job.
Rarer spans (hang dumps, errors, heartbeats) are still asked of the backend, with its
own filters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from flare.diagnostics.backends.arrow import ArrowJobData
from flare.diagnostics.columns import Table
from flare.diagnostics.model import JobData, SpanQuery, SpanReader
from flare.exporters.store import spans_table
from flare.wire import semconv as sc

# A rank that has not reported a step this many steps after the others is not waited
# for: its steps are closed anyway (rank_missing reports it).
MAX_OPEN_STEPS = 50


class IncrementalJobData(SpanReader):
    """A JobData whose step spans come from a local window refreshed incrementally.

    `refresh()` fetches the steps after the last complete one and keeps the last
    `max_steps` steps, fewer when ranks × steps would pass `max_rows` (memory stays
    bounded at thousands of ranks); everything a detector
    asks about `train.step` is answered from the window (through `ArrowJobData`, so
    answers match a one-shot diagnosis), anything else goes to the backend.
    """

    def __init__(self, inner: JobData, max_steps: int = 5000, max_rows: int = 2_000_000) -> None:
        self.inner = inner
        self.job = inner.job
        self.backend = inner.backend
        self.max_steps = max_steps
        self.max_rows = max_rows
        self._window: pa.Table | None = None
        self.complete_step = -1  # every step ≤ this is final in the window
        self.fetched_rows = 0
        self._local = ArrowJobData(self.job, self.backend, self._from_window)

    # -- refresh

    def refresh(self) -> int:
        """Fetch the open steps; returns the number of step spans fetched."""
        # The window is Arrow (concatenated, filtered, read by ArrowJobData).
        fresh = as_arrow(self.inner.spans([sc.SPAN_STEP], first_step=self.complete_step + 1))
        self.fetched_rows += fresh.num_rows
        if self._window is None:
            self._window = fresh
        else:
            kept = self._window.filter(
                pc.fill_null(pc.less_equal(self._window["step"], self.complete_step), False)
            )
            self._window = pa.concat_tables([kept, fresh.select(kept.column_names)])
        self._advance()
        return fresh.num_rows

    def _advance(self) -> None:
        window = self._window
        if window is None or window.num_rows == 0:
            return
        steps = window.filter(pc.and_(pc.is_valid(window["rank"]), pc.is_valid(window["step"])))
        if steps.num_rows == 0:
            return
        per_rank = steps.group_by("rank").aggregate([("step", "max")])["step_max"]
        newest = pc.max(per_rank).as_py()
        laggard = pc.min(per_rank).as_py()
        # A step is complete once every rank has reported a later one.
        self.complete_step = max(self.complete_step, min(laggard - 1, newest - 1),
                                 newest - MAX_OPEN_STEPS)
        # The window holds at most `max_rows` step spans: fewer steps for more ranks.
        ranks = max(1, len(per_rank))
        oldest_kept = newest - max(MAX_OPEN_STEPS * 2, min(self.max_steps, self.max_rows // ranks))
        if pc.min(steps["step"]).as_py() < oldest_kept:
            self._window = window.filter(
                pc.fill_null(pc.greater_equal(window["step"], oldest_kept), False)
            )

    def _from_window(
        self, names: Sequence[str], first_step: int | None, last_step: int | None,
        ranks: Sequence[int] | None,
    ) -> pa.Table:
        return self._window if self._window is not None else spans_table({})

    # -- JobData

    def query(self, q: SpanQuery) -> Table:
        return (self._local if q.names == (sc.SPAN_STEP,) else self.inner).query(q)

    def step_summary(self, attributes: Sequence[str] = (), step_bucket: int = 1,
                     first_step: int | None = None, last_step: int | None = None) -> Table:
        return self._local.step_summary(attributes, step_bucket, first_step, last_step)

    def steps_range(self) -> tuple[int, int] | None:
        return self._local.steps_range()

    def ranks(self) -> list[int]:
        return self._local.ranks()

    def world_size(self) -> int | None:
        return self._local.world_size()

    def rank_activity(self, names: Sequence[str]) -> Table:
        source = self._local if list(names) == [sc.SPAN_STEP] else self.inner
        return source.rank_activity(names)

    def count(self, names: Sequence[str]) -> int:
        return self.spans(names, columns=["span_id"]).num_rows

    def __getattr__(self, name: str) -> Any:
        # A JobData method added after this class was written is answered by the
        # backend itself: correct, only not incremental.
        return getattr(self.inner, name)

    @property
    def window_rows(self) -> int:
        return 0 if self._window is None else self._window.num_rows


def as_arrow(table: Table | pa.Table) -> pa.Table:
    return table.to_arrow() if isinstance(table, Table) else table
