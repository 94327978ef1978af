"""`JobData` for backends that can only hand over raw spans (Jaeger, Tempo, Kineto).

An adapter supplies one function, `fetch(names, first_step, last_step, ranks)`,
returning spans in the store's `SPAN_SCHEMA` (filters pushed down as far as its API
allows; names ending in '*' are prefixes). Everything else — exact filtering,
attribute extraction, the per-step summary — is done here in Arrow, so every backend
gives detectors the same tables as the store does (converted to the detectors'
`columns.Table` on the way out).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from flare.diagnostics.backends.attributes import BITMASK_ATTRIBUTES, python_values
from flare.diagnostics.columns import Table
from flare.diagnostics.model import SpanQuery, SpanReader
from flare.exporters.store import SPAN_SCHEMA
from flare.wire import semconv as sc

Fetch = Callable[[Sequence[str], "int | None", "int | None", "Sequence[int] | None"], pa.Table]


class ArrowJobData(SpanReader):
    def __init__(self, job: str, backend_name: str, fetch: Fetch) -> None:
        self.job = job
        self.backend = backend_name
        self._fetch = fetch

    def query(self, q: SpanQuery) -> Table:
        return Table.from_arrow(self._arrow(q))

    def _arrow(self, q: SpanQuery) -> pa.Table:
        names, attributes, first_step, last_step = q.names, q.attributes, q.first_step, q.last_step
        ranks, columns, limit, status_code = q.ranks, q.columns, q.limit, q.status_code
        table = self._fetch(list(names), first_step, last_step, ranks)
        if isinstance(table, Table):  # e.g. spans read from the store
            table = table.to_arrow()
        table = _conform(table)
        mask = _name_mask(table, names)
        if first_step is not None:
            mask = pc.and_(mask, pc.fill_null(pc.greater_equal(table["step"], first_step), False))
        if last_step is not None:
            mask = pc.and_(mask, pc.fill_null(pc.less_equal(table["step"], last_step), False))
        if ranks is not None:
            mask = pc.and_(mask, pc.fill_null(pc.is_in(table["rank"], pa.array(list(ranks), pa.int32())), False))
        if status_code is not None:
            mask = pc.and_(mask, pc.fill_null(pc.equal(table["status_code"], status_code), False))
        table = table.filter(mask).sort_by([("start_ns", "ascending")])
        if limit is not None:
            table = table.slice(0, int(limit))
        texts = table.column("attributes").to_pylist()
        if columns is not None:
            table = table.select(list(columns))
        for key in attributes:
            table = table.append_column(key, python_values(texts, key))
        return table

    def step_summary(
        self,
        attributes: Sequence[str] = (),
        step_bucket: int = 1,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> Table:
        steps = self._arrow(SpanQuery([sc.SPAN_STEP], attributes, first_step, last_step))
        steps = steps.filter(pc.and_(pc.is_valid(steps["rank"]), pc.is_valid(steps["step"])))
        bucket = max(1, int(step_bucket))
        duration_ms = pc.divide(pc.cast(steps["duration_ns"], pa.float64()), 1e6)
        base = pa.table({
            "rank": steps["rank"],
            "raw_step": steps["step"],
            "start_ns": steps["start_ns"],
            "end_ns": steps["end_ns"],
            "duration_ms": duration_ms,
            **{a: pc.cast(steps[a], pa.float64()) for a in attributes if a not in BITMASK_ATTRIBUTES},
            **{f"{a}_bits": pc.cast(steps[a], pa.int64()) for a in attributes if a in BITMASK_ATTRIBUTES},
        })
        # As the store does: bucket directly (a duplicate delivery repeats its values).
        bucketed = pc.multiply(pc.divide(base["raw_step"], bucket), bucket)
        base = base.append_column("step", bucketed)
        out = base.group_by(["rank", "step"]).aggregate(
            [("raw_step", "count"), ("raw_step", "min"), ("raw_step", "max"),
             ("start_ns", "min"), ("end_ns", "max"),
             ("duration_ms", "mean")]
            + [(a, "mean") for a in attributes if a not in BITMASK_ATTRIBUTES]
            + [(f"{a}_bits", "list") for a in attributes if a in BITMASK_ATTRIBUTES]
        )
        table = pa.table({
            "rank": pc.cast(out["rank"], pa.int32()),
            "step": pc.cast(out["step"], pa.int64()),
            "steps": pc.cast(out["raw_step_count"], pa.int64()),
            "first_step": pc.cast(out["raw_step_min"], pa.int64()),
            "last_step": pc.cast(out["raw_step_max"], pa.int64()),
            "start_ns": out["start_ns_min"],
            "end_ns": out["end_ns_max"],
            "duration_ms": out["duration_ms_mean"],
            **{a: pc.cast(out[f"{a}_mean"] if a not in BITMASK_ATTRIBUTES
                          else _bit_or(out[f"{a}_bits_list"]), pa.float32())
               for a in attributes},
        })
        return Table.from_arrow(table.sort_by([("step", "ascending"), ("rank", "ascending")]))

    def steps_range(self) -> tuple[int, int] | None:
        steps = self._arrow(SpanQuery([sc.SPAN_STEP], columns=["step"]))
        if steps.num_rows == 0 or steps["step"].null_count == steps.num_rows:
            return None
        lo, hi = pc.min_max(steps["step"]).values()
        return int(lo.as_py()), int(hi.as_py())

    def ranks(self) -> list[int]:
        steps = self._arrow(SpanQuery([sc.SPAN_STEP], columns=["rank"]))
        return sorted(int(r) for r in pc.unique(steps["rank"]).to_pylist() if r is not None)

    def world_size(self) -> int | None:
        steps = self._arrow(SpanQuery([sc.SPAN_STEP], columns=["rank", "resource"], limit=10000))
        sizes = [
            json.loads(text).get(sc.WORLD_SIZE) for text in steps["resource"].to_pylist() if text
        ]
        sizes = [int(s) for s in sizes if s is not None]
        if sizes:
            return max(sizes)
        ranks = [r for r in steps["rank"].to_pylist() if r is not None]
        return max(ranks) + 1 if ranks else None

    def source(self) -> str | None:
        steps = self._arrow(SpanQuery([sc.SPAN_STEP, sc.SPAN_KERNEL], columns=["resource"], limit=1))
        texts = [t for t in steps["resource"].to_pylist() if t]
        return json.loads(texts[0]).get(sc.JOB_SOURCE) if texts else None

    def rank_activity(self, names: Sequence[str]) -> Table:
        spans = self._arrow(SpanQuery(names, columns=["rank", "start_ns", "end_ns", "step"]))
        spans = spans.filter(pc.is_valid(spans["rank"]))
        out = spans.group_by("rank").aggregate(
            [("rank", "count"), ("start_ns", "min"), ("end_ns", "max"), ("step", "max")])
        return Table.from_arrow(pa.table({
            "rank": pc.cast(out["rank"], pa.int32()), "spans": out["rank_count"],
            "first_start_ns": out["start_ns_min"], "last_end_ns": out["end_ns_max"],
            "last_step": pc.cast(out["step_max"], pa.int64()),
        }).sort_by("rank"))

    def count(self, names: Sequence[str]) -> int:
        return self._arrow(SpanQuery(names, columns=["span_id"])).num_rows


def _conform(table: pa.Table) -> pa.Table:
    """Reorder/cast to SPAN_SCHEMA; an adapter that omits a column gets NULLs."""
    arrays = []
    for field in SPAN_SCHEMA:
        if field.name in table.column_names:
            arrays.append(table[field.name].cast(field.type))
        else:
            arrays.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=SPAN_SCHEMA)


def _name_mask(table: pa.Table, names: Sequence[str]) -> pa.ChunkedArray:
    exact = [n for n in names if not n.endswith("*")]
    mask = pc.is_in(table["name"], pa.array(exact, pa.string()))
    for name in names:
        if name.endswith("*"):
            mask = pc.or_(mask, pc.starts_with(table["name"], name[:-1]))
    return pc.fill_null(mask, False)


def _bit_or(groups: pa.ChunkedArray) -> pa.Array:
    """Per group, the OR of its non-null masks (NaN when it has none), as the store's bit_or."""
    out = []
    for values in groups.to_pylist():
        present = [int(v) for v in values or () if v is not None]
        mask = 0
        for value in present:
            mask |= value
        out.append(float(mask) if present else None)
    return pa.array(out, type=pa.float64())
