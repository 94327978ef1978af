"""`--baseline-job` on two imported profiler traces names what grew, from their kernels,
and says when the two jobs are not like for like (real traces from ../shared/data/kineto)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KINETO = Path(__file__).resolve().parents[3] / "shared" / "data" / "kineto"
BASELINE, CURRENT = "ws16_rank0.json.gz", "dp128_rank0_steps551-552.json.gz"


def _flare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_regression_between_imports_names_the_kernels_that_grew(tmp_path):
    if not (KINETO / BASELINE).exists() or not (KINETO / CURRENT).exists():
        pytest.skip(f"the public profiler traces are not in {KINETO} (../shared/data/kineto)")
    store = tmp_path / "k.duckdb"
    for job, name in (("ws16", BASELINE), ("dp128", CURRENT)):
        folder = tmp_path / job
        folder.mkdir()
        shutil.copy(KINETO / name, folder / name)
        assert _flare("import-kineto", str(folder), "--store", str(store), "--job", job).returncode == 0
    result = _flare("diagnose", "--store", str(store), "--job", "dp128", "--baseline-job", "ws16",
                    "--format", "json")
    report = json.loads(result.stdout)
    regression = [a for a in report["anomalies"] if a["kind"] == "regression"]
    assert len(regression) == 1, report
    label = regression[0]
    # Imported steps carry no breakdown: the parts come from the kernel spans.
    grew = label["evidence"]["grew"]
    assert grew and set(grew) <= {"gpu_compute", "memcpy", "collectives", "cpu_ops", "gpu_idle"}
    assert "no single part" not in label["summary"]
    assert "collective kernels +" in label["summary"] or "GPU idle +" in label["summary"]
    # Not like for like: 16 ranks then, 128 now (both in the traces' distributed info).
    assert "flare.world_size 16 → 128" in label["evidence"]["differences"]
    assert "not like for like: flare.world_size 16 → 128" in label["summary"]
