"""The store backend (SQL pushdown) and the Arrow adapter base give the same tables."""

from __future__ import annotations

import pyarrow as pa
import pytest

from flare.diagnostics.backends import BackendError, open_backend
from flare.diagnostics.backends.arrow import ArrowJobData
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store as flare_store
from flare.wire import semconv as sc

ATTRS = [sc.STEP_COLLECTIVE_WAIT_MS, sc.STEP_COMPUTE_MS]


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store.duckdb"
    table = job_spans("jobA", world=4, steps=30, faults=(Fault("compute", 2, 10),))
    other = job_spans("jobB", world=2, steps=5)
    with flare_store.writer(path) as con:
        flare_store.insert_spans(con, table)
        flare_store.insert_spans(con, table.slice(0, 8))  # a duplicated delivery
        flare_store.insert_spans(con, other)
    return path


def _arrow_job(store_path):
    backend = open_backend(str(store_path))

    def fetch(names, first_step, last_step, ranks):
        return backend.query("SELECT * FROM spans WHERE job = 'jobA'")

    return ArrowJobData("jobA", "test", fetch)


def test_jobs_and_ranges(store_path):
    backend = open_backend(f"store:{store_path}")
    assert backend.jobs() == ["jobA", "jobB"]
    job = backend.job_data("jobA")
    assert job.steps_range() == (0, 29)
    assert job.ranks() == [0, 1, 2, 3]
    assert job.world_size() == 4
    arrow_job = _arrow_job(store_path)
    assert arrow_job.steps_range() == (0, 29)
    assert arrow_job.ranks() == [0, 1, 2, 3]
    assert arrow_job.world_size() == 4


def test_spans_filters_and_typed_attributes(store_path):
    job = open_backend(str(store_path)).job_data("jobA")
    table = job.spans([sc.SPAN_STEP], [sc.STEP_COMPUTE_MS, sc.STEP_PG_WAIT_MS],
                      first_step=10, last_step=11, ranks=[2])
    assert table.num_rows == 2
    assert table.to_arrow().schema.field(sc.STEP_COMPUTE_MS).type == pa.float64()
    assert pa.types.is_list(table.to_arrow().schema.field(sc.STEP_PG_WAIT_MS).type)
    assert min(table[sc.STEP_COMPUTE_MS].to_pylist()) > 60  # 40 ms base + 30 ms fault
    arrow = _arrow_job(store_path).spans([sc.SPAN_STEP], [sc.STEP_COMPUTE_MS, sc.STEP_PG_WAIT_MS],
                                         first_step=10, last_step=11, ranks=[2])
    assert arrow[sc.STEP_COMPUTE_MS].to_pylist() == table[sc.STEP_COMPUTE_MS].to_pylist()
    assert job.spans(["train.*"], columns=["name"], limit=3).num_rows == 3


@pytest.mark.parametrize("bucket", [1, 7])
def test_step_summary_matches_between_backends(store_path, bucket):
    store_job = open_backend(str(store_path)).job_data("jobA")
    order = [("step", "ascending"), ("rank", "ascending")]
    sql = store_job.step_summary(ATTRS, step_bucket=bucket).sort_by(order)
    py = _arrow_job(store_path).step_summary(ATTRS, step_bucket=bucket).sort_by(order)
    assert sql.column_names == py.column_names
    assert sql.num_rows == py.num_rows == 4 * len(range(0, 30, bucket))
    for name in ["rank", "step", "steps"]:
        assert sql[name].to_pylist() == py[name].to_pylist()
    for name in [*ATTRS, "duration_ms"]:
        assert sql[name].to_pylist() == pytest.approx(py[name].to_pylist())


def test_bad_specs(tmp_path):
    with pytest.raises(BackendError, match="does not exist"):
        open_backend(str(tmp_path / "missing.duckdb"))
    with pytest.raises(BackendError, match="unknown backend"):
        open_backend("zipkin+http://x:1")
    (tmp_path / "junk.duckdb").write_bytes(b"not a database at all" * 100)
    with pytest.raises(BackendError):
        open_backend(str(tmp_path / "junk.duckdb"))
