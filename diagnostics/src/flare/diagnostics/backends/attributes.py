"""Typed extraction of span attributes: which Arrow type each attribute key has.

Types are kept by their Arrow names ("double", "int64", "bool", "string",
"list<item: int64>"), so the store path needs no pyarrow; `arrow_type` gives the
pyarrow type itself to the backends that build Arrow tables.

Stores keep attributes as JSON text; detectors want typed columns. The type comes
from the semantic conventions (a duration in ms is a double, a step an integer, the
per-process-group arrays are lists); keys nobody registered come back as text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from flare.diagnostics.columns import is_list_type, list_value_type
from flare.wire import semconv as sc

_DOUBLE = "double"
_INT = "int64"
_BOOL = "bool"
_TEXT = "string"


def _list_of(value_type: str) -> str:
    return f"list<item: {value_type}>"


# Bit masks: a bucket of steps keeps the OR of its values (a mean of masks means nothing).
# `step_summary` backends aggregate these with bit_or instead of avg.
BITMASK_ATTRIBUTES = frozenset({sc.STEP_GPU_THROTTLE})

_TYPES: dict[str, str] = {
    # resource (a backend that keeps values as text gives them back typed: clickhouse.py)
    sc.RANK: _INT,
    sc.LOCAL_RANK: _INT,
    sc.WORLD_SIZE: _INT,
    sc.NODE_RANK: _INT,
    sc.RESTART_COUNT: _INT,
    sc.PROCESS_PID: _INT,
    sc.GPU_INDEX: _INT,
    # spans
    sc.STEP: _INT,
    sc.STEP_RUNQUEUE_MS: _DOUBLE,
    sc.STEP_THREAD_CPU_MS: _DOUBLE,
    sc.STEP_BACKWARD_MS: _DOUBLE,
    sc.STEP_GPU_TEMPERATURE_C: _DOUBLE,
    sc.STEP_GPU_POWER_W: _DOUBLE,
    sc.STEP_PG_DEVICE_MS: _list_of(_DOUBLE),
    sc.COLL_DEVICE_MS: _DOUBLE,
    sc.COLL_P2P_PEER: _INT,
    sc.DATALOADER_INDEX: _INT,
    sc.KERNEL_LAUNCH_NS: _INT,
    sc.KERNEL_LAUNCH_DUR_US: _DOUBLE,
    sc.HEARTBEAT_STEP_OPEN_S: _DOUBLE,
    sc.STEP_DATALOADER_MS: _DOUBLE,
    sc.STEP_COLLECTIVE_WAIT_MS: _DOUBLE,
    sc.STEP_GC_MS: _DOUBLE,
    sc.STEP_PYCALL_MS: _DOUBLE,
    sc.STEP_COMPUTE_MS: _DOUBLE,
    sc.STEP_CHECKPOINT_MS: _DOUBLE,
    sc.STEP_EVALUATION_MS: _DOUBLE,
    sc.PHASE: _TEXT,
    sc.STEP_OTHER_THREADS_CPU_MS: _DOUBLE,
    sc.STEP_DATALOADER_COUNT: _INT,
    sc.STEP_COLLECTIVE_COUNT: _INT,
    sc.STEP_COLLECTIVE_BYTES: _INT,
    sc.STEP_GC_COUNT: _INT,
    sc.STEP_PYCALL_COUNT: _INT,
    sc.STEP_DETAIL: _BOOL,
    sc.STEP_GPU_SM_CLOCK_MHZ: _DOUBLE,
    sc.STEP_GPU_THROTTLE: _INT,
    sc.STEP_PG_NAMES: _list_of(_TEXT),
    sc.STEP_PG_WAIT_MS: _list_of(_DOUBLE),
    sc.STEP_PG_COUNTS: _list_of(_INT),
    sc.STEP_PG_BYTES: _list_of(_INT),
    sc.STEP_PG_LAST_SEQ: _list_of(_INT),
    sc.STEP_PG_ROLES: _list_of(_TEXT),
    sc.STEP_PG_UNTIMED: _list_of(_INT),
    sc.STEP_COLLECTIVE_UNTIMED: _INT,
    sc.CAPTURE_FRAMES: _list_of(_TEXT),
    sc.CAPTURE_SAMPLES: _list_of(_INT),
    sc.CAPTURE_STACKS: _list_of(_TEXT),
    sc.CAPTURE_STACK_SAMPLES: _list_of(_INT),
    sc.CAPTURE_TOTAL: _INT,
    sc.CAPTURE_INTERVAL_MS: _DOUBLE,
    sc.CAPTURE_PROCESS: _TEXT,
    sc.CAPTURE_PIDS: _list_of(_INT),
    sc.CAPTURE_WINDOW_STEPS: _DOUBLE,
    sc.CAPTURE_WORKERS: _INT,
    sc.DATALOADER_WAIT_MS: _DOUBLE,
    sc.DATALOADER_WORKERS: _INT,
    sc.COLL_SEQ: _INT,
    sc.COLL_GROUP_SIZE: _INT,
    sc.COLL_GROUP_RANKS: _list_of(_INT),
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
    sc.HANG_LOADER_WORKERS: _list_of(_INT),
    sc.HEARTBEAT_LAST_STEP: _INT,
    sc.HEARTBEAT_INTERVAL_S: _DOUBLE,
    sc.HEARTBEAT_NO_STEP_S: _DOUBLE,
    sc.HEARTBEAT_NO_STEP_BATCHES: _INT,
    sc.ERROR_SIGNAL: _INT,
    sc.RANKS_COUNT: _INT,
    sc.RANKS_EXPECTED: _INT,
    sc.RANKS_MISSING: _list_of(_INT),
    sc.RANKS_SPREAD_MS: _DOUBLE,
    sc.RANKS_SLOWEST: _INT,
    sc.RANKS_CULPRIT: _INT,
    sc.RANKS_ARRIVAL_SKEW_MS: _DOUBLE,
    sc.RANKS_LAST_ARRIVAL: _INT,
    sc.ANOMALY_RANKS: _list_of(_INT),
    sc.ANOMALY_FIRST_STEP: _INT,
    sc.ANOMALY_LAST_STEP: _INT,
    sc.ANOMALY_IMPACT: _DOUBLE,
    sc.ANOMALY_CONFIDENCE: _DOUBLE,
}


def register(key: str, arrow_type: object) -> None:
    """Let a detector module declare the type of an attribute it adds (an Arrow type
    name such as "double", or a pyarrow type)."""
    _TYPES.setdefault(key, str(arrow_type))


def type_name(key: str) -> str:
    """The Arrow type name of `key` ("string" for keys nobody registered)."""
    return _TYPES.get(key, _TEXT)


def arrow_type(key: str):
    """The pyarrow type of `key` (imports pyarrow: for the Arrow-building backends)."""
    import pyarrow as pa

    name = type_name(key)
    if is_list_type(name):
        return pa.list_(pa.type_for_alias(list_value_type(name)))
    return pa.type_for_alias(name)


def sql_type(key: str) -> str:
    name = type_name(key)
    if is_list_type(name):
        return _scalar_sql(list_value_type(name)) + "[]"
    return _scalar_sql(name)


def _scalar_sql(name: str) -> str:
    if name in ("float", "double", "halffloat"):
        return "DOUBLE"
    if name.startswith(("int", "uint")):
        return "BIGINT"
    if name == "bool":
        return "BOOLEAN"
    return "VARCHAR"


def sql_path(key: str) -> str:
    """The JSON path of `key` as a SQL string literal (quoted: keys contain dots)."""
    path = "$." + json.dumps(key)
    return "'" + path.replace("'", "''") + "'"


def sql_extract(key: str, column: str = "attributes") -> str:
    """A DuckDB expression extracting `key` from a JSON attribute column, typed."""
    path_sql = sql_path(key)
    if type_name(key) == _TEXT:
        return f"json_extract_string({column}, {path_sql})"
    return f"TRY_CAST(json_extract({column}, {path_sql}) AS {sql_type(key)})"


def sql_extract_from_list(key: str, index: int, column: str = "v") -> str:
    """`key` typed out of element `index` (0-based) of `json_extract(attributes, [paths])`.

    One multi-path extraction per span parses the JSON once for all keys; one
    `json_extract` per key parses it once per key, and DuckDB's JSON arenas for eleven
    of them over a few thousand kernel spans cost ~130 MB of peak memory (measured).
    """
    element = f"{column}[{index + 1}]"
    if type_name(key) == _TEXT:
        return f"json_extract_string({element}, '$')"
    return f"TRY_CAST({element} AS {sql_type(key)})"


# The text of a JSON number (or boolean) whose value a plain VARCHAR cast reads exactly
# as DuckDB's JSON cast reads the JSON value: no leading zeros, no sign '+', no blanks.
_INT_TEXT = "-?(0|[1-9][0-9]*)"
_NUMBER_TEXT = "-?(0|[1-9][0-9]*)([.][0-9]+)?([eE][-+]?[0-9]+)?"
_FAST_TEXT = {"BIGINT": _INT_TEXT, "DOUBLE": _NUMBER_TEXT, "BOOLEAN": "true|false"}


def is_list(key: str) -> bool:
    return is_list_type(type_name(key))


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


def python_values(json_texts: Sequence[str | None], key: str):
    """The same extraction done in Python, for backends that hand over JSON text
    (a pyarrow array)."""
    import pyarrow as pa

    name = type_name(key)
    out = []
    for text in json_texts:
        value = None
        if text:
            try:
                value = json.loads(text).get(key)
            except (ValueError, AttributeError):
                value = None
        out.append(_coerce(value, name))
    return pa.array(out, type=arrow_type(key))


def from_text(text: str | None, key: str) -> object:
    """`key`'s value from the text a backend that keeps every value as text holds (the
    ClickHouse exporter's maps: numbers and bools spelled out, lists as JSON)."""
    name = type_name(key)
    if text is None or name == _TEXT:
        return text
    try:
        return _coerce(json.loads(text), name)
    except ValueError:
        return None


def _coerce(value: object, name: str) -> object:
    if value is None:
        return None
    try:
        if is_list_type(name):
            if not isinstance(value, list):
                return None
            return [_coerce(v, list_value_type(name)) for v in value]
        if name in ("float", "double"):
            return float(value)  # type: ignore[arg-type]
        if name.startswith(("int", "uint")):
            return int(value)  # type: ignore[arg-type]
        if name == "bool":
            return value if isinstance(value, bool) else str(value).lower() == "true"
        return value if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):
        return None
