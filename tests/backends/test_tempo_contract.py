"""TempoBackend against the responses printed in Tempo's API documentation
(tests/fixtures/tempo/README.md), served by a real loopback server."""

from __future__ import annotations

import base64
import json
import re
import socket
import time

import pyarrow as pa
import pytest

from flare.collector.trace_json import otlp_resource_spans
from flare.diagnostics.backends import BackendError, open_backend
from flare.diagnostics.backends.tempo import TempoBackend, traceql_filter
from flare.diagnostics.synthetic import Fault, job_spans
from flare.wire import semconv as sc

DOC_TRACE = "5b8efff798038103d269b633813fc700"


def test_jobs_from_v2_tag_values_then_v1(recorded_server, tempo_fixture):
    recorded_server.answer(
        "/api/v2/search/tag/resource.service.name/values",
        tempo_fixture("tag_values_v2_service_name.json"),
    )
    backend = open_backend(f"tempo+{recorded_server.url}")
    assert isinstance(backend, TempoBackend)
    assert backend.jobs() == sorted(
        ["article-service", "postgres", "cart-service", "billing-service", "shop-backend",
         "auth-service"]
    )
    del recorded_server.routes["/api/v2/search/tag/resource.service.name/values"]
    recorded_server.answer(
        "/api/search/tag/service.name/values", tempo_fixture("tag_values_service_name.json")
    )
    assert "shop-backend" in backend.jobs()


def test_jobs_are_flare_job_ids_where_tempo_holds_them(recorded_server):
    """Two jobs under one service name (OTEL_SERVICE_NAME=trainer) are two jobs, as in
    the store: listed by flare.job.id, each searched by it."""
    recorded_server.answer("/api/v2/search/tag/resource.flare.job.id/values", {
        "tagValues": [{"type": "string", "value": "train-20261201-101500-ab12"},
                      {"type": "string", "value": "train-20261201-113000-cd34"}]})
    recorded_server.answer("/api/v2/search/tag/resource.service.name/values", {
        "tagValues": [{"type": "string", "value": "trainer"}]})
    backend = open_backend(f"tempo+{recorded_server.url}")
    assert backend.jobs() == ["train-20261201-101500-ab12", "train-20261201-113000-cd34"]
    assert traceql_filter("train-20261201-101500-ab12", None, None, None, None).startswith(
        '{ (resource.flare.job.id = "train-20261201-101500-ab12" || resource.service.name = ')


def test_traceql_search_then_trace_by_id(recorded_server, tempo_fixture):
    recorded_server.answer("/api/search", tempo_fixture("search_traceql_service_name.json"))
    recorded_server.answer(f"/api/v2/traces/{DOC_TRACE}", tempo_fixture("trace_v2_by_id.json"))
    backend = TempoBackend(recorded_server.url, limit=50, lookback_s=3 * 365 * 86400)
    table = backend.fetch("my.service", ["I am a span!"])
    rows = table.to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert row["trace_id"] == DOC_TRACE  # from base64 "W47/95gDgQPSabYzgT/HAA=="
    assert row["span_id"] == "eee19b7ec3c1b100"  # from base64 "7uGbfsPBsQA="
    assert row["kind"] == 2  # "SPAN_KIND_SERVER"
    assert row["service"] == "my.service"
    assert json.loads(row["attributes"]) == {"my.span.attr": "some value"}
    assert row["end_ns"] - row["start_ns"] == 698_000_000_000
    search = next(q for p, q, _ in recorded_server.requests if p == "/api/search")
    assert search["q"] == ['{ (resource.flare.job.id = "my.service" || resource.service.name = '
                           '"my.service") && (name = "I am a span!") }']
    assert search["limit"] == ["50"] and search["spss"] == ["1"]
    assert int(search["start"][0]) < int(search["end"][0])


def test_short_hex_ids_from_tag_search_are_padded(recorded_server, tempo_fixture):
    recorded_server.answer("/api/search", tempo_fixture("search_tags_min_duration.json"))
    backend = TempoBackend(recorded_server.url)
    assert backend.fetch("frontend", ["/cart"]).num_rows == 0  # traces gone since
    asked = [p for p in recorded_server.paths() if p.startswith("/api/")]
    assert "/api/v2/traces/0000000000000000d6e9329d67b6146a" in asked
    assert "/api/traces/00000000000000001b1ba462b409200d" in asked  # v1 tried on 404


