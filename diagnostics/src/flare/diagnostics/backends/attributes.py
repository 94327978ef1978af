"""Typed extraction of span attributes: which Arrow type each attribute key has.

Stores keep attributes as JSON text; detectors want typed columns. The type comes
from the semantic conventions (a duration in ms is a double, a step an integer, the
per-process-group arrays are lists); keys nobody registered come back as text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa

from flare.instrumentation import semconv as sc

_DOUBLE = pa.float64()
_INT = pa.int64()
_BOOL = pa.bool_()
_TEXT = pa.string()

# Bit masks: a bucket of steps keeps the OR of its values (a mean of masks means nothing).
# `step_summary` backends aggregate these with bit_or instead of avg.
BITMASK_ATTRIBUTES = frozenset({sc.STEP_GPU_THROTTLE})

_TYPES: dict[str, pa.DataType] = {
    sc.STEP: _INT,
    sc.STEP_DATALOADER_MS: _DOUBLE,
    sc.STEP_COLLECTIVE_WAIT_MS: _DOUBLE,
    sc.STEP_GC_MS: _DOUBLE,
    sc.STEP_PYCALL_MS: _DOUBLE,
    sc.STEP_COMPUTE_MS: _DOUBLE,
    sc.STEP_OTHER_THREADS_CPU_MS: _DOUBLE,
    sc.STEP_DATALOADER_COUNT: _INT,
    sc.STEP_COLLECTIVE_COUNT: _INT,
    sc.STEP_COLLECTIVE_BYTES: _INT,
    sc.STEP_GC_COUNT: _INT,
    sc.STEP_PYCALL_COUNT: _INT,
    sc.STEP_DETAIL: _BOOL,
    sc.STEP_GPU_SM_CLOCK_MHZ: _DOUBLE,
    sc.STEP_GPU_THROTTLE: _INT,
    sc.STEP_PG_NAMES: pa.list_(_TEXT),
    sc.STEP_PG_WAIT_MS: pa.list_(_DOUBLE),
    sc.STEP_PG_COUNTS: pa.list_(_INT),
    sc.STEP_PG_BYTES: pa.list_(_INT),
    sc.STEP_PG_LAST_SEQ: pa.list_(_INT),
    sc.DATALOADER_WAIT_MS: _DOUBLE,
    sc.DATALOADER_WORKERS: _INT,
    sc.COLL_SEQ: _INT,
    sc.COLL_GROUP_SIZE: _INT,
    sc.COLL_GROUP_RANKS: pa.list_(_INT),
    sc.COLL_BYTES: _INT,
    sc.COLL_DEVICE_START_NS: _INT,
    sc.COLL_DEVICE_END_NS: _INT,
    sc.COLL_BUSBW_GBPS: _DOUBLE,
    sc.COLL_WAIT_MS: _DOUBLE,
    sc.COLL_ASYNC: _BOOL,
    sc.KERNEL_ISSUE_LATENCY_US: _DOUBLE,
    sc.KERNEL_FLOPS: _DOUBLE,
    sc.KERNEL_BYTES: _DOUBLE,
    sc.KERNEL_ACHIEVED_TFLOPS: _DOUBLE,
    sc.KERNEL_ACHIEVED_GBPS: _DOUBLE,
    sc.KERNEL_STREAM: _INT,
    sc.KERNEL_DEVICE: _INT,
    sc.KERNEL_CORRELATION: _INT,
    sc.GC_GENERATION: _INT,
    sc.GC_COLLECTED: _INT,
    sc.GC_UNCOLLECTABLE: _INT,
    sc.CODE_LINENO: _INT,
    sc.HANG_ELAPSED_S: _DOUBLE,
    sc.HANG_TIMEOUT_S: _DOUBLE,
    sc.HANG_SEQ: _INT,
    sc.HEARTBEAT_LAST_STEP: _INT,
    sc.HEARTBEAT_INTERVAL_S: _DOUBLE,
    sc.ERROR_SIGNAL: _INT,
    sc.RANKS_COUNT: _INT,
    sc.RANKS_EXPECTED: _INT,
    sc.RANKS_MISSING: pa.list_(_INT),
    sc.RANKS_SPREAD_MS: _DOUBLE,
    sc.RANKS_SLOWEST: _INT,
    sc.RANKS_CULPRIT: _INT,
    sc.RANKS_ARRIVAL_SKEW_MS: _DOUBLE,
    sc.RANKS_LAST_ARRIVAL: _INT,
    sc.ANOMALY_RANKS: pa.list_(_INT),
    sc.ANOMALY_FIRST_STEP: _INT,
    sc.ANOMALY_LAST_STEP: _INT,
    sc.ANOMALY_IMPACT: _DOUBLE,
    sc.ANOMALY_CONFIDENCE: _DOUBLE,
}


def register(key: str, arrow_type: pa.DataType) -> None:
    """Let a detector module declare the type of an attribute it adds."""
    _TYPES.setdefault(key, arrow_type)


def arrow_type(key: str) -> pa.DataType:
    return _TYPES.get(key, _TEXT)


def sql_type(key: str) -> str:
    typ = arrow_type(key)
    if pa.types.is_list(typ):
        return _scalar_sql(typ.value_type) + "[]"
    return _scalar_sql(typ)


def _scalar_sql(typ: pa.DataType) -> str:
    if pa.types.is_floating(typ):
        return "DOUBLE"
    if pa.types.is_integer(typ):
        return "BIGINT"
    if pa.types.is_boolean(typ):
        return "BOOLEAN"
    return "VARCHAR"


def sql_path(key: str) -> str:
    """The JSON path of `key` as a SQL string literal (quoted: keys contain dots)."""
    path = "$." + json.dumps(key)
    return "'" + path.replace("'", "''") + "'"


def sql_extract(key: str, column: str = "attributes") -> str:
    """A DuckDB expression extracting `key` from a JSON attribute column, typed."""
    path_sql = sql_path(key)
    typ = arrow_type(key)
    if typ == _TEXT:
        return f"json_extract_string({column}, {path_sql})"
    return f"TRY_CAST(json_extract({column}, {path_sql}) AS {sql_type(key)})"


def sql_extract_from_list(key: str, index: int, column: str = "v") -> str:
    """`key` typed out of element `index` (0-based) of `json_extract(attributes, [paths])`.

    One multi-path extraction per span parses the JSON once for all keys; one
    `json_extract` per key parses it once per key, and DuckDB's JSON arenas for eleven
    of them over a few thousand kernel spans cost ~130 MB of peak memory (measured).
    """
    element = f"{column}[{index + 1}]"
    if arrow_type(key) == _TEXT:
        return f"json_extract_string({element}, '$')"
    return f"TRY_CAST({element} AS {sql_type(key)})"


# The text of a JSON number (or boolean) whose value a plain VARCHAR cast reads exactly
# as DuckDB's JSON cast reads the JSON value: no leading zeros, no sign '+', no blanks.
_INT_TEXT = "-?(0|[1-9][0-9]*)"
_NUMBER_TEXT = "-?(0|[1-9][0-9]*)([.][0-9]+)?([eE][-+]?[0-9]+)?"
_FAST_TEXT = {"BIGINT": _INT_TEXT, "DOUBLE": _NUMBER_TEXT, "BOOLEAN": "true|false"}


def is_list(key: str) -> bool:
    return pa.types.is_list(arrow_type(key))


def sql_typed_from_strings(key: str, index: int, strings: str = "s",
                           column: str = "attributes") -> str:
    """`key` typed out of element `index` (0-based) of `json_extract_string(column,
    [paths])`, a scalar key (lists: `sql_extract_from_list`).

    Same values as `sql_extract_from_list`, with less memory: a JSON-typed extraction
    costs DuckDB ~2 KB per value and row while it runs (a 7.7k-kernel table: +41 MB peak
    against +26 MB this way). Text is the extracted string itself; a number or boolean
    is cast from its text when that text has the JSON literal form, on which the two
    casts agree; any other value (a boolean for a number, 2.5 for an integer, "0012")
    takes the JSON cast itself, for that row only.
    """
    element = f"{strings}[{index + 1}]"
    sql = sql_type(key)
    if sql == "VARCHAR":
        return element
    exact = f"TRY_CAST(json_extract({column}, {sql_path(key)}) AS {sql})"
    return (f"CASE WHEN {element} IS NULL THEN NULL "
            f"WHEN regexp_full_match({element}, '{_FAST_TEXT[sql]}') "
            f"THEN TRY_CAST({element} AS {sql}) ELSE {exact} END")


def python_values(json_texts: Sequence[str | None], key: str) -> pa.Array:
    """The same extraction done in Python, for backends that hand over JSON text."""
    typ = arrow_type(key)
    out = []
    for text in json_texts:
        value = None
        if text:
            try:
                value = json.loads(text).get(key)
            except (ValueError, AttributeError):
                value = None
        out.append(_coerce(value, typ))
    return pa.array(out, type=typ)


def _coerce(value: object, typ: pa.DataType) -> object:
    if value is None:
        return None
    try:
        if pa.types.is_list(typ):
            if not isinstance(value, list):
                return None
            return [_coerce(v, typ.value_type) for v in value]
        if pa.types.is_floating(typ):
            return float(value)  # type: ignore[arg-type]
        if pa.types.is_integer(typ):
            return int(value)  # type: ignore[arg-type]
        if pa.types.is_boolean(typ):
            return value if isinstance(value, bool) else str(value).lower() == "true"
        return value if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):
        return None
