"""Kernel windows end to end: a real 2-rank gloo torchrun job under `flare run`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.backends.store import StoreBackend
from flare.wire import semconv as sc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_detail_steps_of_every_rank_carry_kernel_spans(tmp_path):
    store = tmp_path / "store.duckdb"
    env = dict(os.environ, FLARE_DETAIL_EVERY="10")
    env[sc.ENV_KERNEL_WINDOWS] = "1"  # CPU-only here: host windows are opt-in
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run(
        [str(bin_dir / "flare"), "run", "--store", str(store), "--job", "windows", "--no-diagnose",
         "--", str(bin_dir / "torchrun"), "--nproc_per_node", "2",
         str(ROOT / "examples/train_ddp.py"), "--steps", "25"],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "profiler_start" not in proc.stderr  # Kineto's per-window log lines are quiet
    job = StoreBackend(store).job_data("windows")
    kernels = job.spans([sc.SPAN_KERNEL], attributes=list(gm.KERNEL_ATTRIBUTES))
    rows = kernels.to_pylist()
    assert {r["rank"] for r in rows} == {0, 1}
    assert {r["step"] for r in rows} == {0, 10, 20}  # FLARE_DETAIL_EVERY=10, 25 steps
    steps = job.spans([sc.SPAN_STEP], attributes=[sc.STEP_DETAIL])
    step_ids = {(r["rank"], r["step"]): r["span_id"] for r in steps.to_pylist()}
    assert all(r["parent_span_id"] == step_ids[(r["rank"], r["step"])] for r in rows)
    assert all(r[sc.KERNEL_DEVICE] == sc.KERNEL_DEVICE_HOST for r in rows)
    gemm = [r for r in rows if r[sc.KERNEL_CATEGORY] == "gemm" and r[sc.KERNEL_FLOPS]]
    assert gemm, "the model's linear layers appear with FLOPs from their shapes"
