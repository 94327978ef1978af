"""Checks the store and diagnosis of the GPU job (tests/gpu/run_gpu_checks.sh).

    python tests/gpu/check_gpu_results.py --store S --diagnosis D --slow-rank 1 --out DIR

Writes DIR/results.json and prints one PASS/FAIL/N/A line per check; exit 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.backends.store import StoreBackend
from flare.exporters import store as flare_store
from flare.wire import kernel_taxonomy as taxonomy
from flare.wire import semconv as sc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--diagnosis", required=True)
    parser.add_argument("--job", default="gpu-check")
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    results: list[dict] = []

    def check(name: str, ok: bool | None, **figures) -> None:
        status = "N/A" if ok is None else ("PASS" if ok else "FAIL")
        results.append({"check": name, "status": status, **figures})
        print(f"{status:4} {name} {json.dumps(figures, default=str)}")

    job = StoreBackend(args.store).job_data(args.job)
    ranks = job.ranks()
    check("both ranks reported", len(ranks) >= 2, ranks=ranks)

    kernels = gm.gpu_activities(job)
    categories = kernels.column(sc.KERNEL_CATEGORY).to_pylist() if kernels.num_rows else []
    check("kernel spans from sampled windows", kernels.num_rows > 0 and "gemm" in categories,
          kernels=kernels.num_rows, categories=sorted(set(categories)),
          steps=sorted({s for s in kernels.column("step").to_pylist() if s is not None})[:20]
          if kernels.num_rows else [])
    if kernels.num_rows:
        latency = kernels.column(sc.KERNEL_ISSUE_LATENCY_US).to_numpy(zero_copy_only=False).astype(float)
        joined = float(np.mean(~np.isnan(latency)))
        check("issue latency joined by CUPTI correlation", joined > 0.9 and np.nanmin(latency) >= 0,
              joined_share=round(joined, 3), p50_us=round(gm.percentile(latency, 50), 1),
              p90_us=round(gm.percentile(latency, 90), 1))
        tflops = kernels.column(sc.KERNEL_ACHIEVED_TFLOPS).to_numpy(zero_copy_only=False).astype(float)
        gemm = np.array([c == "gemm" for c in categories]) & ~np.isnan(tflops)
        model = None
        resource = kernels.column("resource")[0].as_py()
        if resource:
            model = json.loads(resource).get(sc.GPU_MODEL)
        peak = taxonomy.peak_tflops(model or "H200", "bf16")
        best = float(np.nanmax(tflops[gemm])) if gemm.any() else float("nan")
        check("GEMM achieved TFLOPS from shapes", bool(gemm.any()) and 1 < best <= 1.05 * peak,
              gemm_kernels=int(gemm.sum()), best_tflops=round(best, 1), peak_tflops=peak,
              gpu_model=model)
        shares = gm.void_shares(kernels)
        check("GPU void share per step computed", bool(shares),
              median_by_rank={r: round(float(np.median([v for _, v, _ in rows])), 3)
                              for r, rows in shares.items()})

    collectives = job.spans([sc.SPAN_COLLECTIVE_PREFIX + "*"], attributes=[
        sc.COLL_BACKEND, sc.COLL_DEVICE_START_NS, sc.COLL_DEVICE_END_NS, sc.COLL_BUSBW_GBPS])
    timed = 0
    if collectives.num_rows:
        start = collectives.column(sc.COLL_DEVICE_START_NS).to_numpy(zero_copy_only=False).astype(float)
        timed = int(np.sum(~np.isnan(start)))
    if args.backend == "nccl":
        check("NCCL collectives timed on the device (CUDA events)", timed > 0,
              collective_spans=collectives.num_rows, device_timed=timed)
    else:
        check("NCCL collectives timed on the device (CUDA events)", None,
              reason=f"backend {args.backend}: NCCL refuses two ranks on one GPU",
              collective_spans=collectives.num_rows, device_timed=timed)

    con = flare_store.open_reader(args.store)
    try:
        rows = con.execute(
            "SELECT rank, count(*) FROM metrics WHERE name = ? GROUP BY rank ORDER BY rank",
            [sc.METRIC_GPU_UTILIZATION]).fetchall()
        names = [r[0] for r in con.execute(
            "SELECT DISTINCT name FROM metrics WHERE name LIKE 'hw.%' OR name LIKE 'flare.gpu.%'"
        ).fetchall()]
    finally:
        con.close()
    check("NVML metrics labelled with ranks", len(rows) >= 2,
          points_by_rank=dict(rows), metric_names=sorted(names))
    steps = job.spans([sc.SPAN_STEP], attributes=[sc.STEP_GPU_SM_CLOCK_MHZ, sc.STEP_GPU_THROTTLE])
    clocks = steps.column(sc.STEP_GPU_SM_CLOCK_MHZ).to_numpy(zero_copy_only=False).astype(float) \
        if steps.num_rows else np.array([])
    check("SM clock attached to step spans", bool(np.sum(~np.isnan(clocks))),
          steps_with_clock=int(np.sum(~np.isnan(clocks))), steps=steps.num_rows)

    diagnosis = json.loads(Path(args.diagnosis).read_text())
    labels = [(a["kind"], a["ranks"], a["cause"]) for a in diagnosis.get("anomalies", [])]
    on_slow = [a for a in labels if a[1] == [args.slow_rank]
               and a[0] in ("straggler", "fail_slow", "kernel_slow")]
    check("injected GEMM slowdown labelled on the slow rank", bool(on_slow),
          slow_rank=args.slow_rank, anomalies=labels)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
