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
        first = monitor.check_once()
        alerts.append([(a.kind, a.ranks, a.cause) for a in first + monitor.check_once()])
        if upto == 45:
            assert first == []  # a statistical label is announced when a second pass agrees
    assert alerts[0] == []  # healthy so far
    assert ("straggler", [1], "compute") in alerts[1]
    assert alerts[2] == []  # the same problem is not announced again
    lines = out.getvalue().splitlines()
    assert any("flare: [straggler] ranks 1 cause compute from step 30" in line for line in lines)


def test_a_live_pass_compares_only_the_steps_every_rank_has_sent(tmp_path):
    """Rank 2's spans lag (its batches are late): a live pass sees steps 0-34 of every
    rank, not 35-79 of three ranks only, while hangs, errors and which rank went quiet
    are read whole."""
    from flare.diagnostics import frame
    from flare.diagnostics.backends.store import StoreBackend
    from flare.diagnostics.complete import CompleteSteps
    from flare.diagnostics.model import DiagnosisConfig
    from flare.wire import semconv as sc

    path = tmp_path / "lag.duckdb"
    spans = job_spans("lag", 4, 80, (Fault("compute", 2, 20, extra_ms=60),
                                     Fault("error", 1, 60)))
    steps, ranks = spans["step"].to_pylist(), spans["rank"].to_pylist()
    rows = [i for i, (step, rank) in enumerate(zip(steps, ranks, strict=True))
            if step is None or step < (35 if rank == 2 else 80)]
    with flare_store.writer(path) as con:
        flare_store.insert_spans(con, spans.take(rows))
    backend = StoreBackend(str(path))
    try:
        whole = backend.job_data("lag")
        live = CompleteSteps.of(whole)
        assert whole.steps_range()[1] > 60 and live.steps_range() == (0, 34)
        step_frame = frame.load(live, DiagnosisConfig())
        assert step_frame.steps.max() == 34 and list(step_frame.ranks) == [0, 1, 2, 3]
        assert max(live.spans([sc.SPAN_STEP], columns=["step"]).column("step").to_pylist()) == 34
        assert live.count([sc.SPAN_STEP]) == 35 * 4
        # failures and anything not step-aligned: read whole
        failed = [sc.SPAN_STEP, sc.SPAN_ERROR]
        assert live.spans(failed, columns=["step"], status_code=2).column("step").to_pylist() == [60]
        assert live.count([sc.SPAN_ERROR, sc.SPAN_STEP]) == whole.count([sc.SPAN_ERROR, sc.SPAN_STEP])
        activity = live.rank_activity([sc.SPAN_STEP]).column("last_step").to_pylist()
        assert sorted(activity)[-1] > 60
    finally:
        backend.close()
    # and the live alert names the straggler from these steps
    out = io.StringIO()
    monitor = LiveMonitor(str(path), "lag", out=out)
    first = monitor.check_once()
    assert [a.kind for a in first] == ["error"]  # a rank's own report: at once
    found = first + monitor.check_once()
    kinds = [(a.kind, a.ranks, a.cause) for a in found]
    assert ("straggler", [2], "compute") in kinds
    assert any(kind == "error" and ranks == [1] for kind, ranks, _ in kinds)
    assert all(a.kind != "collective_slow" for a in found)