def test_search_answer_with_spansets_only(recorded_server, tempo_fixture):
    recorded_server.answer("/api/search", tempo_fixture("search_traceql_status_error.json"))
    backend = TempoBackend(recorded_server.url)
    assert backend.search("{ status = error }", (0, time.time_ns())) == [
        "2f3e0cee77ae5dc9c17ade3689eb2e54"
    ]


def test_v1_trace_endpoint_when_v2_is_absent(recorded_server, tempo_fixture):
    unwrapped = tempo_fixture("trace_v2_by_id.json")["trace"]
    recorded_server.answer(f"/api/traces/{DOC_TRACE}", {"batches": unwrapped["resourceSpans"]})
    backend = TempoBackend(recorded_server.url)
    assert backend.trace(DOC_TRACE).column("name").to_pylist() == ["I am a span!"]
    assert backend.trace("W47/95gDgQPSabYzgT/HAA==").num_rows == 1  # base64 id accepted
    assert backend._trace_api_v2 is False


def test_traceql_filter_pushes_job_names_steps_and_ranks():
    q = traceql_filter("job \"x\"", ["train.step", "collective.*"], 10, 20, [3, 1])
    assert q == (
        '{ (resource.flare.job.id = "job \\"x\\"" || resource.service.name = "job \\"x\\"") && '
        '(name = "train.step" || '
        'name =~ "collective\\\\..*") && span.flare.step >= 10 && span.flare.step <= 20 && '
        "(resource.flare.rank = 1 || resource.flare.rank = 3) }"
    )
    assert "flare.rank" not in traceql_filter("j", None, None, None, list(range(100)))


def test_unreachable_and_unexpected_answers(recorded_server):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendError, match="cannot reach Tempo"):
        TempoBackend(f"http://127.0.0.1:{port}").jobs()
    recorded_server.answer("/api/search", {"traces": [{"rootServiceName": "x"}]})
    with pytest.raises(BackendError, match="without a traceID"):
        TempoBackend(recorded_server.url).fetch("x", ["train.step"])
    recorded_server.answer("/api/search", b"upstream connect error", status=502)
    with pytest.raises(BackendError, match="HTTP 502"):
        TempoBackend(recorded_server.url).fetch("x", ["train.step"])


class SimulatedTempo:
    """Answers /api/search and /api/v2/traces like Tempo from a span table: evaluates the
    TraceQL terms the adapter sends, caps results at `limit`, prints ids in base64."""

    def __init__(self, table):
        self.rows = table.to_pylist()

    def search(self, query):
        q = query["q"][0]
        lo, hi = int(query["start"][0]) * 10**9, int(query["end"][0]) * 10**9
        step_lo = re.search(r"span.flare.step >= (\d+)", q)
        step_hi = re.search(r"span.flare.step <= (\d+)", q)
        ranks = [int(r) for r in re.findall(r"resource.flare.rank = (\d+)", q)]
        found = {}
        for row in self.rows:
            if not lo <= row["start_ns"] <= hi:
                continue
            if step_lo and row["step"] < int(step_lo.group(1)):
                continue
            if step_hi and row["step"] > int(step_hi.group(1)):
                continue
            if ranks and row["rank"] not in ranks:
                continue
            found[row["trace_id"].lstrip("0")] = row["start_ns"]
        ids = sorted(found, key=found.get)[-int(query["limit"][0]):]
        return 200, {"traces": [{"traceID": t} for t in ids], "metrics": {}}

    def trace(self, trace_id):
        rows = [r for r in self.rows if r["trace_id"] == trace_id]
        resource_spans = otlp_resource_spans(rows)
        for rs in resource_spans:
            for span in rs["scopeSpans"][0]["spans"]:
                span["traceId"] = base64.b64encode(bytes.fromhex(span["traceId"])).decode()
                span["spanId"] = base64.b64encode(bytes.fromhex(span["spanId"])).decode()
                span["kind"] = "SPAN_KIND_INTERNAL"
        return 200, {"trace": {"resourceSpans": resource_spans}}


