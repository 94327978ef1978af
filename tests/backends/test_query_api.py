"""The collector's read-only Jaeger endpoint over a real store, and the Jaeger adapter
reading through it: the same diagnosis input as reading the store directly."""

from __future__ import annotations

import json
import time

import pytest

from flare.collector import query_api
from flare.collector.query_api import handle, parse_go_duration_ns, rfc3339_ns_text
from flare.diagnostics.backends import open_backend
from flare.diagnostics.backends.jaeger import JaegerBackend
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store
from flare.wire import semconv as sc

START_NS = time.time_ns() - 3600 * 10**9


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("query") / "store.duckdb"
    table = job_spans("jobA", world=4, steps=30, start_ns=START_NS,
                      faults=(Fault("compute", rank=2, from_step=10),))
    with store.writer(path) as con:
        store.insert_spans(con, table)
    return str(path)


def get(store_path, path, **query):
    status, headers, body = handle(store_path, "GET", path, {k: [str(v)] for k, v in query.items()})
    return status, json.loads(body) if headers.get("Content-Type") == "application/json" else body


def shape(value):
    """The key structure of a JSON document (what the recorded fixtures pin down)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def covers(ours, recorded):
    """Every key the recorded answer has, ours has, with the same JSON type."""
    if isinstance(recorded, dict):
        return isinstance(ours, dict) and all(
            k in ours and covers(ours[k], v) for k, v in recorded.items()
        )
    if isinstance(recorded, list):
        return isinstance(ours, list) and (not recorded or (ours and covers(ours[0], recorded[0])))
    return ours == recorded


def test_services_and_operations_have_jaegers_shape(store_path, jaeger_fixture):
    status, doc = get(store_path, "/api/v3/services")
    assert status == 200 and doc == {"services": ["jobA"]}
    assert covers(shape(doc), shape(jaeger_fixture("apiv3_GetServices.json")))
    status, doc = get(store_path, "/api/v3/operations", service="jobA")
    assert doc == {"operations": [{"name": "train.step", "spanKind": "internal"}]}
    assert covers(shape(doc), shape(jaeger_fixture("apiv3_GetOperations.json")))


def test_find_traces_with_attribute_filter_and_time_range(store_path, jaeger_fixture):
    status, doc = get(
        store_path, "/api/v3/traces",
        **{"query.service_name": "jobA", "query.operation_name": "train.step",
           "query.start_time_min": rfc3339_ns_text(START_NS - 10**9),
           "query.start_time_max": rfc3339_ns_text(time.time_ns()),
           "query.attributes": json.dumps({"flare.step": "12"}),
           "query.search_depth": "10"},
    )
    assert status == 200
    recorded = jaeger_fixture("apiv3_FindTraces.json")
    spans = [s for rs in doc["result"]["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert covers(shape(doc)["result"]["resourceSpans"][0]["scopeSpans"][0]["spans"][0],
                  {k: v for k, v in shape(recorded)["result"]["resourceSpans"][0]["scopeSpans"][0]["spans"][0].items() if k != "status"})
    assert {s["traceId"] for s in spans} == {f"{sc.step_trace_id('jobA', 12):032x}"}
    assert len(spans) == 4  # the whole trace: every rank's step 12


def test_search_depth_limits_traces_and_duration_filters(store_path):
    window = {"query.service_name": "jobA",
              "query.start_time_min": rfc3339_ns_text(START_NS - 10**9),
              "query.start_time_max": rfc3339_ns_text(time.time_ns())}
    _, doc = get(store_path, "/api/v3/traces", **window, **{"query.search_depth": 3})
    ids = {s["traceId"] for rs in doc["result"]["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
    assert len(ids) == 3
    status, doc = get(store_path, "/api/v3/traces", **window, **{"query.duration_min": "10s"})
    assert status == 404 and doc["error"]["httpCode"] == 404


def test_get_trace_and_ui_api(store_path, jaeger_fixture):
    trace_id = f"{sc.step_trace_id('jobA', 3):032x}"
    status, doc = get(store_path, f"/api/v3/traces/{trace_id}")
    assert status == 200 and len(doc["result"]["resourceSpans"]) == 4
    status, doc = get(store_path, f"/api/traces/{trace_id}")
    assert status == 200
    recorded = jaeger_fixture("otlp2jaeger-out.json")
    assert covers(shape(doc)["data"][0]["spans"][0],
                  {k: v for k, v in shape(recorded)["data"][0]["spans"][0].items()
                   if k not in ("warnings", "logs", "references", "tags")})
    tags = doc["data"][0]["spans"][0]["tags"]
    assert tags and all(set(t) == {"key", "type", "value"} for t in tags)
    assert {"key": "span.kind", "type": "string", "value": "internal"} in tags
    assert {p["serviceName"] for p in doc["data"][0]["processes"].values()} == {"jobA"}
    _, doc = get(store_path, "/api/services")
    assert doc["data"] == ["jobA"]
    _, doc = get(store_path, "/api/services/jobA/operations")
    assert doc["data"] == ["train.step"]
    _, doc = get(store_path, "/api/traces", service="jobA", limit=2,
                 tags=json.dumps({"flare.rank": "2"}))
    # The tag filter selects traces; like Jaeger, the whole trace (all ranks) comes back.
    assert len(doc["data"]) == 2
    assert all(len(t["spans"]) == 4 for t in doc["data"])


@pytest.mark.parametrize(
    ("path", "query", "status"),
    [
        ("/api/v3/traces", {"query.service_name": "jobA"}, 400),
        ("/api/v3/traces/zz", {}, 400),
        ("/api/v3/traces/" + "1" * 32, {}, 404),
        ("/api/v3/operations", {}, 400),
        ("/api/v3/nothing", {}, 404),
    ],
)
def test_bad_requests_get_jaeger_errors(store_path, path, query, status):
    got, _, _ = handle(store_path, "GET", path, {k: [v] for k, v in query.items()})
    assert got == status


def test_read_only_and_missing_store(store_path, tmp_path):
    assert handle(store_path, "POST", "/api/v3/services", {})[0] == 405
    status, _, body = handle(str(tmp_path / "absent.duckdb"), "GET", "/api/v3/services", {})
    assert status == 503 and b"does not exist" in body


def test_go_durations():
    assert parse_go_duration_ns("1.5s", "d") == 1_500_000_000
    assert parse_go_duration_ns("1m30s", "d") == 90 * 10**9
    assert parse_go_duration_ns("250us", "d") == 250_000
    with pytest.raises(query_api._BadRequest):
        parse_go_duration_ns("soon", "d")


@pytest.fixture(scope="module")
def read_endpoint(store_path):
    """The collector's `flare_query` extension over the module's store."""
    yield from _serve(store_path)


def _serve(store_path):
    from flare.collector.config import embedded_config
    from flare.collector.service import Collector

    config = embedded_config(store_path)
    config["extensions"]["flare_query"] = {"endpoint": "127.0.0.1:0"}
    config["service"]["extensions"].append("flare_query")
    collector = Collector(config)
    collector.start()
    yield f"http://{collector.query_endpoint}"
    collector.stop()


def test_jaeger_adapter_reads_the_read_endpoint_like_the_store(store_path, read_endpoint):
    direct = open_backend(f"store:{store_path}").job_data("jobA")
    for legacy in (False, True):
        backend = open_backend(f"jaeger+{read_endpoint}")
        if legacy:
            backend._api_v3 = False  # the internal /api path, as on an old Jaeger
        assert backend.jobs() == ["jobA"]
        remote = backend.job_data("jobA")
        attrs = [sc.STEP_COLLECTIVE_WAIT_MS, sc.STEP_COMPUTE_MS]
        a = {(r["rank"], r["step"]): r for r in direct.step_summary(attrs).to_pylist()}
        b = {(r["rank"], r["step"]): r for r in remote.step_summary(attrs).to_pylist()}
        assert len(a) == 4 * 30 and a.keys() == b.keys()
        for key, x in a.items():
            y = b[key]
            # the internal /api speaks microseconds
            assert x["duration_ms"] == pytest.approx(y["duration_ms"], abs=1e-3)
            assert x[sc.STEP_COLLECTIVE_WAIT_MS] == pytest.approx(y[sc.STEP_COLLECTIVE_WAIT_MS])
        assert remote.spans(["train.step"], first_step=5, last_step=6, ranks=[1]).num_rows == 2
        backend.close()


def test_adapter_and_endpoint_agree_on_a_busy_window(read_endpoint):
    """Depth far below the trace count: the adapter's window splitting still sees all."""
    backend = JaegerBackend(read_endpoint, search_depth=7)
    assert backend.fetch("jobA", ["train.step"]).num_rows == 4 * 30


