"""A JobData that answers repeated questions once, for one diagnosis.

Detectors ask the backend for the same aggregates (the step summary above all);
`CachedJobData` answers repeated questions once, so a diagnosis costs one pass
over the job's step spans whatever the number of detectors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flare.diagnostics.columns import Table
from flare.diagnostics.model import JobData, SpanQuery, SpanReader, job_source


class CachedJobData(SpanReader):
    """A JobData that remembers answers (keyed by the call's arguments)."""

    def __init__(self, inner: JobData) -> None:
        self._inner = inner
        self.job = inner.job
        self.backend = inner.backend
        self._cache: dict[tuple, object] = {}

    def _cached(self, name: str, *args: object) -> object:
        key = (name, *(tuple(a) if isinstance(a, (list, tuple)) else a for a in args))
        if key not in self._cache:
            self._cache[key] = getattr(self._inner, name)(*args)
        return self._cache[key]

    def query(self, q: SpanQuery) -> Table:
        return self._cached("query", q)

    def step_summary(self, attributes: Sequence[str] = (), step_bucket: int = 1,
                     first_step: int | None = None, last_step: int | None = None) -> Table:
        return self._cached("step_summary", tuple(attributes), step_bucket, first_step, last_step)

    def steps_range(self) -> tuple[int, int] | None:
        numbers = self._step_numbers()
        return numbers[0] if numbers is not None else self._cached("steps_range")

    def _step_numbers(self) -> tuple[tuple[int, int] | None, int] | None:
        """Range and distinct count in one query, where the backend has it (ClickHouse:
        each is a scan of the job's step spans)."""
        if not callable(getattr(self._inner, "step_numbers", None)):
            return None
        return self._cached("step_numbers")

    def memo(self, key: tuple, build: Callable[[], object]) -> object:
        """A value derived from the job (the rank × step frame), built once per
        diagnosis for every detector that asks."""
        key = ("memo", *key)
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def step_count(self) -> int | None:
        numbers = self._step_numbers()
        if numbers is not None:
            return numbers[1]
        if not callable(getattr(self._inner, "step_count", None)):
            return None
        return self._cached("step_count")

    def ranks(self) -> list[int]:
        return self._cached("ranks")

    def world_size(self) -> int | None:
        return self._cached("world_size")

    def count(self, names: Sequence[str]) -> int:
        return self._cached("count", tuple(names))

    def rank_activity(self, names: Sequence[str]) -> Table:
        return self._cached("rank_activity", tuple(names))

    def rank_resources(self, names: Sequence[str]) -> Table:
        method = getattr(self._inner, "rank_resources", None)
        if not callable(method):
            return self._cached("spans", tuple(names), (), None, None, None, ("rank", "resource"),
                                None, None)
        return self._cached("rank_resources", tuple(names))

    def source(self) -> str | None:
        if ("source",) not in self._cache:
            self._cache[("source",)] = job_source(self._inner)
        return self._cache[("source",)]
