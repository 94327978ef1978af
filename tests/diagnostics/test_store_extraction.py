"""Typed attributes from the store: the string-based extraction `StoreJobData.spans` uses
gives exactly what DuckDB's JSON cast gives, whatever the JSON value is."""

from __future__ import annotations

import json

import duckdb
import pytest

from flare.diagnostics.backends.attributes import arrow_type, sql_extract_from_list, sql_path
from flare.diagnostics.backends.store import StoreBackend
from flare.exporters import store as flare_store
from flare.wire import semconv as sc

# One key of each extracted type: integer, double, boolean, text, list of integers.
KEYS = [sc.KERNEL_STREAM, sc.KERNEL_FLOPS, sc.STEP_DETAIL, sc.KERNEL_NAME, sc.COLL_GROUP_RANKS]
VALUES = [
    "123", "-5", "0", "-0", "1.5", "2.5", "-2.5", "1e3", "1E-2", "1.0", "0.1", "true", "false",
    "null", '"12"', '"1.5"', '"0012"', '" 12"', '"+5"', '"1e3"', '"abc"', '""', '"true"', '"t"',
    '"null"', "9223372036854775807", "9223372036854775808", "-9223372036854775809", "1e400",
    "12345678901234567890123", "[1, 2]", '["a"]', '{"a": 1}', '"[1, 2]"', '"12abc"',
]


@pytest.fixture
def odd_store(tmp_path):
    """A span per (value, key) pair, plus spans without the key and without attributes."""
    path = tmp_path / "store.duckdb"
    docs = [f'{{{json.dumps(k)}: {v}, "other": 1}}' for v in VALUES for k in KEYS]
    docs += ["{}", '{"other": "x"}', None]
    with flare_store.writer(path) as con:
        for i, doc in enumerate(docs):
            con.execute("INSERT INTO spans (job, name, start_ns, attributes) VALUES "
                        "('j', 'kernel', ?, ?)", [i, doc])
    return path, docs


def _reference(path, keys) -> dict[str, list]:
    """The previous extraction: one JSON-typed list per span, cast element by element."""
    paths = "[" + ", ".join(sql_path(k) for k in keys) + "]"
    select = ", ".join(f'{sql_extract_from_list(k, i)} AS "{k}"' for i, k in enumerate(keys))
    con = duckdb.connect(str(path), read_only=True)
    try:
        table = con.sql(f"SELECT {select} FROM (SELECT *, json_extract(attributes, {paths}) AS v "
                        "FROM spans) ORDER BY start_ns").to_arrow_table()
    finally:
        con.close()
    return {k: table.column(k).cast(arrow_type(k)).to_pylist() for k in keys}


@pytest.mark.parametrize("keys", [KEYS, KEYS[:4], [sc.COLL_GROUP_RANKS]])
def test_string_extraction_equals_the_json_cast(odd_store, keys):
    path, docs = odd_store
    table = StoreBackend(path, hold_s=0).job_data("j").spans(["kernel"], attributes=keys,
                                                               columns=["start_ns"])
    assert table.num_rows == len(docs)
    expected = _reference(path, keys)
    for key in keys:
        assert table.to_arrow().schema.field(key).type == arrow_type(key)
        got = table.column(key).to_pylist()
        mismatches = [(docs[i], got[i], want) for i, want in enumerate(expected[key])
                      if repr(got[i]) != repr(want)]
        assert not mismatches, (key, mismatches[:5])
    # Not vacuous: the values span NULLs and non-NULLs of every type.
    for key in keys:
        values = table.column(key).to_pylist()
        assert any(v is None for v in values) and any(v is not None for v in values)
