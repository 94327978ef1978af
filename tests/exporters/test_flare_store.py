"""The flare_store exporter writes a real DuckDB file that reads back exactly."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2 as mpb
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from flare.exporters import REGISTRY, otlp_columns, store
from flare.exporters.flare_store import FlareStoreExporter
from flare.wire import semconv as sc


def kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def s(v: str) -> AnyValue:
    return AnyValue(string_value=v)


def i(v: int) -> AnyValue:
    return AnyValue(int_value=v)


def d(v: float) -> AnyValue:
    return AnyValue(double_value=v)


@pytest.fixture(autouse=True, params=["c_decoder", "python_reference"])
def decoder(request, monkeypatch):
    """Every test runs with the C decoder (when built) and with the Python reference."""
    if request.param == "python_reference":
        monkeypatch.setattr(otlp_columns, "_otlp_read", None)
    return request.param


RESOURCE = [
    kv(sc.SERVICE_NAME, s("train_ddp")), kv(sc.JOB_ID, s("job-7")), kv(sc.RANK, i(3)),
    kv(sc.WORLD_SIZE, i(4)), kv(sc.HOST_NAME, s("node1")), kv(sc.PROCESS_PID, i(4242)),
]


def step_request() -> ExportTraceServiceRequest:
    step = Span(
        trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
        span_id=bytes.fromhex("b7ad6b7169203331"), name=sc.SPAN_STEP,
        kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=1_700_000_000_000_000_000,
        end_time_unix_nano=1_700_000_000_250_000_000,
        attributes=[
            kv(sc.STEP, i(12)), kv(sc.STEP_COLLECTIVE_WAIT_MS, d(3.25)),
            kv(sc.STEP_PG_NAMES, AnyValue(array_value=ArrayValue(values=[s("0"), s("1")]))),
            kv(sc.STEP_PG_COUNTS, AnyValue(array_value=ArrayValue(values=[i(4), i(2)]))),
            kv(sc.STEP_DETAIL, AnyValue(bool_value=True)),
            kv("nested", AnyValue(kvlist_value=KeyValueList(values=[kv("a", i(1))]))),
            kv("raw", AnyValue(bytes_value=b"\x00\xff")),
            kv("nan", d(math.nan)), kv("unicode", s("παράδειγμα")),
        ],
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom"),
        events=[Span.Event(name="exception", time_unix_nano=1_700_000_000_100_000_000,
                           attributes=[kv("exception.type", s("RuntimeError"))])],
        links=[Span.Link(trace_id=b"\x11" * 16, span_id=b"\x22" * 8, attributes=[kv("k", i(1))])],
    )
    child = Span(
        trace_id=step.trace_id, span_id=b"\x01" * 8, parent_span_id=step.span_id,
        name=sc.SPAN_DATALOADER, start_time_unix_nano=1, end_time_unix_nano=5,
        attributes=[kv(sc.STEP, s("12")), kv(sc.RANK, i(5))],  # a sender that typed step as text
    )
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": RESOURCE}, scope_spans=[ScopeSpans(spans=[step, child])],
    )])


def rows(path, sql: str) -> list[dict]:
    con = store.open_reader(path)
    try:
        cur = con.execute(sql)
        names = [c[0] for c in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()


def test_spans_round_trip_through_a_real_store(tmp_path):
    path = tmp_path / "store.duckdb"
    exporter = REGISTRY["flare_store"](path=str(path))
    exporter.export_traces(step_request())
    assert not path.exists()  # nothing touches the file before a flush
    exporter.flush()
    got = rows(path, "SELECT * FROM spans ORDER BY start_ns DESC")
    assert len(got) == 2
    step, child = got
    assert step["job"] == "job-7" and step["service"] == "train_ddp"
    assert step["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert step["span_id"] == "b7ad6b7169203331" and step["parent_span_id"] == ""
    assert step["rank"] == 3 and step["step"] == 12 and step["host"] == "node1" and step["pid"] == 4242
    assert step["duration_ns"] == 250_000_000 and step["kind"] == 1
    assert step["status_code"] == 2 and step["status_message"] == "boom"
    attrs = json.loads(step["attributes"])
    assert attrs[sc.STEP] == 12 and isinstance(attrs[sc.STEP], int)
    assert attrs[sc.STEP_COLLECTIVE_WAIT_MS] == 3.25
    assert attrs[sc.STEP_PG_NAMES] == ["0", "1"] and attrs[sc.STEP_PG_COUNTS] == [4, 2]
    assert attrs[sc.STEP_DETAIL] is True and attrs["nested"] == {"a": 1}
    assert attrs["raw"] == "AP8=" and attrs["nan"] is None and attrs["unicode"] == "παράδειγμα"
    assert json.loads(step["resource"])[sc.WORLD_SIZE] == 4
    (event,) = json.loads(step["events"])
    assert event == {"name": "exception", "time_ns": 1_700_000_000_100_000_000,
                     "attributes": {"exception.type": "RuntimeError"}}
    (link,) = json.loads(step["links"])
    assert link == {"trace_id": "11" * 16, "span_id": "22" * 8, "attributes": {"k": 1}}
    # Span-level rank overrides the resource; a text step still lands as an integer.
    assert child["rank"] == 5 and child["step"] == 12
    assert child["parent_span_id"] == "b7ad6b7169203331"
    assert child["events"] == "[]" and child["links"] == "[]"
    # DuckDB's JSON functions read the attribute text (typed access for diagnosis).
    (typed,) = rows(path, f"SELECT CAST(attributes->>'{sc.STEP_COLLECTIVE_WAIT_MS}' AS DOUBLE) AS w "
                          f"FROM spans WHERE name = '{sc.SPAN_STEP}'")
    assert typed["w"] == 3.25
    assert exporter.metrics()["spans_written"] == 2


def test_job_falls_back_to_service_name(tmp_path):
    path = tmp_path / "s.duckdb"
    exporter = FlareStoreExporter(path=path)
    req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": [kv(sc.SERVICE_NAME, s("only-service"))]},
        scope_spans=[ScopeSpans(spans=[Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="x")])],
    )])
    exporter.export_traces(req)
    exporter.shutdown()
    (row,) = rows(path, "SELECT job, rank, step FROM spans")
    assert row == {"job": "only-service", "rank": None, "step": None}


def metrics_request() -> ExportMetricsServiceRequest:
    gauge = mpb.Metric(name="hw.gpu.utilization", unit="1", gauge=mpb.Gauge(data_points=[
        mpb.NumberDataPoint(time_unix_nano=10, as_double=0.75, attributes=[kv("hw.id", s("gpu0"))]),
    ]))
    total = mpb.Metric(name="flare.gpu.xid", unit="{event}", sum=mpb.Sum(data_points=[
        mpb.NumberDataPoint(time_unix_nano=11, as_int=3),
    ], is_monotonic=True))
    hist = mpb.Metric(name="flare.step.time", unit="ms", histogram=mpb.Histogram(data_points=[
        mpb.HistogramDataPoint(time_unix_nano=12, count=4, sum=10.0, min=1.0, max=4.0,
                               explicit_bounds=[2.0], bucket_counts=[2, 2]),
    ]))
    return ExportMetricsServiceRequest(resource_metrics=[mpb.ResourceMetrics(
        resource={"attributes": RESOURCE},
        scope_metrics=[mpb.ScopeMetrics(metrics=[gauge, total, hist])],
    )])


def test_metrics_one_row_per_point(tmp_path):
    path = tmp_path / "m.duckdb"
    exporter = FlareStoreExporter(path=path)
    exporter.export_metrics(metrics_request())
    exporter.flush()
    got = {r["name"]: r for r in rows(path, "SELECT * FROM metrics")}
    assert got["hw.gpu.utilization"]["value"] == 0.75
    assert got["hw.gpu.utilization"]["rank"] == 3 and got["hw.gpu.utilization"]["job"] == "job-7"
    assert json.loads(got["hw.gpu.utilization"]["attributes"])["hw.id"] == "gpu0"
    assert got["flare.gpu.xid"]["value"] == 3.0 and got["flare.gpu.xid"]["unit"] == "{event}"
    hist = got["flare.step.time"]
    assert hist["value"] == 10.0 and hist["time_ns"] == 12
    extra = json.loads(hist["attributes"])
    assert extra["flare.histogram.count"] == 4 and extra["flare.histogram.bucket_counts"] == [2, 2]
    assert extra["flare.histogram.min"] == 1.0 and extra["flare.histogram.max"] == 4.0


def test_commit_marker_lands_in_the_same_transaction(tmp_path):
    path = tmp_path / "w.duckdb"
    exporter = FlareStoreExporter(path=path)
    exporter.export_traces(step_request())
    exporter.flush(commit_marker=("wal.committed", "segment-3:1024"))
    assert exporter.read_meta("wal.committed") == "segment-3:1024"
    exporter.flush(commit_marker=("wal.committed", "segment-3:2048"))  # marker-only flush
    assert exporter.read_meta("wal.committed") == "segment-3:2048"
    assert exporter.read_meta("absent") is None
    assert rows(path, "SELECT count(*) AS n FROM spans")[0]["n"] == 2


def test_failed_flush_keeps_everything_for_the_next(tmp_path):
    path = tmp_path / "locked.duckdb"
    store.create_or_open(path).close()
    exporter = FlareStoreExporter(path=path, timeout_s=0.2)
    exporter.export_traces(step_request())
    reader = store.open_reader(path)  # a reader holds the file past the flush timeout
    try:
        with pytest.raises(store.StoreError):
            exporter.flush(commit_marker=("wal.committed", "7"))
    finally:
        reader.close()
    assert exporter.metrics()["flush_errors"] == 1
    assert exporter.buffered() == 2
    exporter.export_traces(step_request())
    exporter.flush(commit_marker=("wal.committed", "8"))
    assert rows(path, "SELECT count(*) AS n FROM spans")[0]["n"] == 4
    assert exporter.read_meta("wal.committed") == "8"


def test_a_store_that_is_not_ours_is_refused_without_touching_it(tmp_path):
    path = tmp_path / "garbage.duckdb"
    path.write_bytes(b"this is not a database" * 100)
    exporter = FlareStoreExporter(path=path, timeout_s=0.5)
    exporter.export_traces(step_request())
    with pytest.raises(store.StoreError):
        exporter.flush()
    assert path.read_bytes() == b"this is not a database" * 100
    assert exporter.buffered() == 2


def test_readers_get_in_between_flushes(tmp_path):
    """A reader polling while the exporter flushes in a loop always sees whole flushes."""
    path = tmp_path / "live.duckdb"
    exporter = FlareStoreExporter(path=path)
    exporter.export_traces(step_request())
    exporter.flush()
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def read_loop():
        try:
            while not stop.is_set():
                seen.append(rows(path, "SELECT count(*) AS n FROM spans")[0]["n"])
                # A real reader polls (flare run: every 2 s); reopening back to back
                # starved the writer of the file on a loaded 2-core host.
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read_loop)
    reader.start()
    for _ in range(10):
        exporter.export_traces(step_request())
        exporter.flush()
    stop.set()
    reader.join()
    assert not errors
    assert seen and all(n % 2 == 0 for n in seen)  # never half a flush
    assert seen == sorted(seen)
    assert rows(path, "SELECT count(*) AS n FROM spans")[0]["n"] == 22


def _compressions(path, column: str) -> set[str]:
    con = store.open_reader(path)
    try:
        return {r[0] for r in con.execute(
            "SELECT DISTINCT compression FROM pragma_storage_info('spans') WHERE column_name = ?",
            [column]).fetchall()}
    finally:
        con.close()


def test_json_columns_are_zstd_and_old_layout_stores_stay_writable(tmp_path):
    new = tmp_path / "new.duckdb"
    exporter = FlareStoreExporter(path=new)
    for _ in range(50):
        exporter.export_traces(step_request())
    exporter.flush()
    assert "ZSTD" in _compressions(new, "attributes")
    # A store made before (default text compression) is appended to as it is and
    # reads the same values back.
    old = tmp_path / "old.duckdb"
    con = store.create_or_open(old)
    con.execute("DROP INDEX spans_job_name")
    con.execute("DROP TABLE spans")
    con.execute("CREATE TABLE spans (" + ", ".join(f"{n} {t}" for n, t, _ in store.SPAN_COLUMNS) + ")")
    con.close()
    exporter = FlareStoreExporter(path=old)
    for _ in range(50):
        exporter.export_traces(step_request())
    exporter.flush()
    assert "ZSTD" not in _compressions(old, "attributes")
    sql = "SELECT name, attributes, resource, events, links FROM spans ORDER BY name, span_id LIMIT 4"
    assert rows(old, sql) == rows(new, sql)


def test_a_store_file_replaced_between_flushes_gets_its_schema_again(tmp_path):
    path = tmp_path / "s.duckdb"
    exporter = FlareStoreExporter(path=path)
    exporter.export_traces(step_request())
    exporter.flush()
    path.unlink()  # e.g. an operator moved the store away while the collector runs
    exporter.export_traces(step_request())
    exporter.flush(commit_marker=("k", "2"))
    assert rows(path, "SELECT count(*) AS n FROM spans")[0]["n"] == 2
    assert exporter.read_meta("k") == "2"


def _row_groups_after(tmp_path, flush_sizes: list[int]) -> int:
    """Row groups of the spans table in the store file after flushes of the given
    numbers of 2-span requests, with a large flush being 6 spans or more."""
    path = tmp_path / f"store-{'-'.join(map(str, flush_sizes))}.duckdb"
    exporter = FlareStoreExporter(path, large_flush_rows=6)
    for number, requests in enumerate(flush_sizes):
        for _ in range(requests):
            exporter.export_traces(step_request())
        exporter.flush(commit_marker=("wal_lsn", str(number)))
    assert rows(path, "SELECT count(*) AS n FROM spans") == [{"n": 2 * sum(flush_sizes)}]
    assert rows(path, "SELECT value FROM flare_meta WHERE key = 'wal_lsn'") == [
        {"value": str(len(flush_sizes) - 1)}]
    return rows(path, "SELECT count(DISTINCT row_group_id) AS n "
                      "FROM pragma_storage_info('spans')")[0]["n"]


def test_large_flushes_keep_their_row_groups_and_small_ones_are_merged(tmp_path):
    # Read in the store file itself: a large flush is checkpointed at its commit without
    # DuckDB's vacuum, so each keeps its own row group (no rewrite of its neighbours);
    # small flushes keep the vacuum, which merges them into one row group.
    assert _row_groups_after(tmp_path, [1, 1, 1, 1]) == 1
    assert _row_groups_after(tmp_path, [3, 3, 3, 3]) == 4
    assert _row_groups_after(tmp_path, [1, 3, 1, 3]) == 2
