"""`flare run`'s live alerts: each new anomaly once, as spans keep arriving in the store."""

from __future__ import annotations

import io

from flare.diagnostics.run import LiveMonitor
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store as flare_store


def test_alerts_once_per_anomaly_as_the_job_grows(tmp_path):
    path = tmp_path / "live.duckdb"
    spans = job_spans("live", 4, 60, (Fault("compute", 1, 30),))
    steps = spans["step"].to_pylist()
    out = io.StringIO()
    monitor = LiveMonitor(str(path), "live", out=out)
    assert monitor.check_once() == []  # no store yet: nothing to say, no error
    written = 0
    alerts = []
    for upto in (30, 45, 60):
        rows = [i for i, s in enumerate(steps) if written <= s < upto]
        with flare_store.writer(path) as con:
            flare_store.insert_spans(con, spans.take(rows))
        written = upto
        alerts.append([(a.kind, a.ranks, a.cause) for a in monitor.check_once()])
    assert alerts[0] == []  # healthy so far
    assert ("straggler", [1], "compute") in alerts[1]
    assert alerts[2] == []  # the same problem is not announced again
    lines = out.getvalue().splitlines()
    assert any("flare: [straggler] ranks 1 cause compute from step 30" in line for line in lines)
