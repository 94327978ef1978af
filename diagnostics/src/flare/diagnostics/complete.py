"""The steps every rank has reported: what a live diagnosis pass may compare across ranks.

Ranks export their spans in batches (each on its own clock), so while a job runs the
store holds more steps of some ranks than of others. A cross-rank comparison over a
step that one rank has not reported yet compares the others only: the least collective
wait of the step is then a waiting rank's (not the late rank's own), which reads as a
slower fabric (a `collective_slow` that the final pass, with every span in, does not
report). `CompleteSteps` caps what detectors see of step-aligned spans (`train.step`,
`collective.*`) at the last step every reporting rank has sent; everything else (hangs,
errors and failed steps, heartbeats, which rank went quiet) is passed through whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flare.diagnostics.model import JobData, SpanQuery, SpanReader
from flare.wire import semconv as sc


def _step_aligned(names: Sequence[str]) -> bool:
    return bool(names) and all(
        name == sc.SPAN_STEP or name.startswith(sc.SPAN_COLLECTIVE_PREFIX) for name in names)


class CompleteSteps(SpanReader):
    """A JobData view that ends at `last_step` for step-aligned spans."""

    def __init__(self, inner: JobData, last_step: int) -> None:
        self._inner = inner
        self.job = inner.job
        self.backend = inner.backend
        self.last_step = last_step

    @classmethod
    def of(cls, inner: JobData) -> JobData:
        """`inner` capped at the last step all its reporting ranks have sent (itself
        when no rank has sent a step yet)."""
        activity = inner.rank_activity([sc.SPAN_STEP])
        last = [step for step in activity.column("last_step").to_pylist() if step is not None]
        return cls(inner, min(last)) if last else inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _cap(self, last_step: int | None) -> int:
        return self.last_step if last_step is None else min(last_step, self.last_step)

    def query(self, q: SpanQuery):
        if _step_aligned(q.names) and q.status_code is None:  # failures are read whole
            q = dataclasses.replace(q, last_step=self._cap(q.last_step))
        return self._inner.query(q)

    def step_summary(self, attributes: Sequence[str] = (), step_bucket: int = 1,
                     first_step: int | None = None, last_step: int | None = None):
        return self._inner.step_summary(attributes, step_bucket, first_step,
                                        self._cap(last_step))

    def steps_range(self) -> tuple[int, int] | None:
        span = self._inner.steps_range()
        if span is None or span[0] > self.last_step:
            return None
        return span[0], min(span[1], self.last_step)

    def count(self, names: Sequence[str]) -> int:
        if _step_aligned(names):
            return self.spans(names, columns=["span_id"]).num_rows
        return self._inner.count(names)
