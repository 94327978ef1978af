"""What an OK reply guarantees, tested on a real collector process.

Guarantee: once the collector answered OK, the request is in its write-ahead log; a
`kill -9` of the collector loses none of it, and the next start puts every such span
into the store exactly once (the store commits the log position with the rows).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from flare.exporters import store

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _send_batch(helpers, proc, first_index: int, requests: int, spans: int) -> set[str]:
    """Send requests over HTTP; return the span ids of those acknowledged with 200."""
    acknowledged: set[str] = set()
    for r in range(requests):
        start = first_index + r * spans
        request = helpers.make_request(spans, rank=0, first_index=start)
        status, _, _ = helpers.post(f"http://{proc.http}/v1/traces", request.SerializeToString())
        assert status == 200
        acknowledged |= {s.span_id.hex() for s in request.resource_spans[0].scope_spans[0].spans}
    return acknowledged


def test_kill9_keeps_every_acknowledged_span_exactly_once(collector_process, helpers, tmp_path):
    proc = collector_process().start()
    committed = _send_batch(helpers, proc, 0, requests=10, spans=50)
    last = proc.scrape()["flare_collector_wal_last_lsn"]
    proc.wait_for("flare_collector_wal_committed_lsn", lambda v: v >= last)

    # A reader holds the store: the collector cannot commit, but keeps acknowledging
    # (into its log) — and the reader sees everything committed so far.
    reader = store.open_reader(proc.store_path)
    try:
        assert reader.execute("SELECT count(*) FROM spans WHERE name = 'test.span'").fetchone() == (500,)
        tail = _send_batch(helpers, proc, 10_000, requests=8, spans=50)
        proc.kill9()
    finally:
        reader.close()

    restarted = collector_process(proc.config, name="restarted").start()
    assert restarted.scrape()["flare_collector_replayed_requests_total"] == 8  # exactly the tail
    assert restarted.terminate() == 0
    ids = helpers.stored_span_ids(proc.store_path)
    assert len(ids) == len(set(ids))  # no duplicates
    assert set(ids) == committed | tail  # nothing acknowledged is lost
    assert not list(proc.wal_dir.glob("*.wal"))  # the log is freed once committed


def test_sigterm_drains_everything_into_the_store(collector_process, helpers, tmp_path):
    config = helpers.base_config(tmp_path / "store.duckdb", flush_interval="60s")
    proc = collector_process(config).start()
    sent = _send_batch(helpers, proc, 0, requests=20, spans=100)
    assert proc.scrape()["flare_collector_wal_committed_lsn"] == 0  # nothing flushed yet
    started = time.monotonic()
    assert proc.terminate() == 0
    assert time.monotonic() - started < 10
    assert set(helpers.stored_span_ids(proc.store_path)) == sent
    assert not list(proc.wal_dir.glob("*.wal"))


def _create_store(helpers, proc) -> None:
    """One committed span, so that the store file exists for a reader to hold."""
    status, _, _ = helpers.post(f"http://{proc.http}/v1/traces",
                                helpers.make_request(1, first_index=99_999).SerializeToString())
    assert status == 200
    proc.wait_for("flare_collector_wal_committed_lsn", lambda v: v >= 1)


def _retry_delay_s(err: grpc.RpcError) -> float:
    trailers = dict(err.trailing_metadata())
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert trailers["google.rpc.retryinfo-bin"] == info.SerializeToString()
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def test_full_memory_budget_is_429_and_resource_exhausted_with_retry_info(collector_process, helpers, tmp_path):
    config = helpers.base_config(tmp_path / "store.duckdb")
    config["processors"]["memory_limiter"] = {"limit_mib": "256KiB"}
    proc = collector_process(config).start()
    _create_store(helpers, proc)
    # While a reader holds the store nothing becomes durable, so admitted bytes pile up.
    reader = store.open_reader(proc.store_path)
    try:
        statuses = []
        for r in range(40):
            request = helpers.make_request(100, first_index=r * 100)
            status, headers, _ = helpers.post(f"http://{proc.http}/v1/traces", request.SerializeToString())
            statuses.append(status)
            if status == 429:
                assert int(headers["Retry-After"]) >= 1
                break
        assert statuses[-1] == 429 and statuses.count(200) >= 5
        with grpc.insecure_channel(proc.grpc) as channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(TRACE_METHOD)(helpers.make_request(100, first_index=50_000).SerializeToString(), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _retry_delay_s(err.value) > 0

        # The OTel SDK honours the retry delay and succeeds once the budget frees up.
        provider = TracerProvider(resource=Resource.create({"service.name": "retry", "flare.job.id": "retry-job"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=proc.grpc, insecure=True, timeout=30)))
        done = threading.Event()

        def emit():
            with provider.get_tracer("t").start_as_current_span("retried.span"):
                pass
            done.set()

        thread = threading.Thread(target=emit)
        thread.start()
        time.sleep(1.5)
        assert not done.is_set()  # still backing off while refused
    finally:
        reader.close()
    thread.join(30)
    provider.shutdown()
    assert done.is_set()
    assert proc.terminate() == 0
    con = store.open_reader(proc.store_path)
    assert con.execute("SELECT count(*) FROM spans WHERE name = 'retried.span'").fetchone() == (1,)
    con.close()


def test_full_write_ahead_log_is_503_and_unavailable(collector_process, helpers, tmp_path):
    config = helpers.base_config(tmp_path / "store.duckdb")
    config["extensions"]["flare_wal"].update({"max_size": "96KiB", "segment_size": "32KiB"})
    proc = collector_process(config).start()
    _create_store(helpers, proc)
    reader = store.open_reader(proc.store_path)
    try:
        statuses = []
        for r in range(40):
            request = helpers.make_request(50, first_index=r * 50)
            status, headers, _ = helpers.post(f"http://{proc.http}/v1/traces", request.SerializeToString())
            statuses.append(status)
            if status == 503:
                assert int(headers["Retry-After"]) >= 1
                break
        assert statuses[-1] == 503 and statuses.count(200) >= 3
        with grpc.insecure_channel(proc.grpc) as channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(TRACE_METHOD)(helpers.make_request(50, first_index=60_000).SerializeToString(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _retry_delay_s(err.value) > 0
        assert proc.wal_dir.exists() and sum(p.stat().st_size for p in proc.wal_dir.glob("*.wal")) <= 96 * 1024
    finally:
        reader.close()
    # Once the store is free the log drains and requests are accepted again.
    last = proc.scrape()["flare_collector_wal_last_lsn"]
    proc.wait_for("flare_collector_wal_committed_lsn", lambda v: v >= last)
    status, _, _ = helpers.post(f"http://{proc.http}/v1/traces", helpers.make_request(5, first_index=70_000).SerializeToString())
    assert status == 200


def test_sigterm_while_a_reader_holds_the_store_loses_and_duplicates_nothing(collector_process, helpers, tmp_path):
    config = helpers.base_config(tmp_path / "store.duckdb", drain_timeout="5s")
    config["exporters"]["flare_store"]["timeout_s"] = 1  # give up on the lock quickly
    proc = collector_process(config).start()
    _create_store(helpers, proc)
    first = {(100_000).to_bytes(8, "big").hex()}  # the span _create_store sent
    reader = store.open_reader(proc.store_path)
    try:
        sent = _send_batch(helpers, proc, 0, requests=10, spans=20)
        assert proc.terminate() == 1  # could not drain into the held store
        assert "write-ahead log" in proc.log()
    finally:
        reader.close()
    restarted = collector_process(config, name="restarted").start()
    assert restarted.terminate() == 0
    ids = helpers.stored_span_ids(proc.store_path)
    assert len(ids) == len(set(ids))
    assert set(ids) == sent | first
