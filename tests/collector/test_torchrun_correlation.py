"""A real 4-rank torchrun job (gloo, CPU) exporting to a real collector process.

Checks the collector end to end where it matters most: every rank's steps arrive, and
the correlator's `train.step.ranks` spans in the store line the ranks up and name the
rank with the injected compute slowdown as the culprit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flare.exporters import store
from flare.wire import semconv as sc

REPO = Path(__file__).resolve().parents[2]
STEPS = 24
FAULT_FROM = 8
SLOW_RANK = 2


@pytest.mark.e2e
def test_torchrun_job_is_correlated_across_ranks(collector_process, tmp_path):
    proc = collector_process().start()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ)
    env.update({
        "OTEL_SERVICE_NAME": "collector-e2e",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{proc.grpc}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,flare",
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        sc.ENV_JOB_ID: "collector-e2e-job",
    })
    job = subprocess.run(
        [str(bin_dir / "opentelemetry-instrument"), str(bin_dir / "torchrun"), "--nproc_per_node", "4",
         str(REPO / "examples" / "train_ddp.py"), "--steps", str(STEPS), "--fault", "compute",
         "--fault-rank", str(SLOW_RANK), "--fault-from", str(FAULT_FROM), "--fault-ms", "80"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert proc.terminate() == 0  # drains: the correlator's open windows are flushed too

    con = store.open_reader(proc.store_path)
    try:
        steps = con.execute(
            "SELECT rank, count(DISTINCT step) FROM spans WHERE job = 'collector-e2e-job' "
            "AND name = ? GROUP BY rank ORDER BY rank", [sc.SPAN_STEP]).fetchall()
        correlated = con.execute(
            "SELECT step, attributes, links FROM spans WHERE job = 'collector-e2e-job' AND name = ? "
            "ORDER BY step", [sc.SPAN_STEP_RANKS]).fetchall()
    finally:
        con.close()
    assert steps == [(rank, STEPS) for rank in range(4)]
    assert [row[0] for row in correlated] == list(range(STEPS))  # one per step, none twice
    culprits = []
    for step, attributes, links in correlated:
        attrs = json.loads(attributes)
        assert attrs[sc.RANKS_COUNT] == 4 and len(json.loads(links)) == 4
        culprits.append((step, attrs.get(sc.RANKS_CULPRIT)))
    faulted = [culprit for step, culprit in culprits if step >= FAULT_FROM + 2]
    assert faulted.count(SLOW_RANK) >= 0.8 * len(faulted), culprits