def _under_one_service(table, service: str):
    """The table's spans as sent with OTEL_SERVICE_NAME=service (the job only in flare.job.id)."""
    import pyarrow as pa

    resources = []
    for text in table.column("resource").to_pylist():
        resource = json.loads(text) if text else {}
        resource[sc.SERVICE_NAME] = service
        resources.append(json.dumps(resource))
    table = table.set_column(table.schema.get_field_index("service"), "service",
                             pa.array([service] * table.num_rows, pa.string()))
    return table.set_column(table.schema.get_field_index("resource"), "resource",
                            pa.array(resources, pa.string()))


def test_two_jobs_under_one_service_are_two_jobs_in_the_store_and_through_jaeger(tmp_path):
    """Jobs launched with only OTEL_SERVICE_NAME=trainer (or the SDK's unknown_service)
    used to merge on the Jaeger path: jobs are their flare.job.id on every backend, and
    each gives the same diagnosis there as from the store."""
    from flare.diagnostics import pipeline

    path = tmp_path / "two.duckdb"
    with store.writer(path) as con:
        store.insert_spans(con, _under_one_service(job_spans(
            "jobB", world=4, steps=30, start_ns=START_NS, faults=(Fault("compute", rank=1, from_step=10),)),
            "trainer"))
        store.insert_spans(con, _under_one_service(job_spans(
            "jobC", world=4, steps=30, start_ns=START_NS + 10**9, seed=3,
            faults=(Fault("compute", rank=3, from_step=12),)), "trainer"))
    direct = open_backend(f"store:{path}")
    generator = _serve(str(path))
    url = next(generator)
    try:
        jaeger = open_backend(f"jaeger+{url}")
        assert direct.jobs() == jaeger.jobs() == ["jobB", "jobC"]
        for job in ("jobB", "jobC"):
            want = [(a.kind, a.ranks, a.cause) for a in pipeline.diagnose(direct.job_data(job)).anomalies]
            got = [(a.kind, a.ranks, a.cause) for a in pipeline.diagnose(jaeger.job_data(job)).anomalies]
            assert want == got and want, (job, want, got)
        jaeger.close()
    finally:
        direct.close()
        next(generator, None)
