"""The `otlp` forward path: to a live OTLP endpoint, and to a dead one."""

from __future__ import annotations

import socket
import time

from flare.exporters import store


def _count(store_path, job):
    con = store.open_reader(store_path, timeout_s=30)
    try:
        return con.execute("SELECT count(*) FROM spans WHERE job = ?", [job]).fetchone()[0]
    finally:
        con.close()


def _forwarding_config(helpers, store_path, endpoint, protocol):
    config = helpers.base_config(store_path, drain_timeout="8s")
    config["exporters"]["otlp/forward"] = {
        "endpoint": endpoint, "protocol": protocol,
        "retry_on_failure": {"initial_interval": "100ms", "max_interval": "500ms"},
        "shutdown_timeout": "1s",
    }
    for pipeline in config["service"]["pipelines"].values():
        pipeline["exporters"].append("otlp/forward")
    return config


def test_forwards_to_another_collector_over_grpc_and_http(collector_process, helpers, tmp_path):
    downstream = collector_process(helpers.base_config(tmp_path / "down.duckdb"), name="down").start()
    for protocol, endpoint in (("grpc", downstream.grpc), ("http", f"http://{downstream.http}")):
        job = f"forward-{protocol}"
        config = _forwarding_config(helpers, tmp_path / f"up-{protocol}.duckdb", endpoint, protocol)
        upstream = collector_process(config, name=f"up-{protocol}").start()
        for r in range(5):
            status, _, _ = helpers.post(f"http://{upstream.http}/v1/traces",
                                        helpers.make_request(20, job=job, first_index=r * 20).SerializeToString())
            assert status == 200
        assert upstream.terminate() == 0
        assert _count(upstream.store_path, job) == 100
        last = downstream.scrape()["flare_collector_wal_last_lsn"]
        downstream.wait_for("flare_collector_wal_committed_lsn", lambda v, last=last: v >= last)
        assert _count(downstream.store_path, job) == 100


def test_dead_forward_target_does_not_stall_the_store(collector_process, helpers, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    config = _forwarding_config(helpers, tmp_path / "store.duckdb", f"127.0.0.1:{dead_port}", "grpc")
    proc = collector_process(config).start()
    started = time.monotonic()
    for r in range(20):
        status, _, _ = helpers.post(f"http://{proc.http}/v1/traces",
                                    helpers.make_request(50, job="dead-forward", first_index=r * 50).SerializeToString())
        assert status == 200
    last = proc.scrape()["flare_collector_wal_last_lsn"]
    proc.wait_for("flare_collector_wal_committed_lsn", lambda v: v >= last, timeout_s=10)
    assert time.monotonic() - started < 10  # the store path never waited on the forwarder
    assert _count(proc.store_path, "dead-forward") == 1000
    metrics = proc.scrape()
    assert metrics.get("flare_collector_exporter_sent_requests", 0) == 0
    assert metrics["flare_collector_exporter_retries"] + metrics["flare_collector_exporter_failed_requests"] > 0
    assert metrics["flare_collector_exporter_failing"] == 1
    # said, but not once per retry: the first failure at once, then every 30 s at most
    said = [line for line in proc.log().splitlines() if "is failing" in line]
    assert 1 <= len(said) <= 2 and f"127.0.0.1:{dead_port}" in said[0], said
    started = time.monotonic()
    assert proc.terminate() == 0  # the forwarder gets its shutdown_timeout, then gives up
    assert time.monotonic() - started < 8