def test_diagnosis_input_through_simulated_tempo_matches_the_table(recorded_server):
    start = time.time_ns() - 3600 * 10**9
    table = job_spans("jobT", world=4, steps=24, start_ns=start,
                      faults=(Fault("compute", rank=1, from_step=8),))
    # One step every 1.5 s, so that Tempo's one-second search windows can separate them.
    shift = [r["step"] * 1_500_000_000 for r in table.to_pylist()]
    table = table.set_column(
        table.schema.get_field_index("start_ns"), "start_ns",
        pa.array([s + d for s, d in zip(table["start_ns"].to_pylist(), shift, strict=True)]),
    ).set_column(
        table.schema.get_field_index("end_ns"), "end_ns",
        pa.array([s + d for s, d in zip(table["end_ns"].to_pylist(), shift, strict=True)]),
    )
    tempo = SimulatedTempo(table)
    recorded_server.routes["/api/search"] = tempo.search
    for trace_id in set(table.column("trace_id").to_pylist()):
        recorded_server.routes[f"/api/v2/traces/{trace_id}"] = (
            lambda _q, t=trace_id: tempo.trace(t)
        )
    backend = TempoBackend(recorded_server.url, limit=5)  # forces window splitting
    data = backend.job_data("jobT")
    summary = data.step_summary([sc.STEP_COLLECTIVE_WAIT_MS])
    assert summary.num_rows == 4 * 24
    waits = {(r["rank"], r["step"]): r[sc.STEP_COLLECTIVE_WAIT_MS] for r in summary.to_pylist()}
    expected = {
        (r["rank"], r["step"]): json.loads(r["attributes"])[sc.STEP_COLLECTIVE_WAIT_MS]
        for r in table.to_pylist()
    }
    assert waits == pytest.approx(expected)
    # A narrow question after the first: the learnt step times narrow the window.
    before = len(recorded_server.requests)
    assert data.spans([sc.SPAN_STEP], first_step=20, last_step=21, ranks=[1]).num_rows == 2
    assert len(recorded_server.requests) - before <= 4


def test_what_a_diagnosis_pulls_from_tempo(recorded_server):
    """The Tempo path's cost, stated in docs/backends.md: a whole diagnosis of a 4-rank,
    20-step job through the simulated Tempo (a search, then every step's whole trace as
    OTLP JSON), in bytes received per span the job stored."""
    from flare.diagnostics.model import DiagnosisConfig
    from flare.diagnostics.pipeline import diagnose

    start = time.time_ns() - 3600 * 10**9
    table = job_spans("jobB", world=4, steps=20, start_ns=start, bytes_per_step=1 << 20,
                      faults=(Fault("compute", rank=3, from_step=6),))
    shift = [r["step"] * 1_500_000_000 for r in table.to_pylist()]
    for column in ("start_ns", "end_ns"):
        table = table.set_column(table.schema.get_field_index(column), column, pa.array(
            [s + d for s, d in zip(table[column].to_pylist(), shift, strict=True)]))
    tempo = SimulatedTempo(table)
    recorded_server.routes["/api/search"] = tempo.search
    for trace_id in set(table.column("trace_id").to_pylist()):
        recorded_server.routes[f"/api/v2/traces/{trace_id}"] = lambda _q, t=trace_id: tempo.trace(t)
    found = diagnose(TempoBackend(recorded_server.url).job_data("jobB"), DiagnosisConfig(),
                     warn=lambda _: None).anomalies
    assert [(a.kind, a.ranks, a.cause) for a in found] == [("straggler", [3], "compute")]
    per_span = recorded_server.bytes_sent / table.num_rows
    traces = sum(1 for p in recorded_server.paths() if p.startswith("/api/v2/traces/"))
    print(f"\nTEMPO pulled {recorded_server.bytes_sent:,} bytes for {table.num_rows} spans "
          f"({per_span:,.0f} bytes per span; {traces} trace fetches)")
    assert traces >= 20 and per_span > 500  # every step's whole trace, as OTLP JSON


def test_more_traces_per_second_than_the_limit_raises_the_limit(recorded_server):
    start = time.time_ns() - 600 * 10**9
    table = job_spans("jobF", world=2, steps=30, start_ns=start)  # 30 steps in ~2 s
    tempo = SimulatedTempo(table)
    recorded_server.routes["/api/search"] = tempo.search
    for trace_id in set(table.column("trace_id").to_pylist()):
        recorded_server.routes[f"/api/v2/traces/{trace_id}"] = (
            lambda _q, t=trace_id: tempo.trace(t)
        )
    assert TempoBackend(recorded_server.url, limit=4).fetch("jobF", [sc.SPAN_STEP]).num_rows == 60
