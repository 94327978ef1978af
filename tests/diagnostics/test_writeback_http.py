"""Anomaly spans written back over OTLP/HTTP reach a real collector's store, links and
all; a refusal is one line."""

from __future__ import annotations

import pytest

from flare.diagnostics import writeback
from flare.diagnostics.model import Anomaly
from flare.exporters import store as flare_store


def test_anomaly_spans_sent_over_http_are_stored_with_their_links(tmp_path):
    from flare.collector.config import embedded_config
    from flare.collector.service import Collector

    collector = Collector(embedded_config(tmp_path / "store.duckdb"))
    collector.start()
    try:
        anomaly = Anomaly(kind="straggler", ranks=[2], cause="compute", first_step=40, last_step=99,
                          impact=0.5, confidence=0.9, summary="rank 2 is slow")
        link = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
        request = writeback.anomaly_spans("job-w", [anomaly], {anomaly.key: [link]})
        writeback.send_otlp(f"http://{collector.http_endpoint}/v1/traces", request)
        assert collector.flush(30)
    finally:
        collector.stop(10)
    con = flare_store.open_reader(tmp_path / "store.duckdb")
    try:
        rows = con.execute("SELECT links FROM spans WHERE job = 'job-w' AND name = 'flare.anomaly'").fetchall()
    finally:
        con.close()
    assert len(rows) == 1 and link[1] in rows[0][0]


def test_a_refused_http_writeback_is_one_line(tmp_path):
    from flare.collector.config import embedded_config
    from flare.collector.service import Collector

    collector = Collector(embedded_config(tmp_path / "store.duckdb"))
    collector.start()
    try:
        with pytest.raises(writeback.WritebackError, match=r"HTTP 404"):
            writeback.send_otlp(f"http://{collector.http_endpoint}/v1/nothing/v1/traces",
                                writeback.anomaly_spans("job-w", []))
    finally:
        collector.stop(10)
