"""JaegerBackend against Jaeger's recorded responses, served by a real loopback server."""

from __future__ import annotations

import json
import socket
import time

import pytest

from flare.diagnostics.backends import BackendError, open_backend
from flare.diagnostics.backends.jaeger import JaegerBackend
from flare.diagnostics.backends.json_rows import SpanRows, add_otlp_json, hex_id


def test_services_and_operations_from_api_v3(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/v3/services", jaeger_fixture("apiv3_GetServices.json"))
    recorded_server.answer("/api/v3/operations", jaeger_fixture("apiv3_GetOperations.json"))
    backend = open_backend(f"jaeger+{recorded_server.url}")
    assert isinstance(backend, JaegerBackend)
    assert backend.jobs() == ["foo"]
    assert backend.operations("foo") == ["get_users"]
    assert recorded_server.requests[-1][1]["service"] == ["foo"]


def test_the_written_back_anomalies_service_is_not_a_job(recorded_server):
    recorded_server.answer("/api/v3/services",
                           {"services": ["train_ddp", "flare-diagnostics", "jaeger-all-in-one"]})
    assert JaegerBackend(recorded_server.url).jobs() == ["train_ddp"]


def test_find_traces_pushes_filters_down_and_reads_otlp_json(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/v3/services", jaeger_fixture("apiv3_GetServices.json"))
    recorded_server.answer("/api/v3/traces", jaeger_fixture("apiv3_FindTraces.json"))
    backend = JaegerBackend(recorded_server.url, search_depth=50)
    table = backend.fetch("foo", ["foobar"])
    rows = table.to_pylist()
    assert len(rows) == 1
    assert rows[0]["trace_id"] == "00000000000000000000000000000001"
    assert rows[0]["span_id"] == "0000000000000002"
    assert rows[0]["kind"] == 2 and rows[0]["status_code"] == 2
    path, query, _ = recorded_server.requests[-1]
    assert path == "/api/v3/traces"
    assert query["query.service_name"] == ["foo"]
    assert query["query.operation_name"] == ["foobar"]
    assert query["query.search_depth"] == ["50"]
    assert query["query.start_time_min"][0].endswith("Z")
    assert query["query.start_time_min"][0] < query["query.start_time_max"][0]


def test_rank_and_step_filters_become_query_attributes(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/v3/services", jaeger_fixture("apiv3_GetServices.json"))
    recorded_server.answer("/api/v3/traces", jaeger_fixture("apiv3_FindTraces.json"))
    backend = JaegerBackend(recorded_server.url)
    table = backend.fetch("foo", ["train.step"], first_step=7, last_step=7, ranks=[3])
    _, query, _ = recorded_server.requests[-1]
    assert json.loads(query["query.attributes"][0]) == {"flare.step": "7", "flare.rank": "3"}
    # The recorded span has neither attribute: the exact filter here drops it.
    assert table.num_rows == 0


def test_get_trace_by_id(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/v3/services", jaeger_fixture("apiv3_GetServices.json"))
    recorded_server.answer(
        "/api/v3/traces/00000000000000000000000000000001", jaeger_fixture("apiv3_GetTrace.json")
    )
    backend = JaegerBackend(recorded_server.url)
    assert backend.trace("1").column("name").to_pylist() == ["foobar"]
    # base64 of the same 16 bytes reaches the same trace
    assert backend.trace("AAAAAAAAAAAAAAAAAAAAAQ==").num_rows == 1


def test_fallback_to_internal_api_when_api_v3_is_absent(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/services", {"data": ["telemetrygen"], "total": 1})
    recorded_server.answer("/api/traces", jaeger_fixture("otlp2jaeger-out.json"))
    backend = JaegerBackend(recorded_server.url)
    assert backend.jobs() == ["telemetrygen"]
    assert not backend.api_v3()
    table = backend.fetch("telemetrygen", ["okey-dokey-0"])
    path, query, _ = recorded_server.requests[-1]
    assert path == "/api/traces"
    assert query["service"] == ["telemetrygen"] and query["operation"] == ["okey-dokey-0"]
    rows = table.to_pylist()
    assert len(rows) == 1  # the recorded answer holds the same span twice
    row = rows[0]
    assert row["parent_span_id"] == "909541b92cf05311"
    assert row["kind"] == 2
    assert row["end_ns"] - row["start_ns"] == 123_000
    attributes = json.loads(row["attributes"])
    assert attributes == {"net.peer.ip": "1.2.3.4", "peer.service": "telemetrygen-client"}
    assert json.loads(row["resource"]) == {"service.name": "telemetrygen"}


def test_jaeger_model_and_otlp_json_of_one_span_give_the_same_row(
    recorded_server, jaeger_fixture
):
    """Jaeger's own translation pair (OTLP in → model out) must land on identical rows."""
    from_otlp = SpanRows()
    add_otlp_json(from_otlp, jaeger_fixture("otlp2jaeger-in.json")["resourceSpans"])
    recorded_server.answer("/api/services", {"data": ["telemetrygen"]})
    recorded_server.answer("/api/traces", jaeger_fixture("otlp2jaeger-out.json"))
    from_model = JaegerBackend(recorded_server.url).fetch("telemetrygen", ["okey-dokey-0"])
    a, b = from_otlp.table().to_pylist()[0], from_model.to_pylist()[0]
    for key in ("trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns",
                "status_code", "attributes", "service"):
        assert a[key] == b[key], key


def test_search_splits_a_full_window_until_nothing_is_left_out(recorded_server):
    """Jaeger has no cursor: a search that comes back full must be split, not trusted."""
    base = time.time_ns() - 3600 * 10**9
    spans = [(f"{i + 1:032x}", base + i * 1_000_000_000) for i in range(25)]

    def find(query):
        from flare.collector.query_api import parse_rfc3339_ns

        lo = parse_rfc3339_ns(query["query.start_time_min"][0], "min")
        hi = parse_rfc3339_ns(query["query.start_time_max"][0], "max")
        depth = int(query["query.search_depth"][0])
        hits = [(t, s) for t, s in spans if lo <= s <= hi][-depth:]
        if not hits:
            return 404, {"error": {"httpCode": 404, "message": "trace not found"}}
        return 200, {"result": {"resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "j"}}]},
            "scopeSpans": [{"scope": {}, "spans": [
                {"traceId": t, "spanId": t[16:], "name": "train.step", "kind": 1,
                 "startTimeUnixNano": str(s), "endTimeUnixNano": str(s + 5),
                 "attributes": [{"key": "flare.step", "value": {"intValue": str(int(t, 16))}}]}
                for t, s in hits]}]}]}}

    recorded_server.answer("/api/v3/services", {"services": ["j"]})
    recorded_server.routes["/api/v3/traces"] = find
    backend = JaegerBackend(recorded_server.url, search_depth=4)
    table = backend.fetch("j", ["train.step"])
    assert sorted(table.column("trace_id").to_pylist()) == sorted(t for t, _ in spans)
    assert len(recorded_server.requests) < 60  # split where needed, not span by span


def test_unreachable_backend_is_one_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = JaegerBackend(f"http://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(BackendError, match=r"cannot reach Jaeger at http://127.0.0.1:\d+"):
        backend.jobs()


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (500, b"internal error", "answered HTTP 500"),
        (200, b"<html>not json</html>", "not JSON"),
        (401, b"unauthorized", "bearer token"),
        (200, b'{"services": "nope"}', "not a list"),
    ],
)
def test_unexpected_answers_are_one_clear_error(recorded_server, status, body, message):
    recorded_server.answer("/api/v3/services", body, status=status)
    with pytest.raises(BackendError, match=message) as info:
        JaegerBackend(recorded_server.url).jobs()
    assert "\n" not in str(info.value)


def test_slow_backend_times_out(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/v3/services", jaeger_fixture("apiv3_GetServices.json"))
    recorded_server.delay_s = 2.0
    with pytest.raises(BackendError, match=r"did not answer within 0\.5 s"):
        JaegerBackend(recorded_server.url, timeout_s=0.5).jobs()


def test_bearer_token_is_sent(recorded_server, jaeger_fixture):
    recorded_server.answer("/api/v3/services", jaeger_fixture("apiv3_GetServices.json"))
    JaegerBackend(recorded_server.url, bearer_token="s3cret").jobs()
    assert recorded_server.requests[-1][2]["Authorization"] == "Bearer s3cret"


def test_ids_in_hex_short_hex_and_base64():
    assert hex_id("5B8EFFF798038103D269B633813FC700", 16) == "5b8efff798038103d269b633813fc700"
    assert hex_id("W47/95gDgQPSabYzgT/HAA==", 16) == "5b8efff798038103d269b633813fc700"
    assert hex_id("7uGbfsPBsQA=", 8) == "eee19b7ec3c1b100"
    assert hex_id("d6e9329d67b6146a", 16) == "0000000000000000d6e9329d67b6146a"
    with pytest.raises(BackendError, match="malformed id"):
        hex_id("not an id!", 16)
