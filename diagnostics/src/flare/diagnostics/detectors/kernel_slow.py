"""kernel_slow: the same kernel on the same shapes runs slower than it should.

Two references, as in the paper:
- peers: per (kernel name, shapes) the median duration on each rank; a rank whose
  median is `PEER_FACTOR` × the peers' median is slow there (a slow GPU, clocks, a bad
  node) — cause `hardware`;
- peak: GEMM/attention kernels whose achieved TFLOPS stay below `PEAK_FRACTION` of the
  datasheet peak for the GPU model and dtype (`kernel_taxonomy.peak_tflops`) while
  taking a real share of the GPU time — an unoptimised kernel, cause `software`.
Kernels that take less than `MIN_TIME_SHARE` of a rank's kernel time are ignored.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.instrumentation import kernel_taxonomy as taxonomy
from flare.instrumentation import semconv as sc

PEER_FACTOR = 1.3
PEAK_FRACTION = 0.10
MIN_SAMPLES = 3
MIN_TIME_SHARE = 0.01


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    table = gm.gpu_activities(job)
    if table.num_rows == 0:
        return []
    table = table.append_column("key", pc.binary_join_element_wise(
        table.column(sc.KERNEL_NAME), pc.fill_null(table.column(sc.KERNEL_SHAPE), ""), "|"))
    per_rank_total = {
        int(r["rank"]): float(r["duration_ns_sum"])
        for r in table.group_by("rank").aggregate([("duration_ns", "sum")]).to_pylist()
    }
    groups = table.group_by(["key", "rank"]).aggregate([
        ("duration_ns", "approximate_median"), ("duration_ns", "count"), ("duration_ns", "sum"),
        ("step", "min"), ("step", "max"),
    ])
    anomalies = _peer_slow(table, groups, per_rank_total)
    anomalies += _below_peak(table, per_rank_total)
    return anomalies


def _peer_slow(table: pa.Table, groups: pa.Table, totals: dict[int, float]) -> list[Anomaly]:
    rows = [r for r in groups.to_pylist() if r["duration_ns_count"] >= MIN_SAMPLES]
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    slow: dict[int, list[dict]] = {}
    compared: dict[int, int] = {}
    for key, entries in by_key.items():
        if len(entries) < 2:
            continue
        for entry in entries:
            rank = int(entry["rank"])
            compared[rank] = compared.get(rank, 0) + 1
            peers = [e["duration_ns_approximate_median"] for e in entries if e is not entry]
            reference = float(np.median(peers))
            mine = float(entry["duration_ns_approximate_median"])
            if reference > 0 and mine >= PEER_FACTOR * reference and \
                    entry["duration_ns_sum"] >= MIN_TIME_SHARE * totals[rank]:
                extra = (mine - reference) * entry["duration_ns_count"]
                slow.setdefault(rank, []).append({
                    "kernel": key.split("|", 1)[0][:160], "shape": key.split("|", 1)[1] or None,
                    "median_us": round(mine / 1e3, 3), "peer_median_us": round(reference / 1e3, 3),
                    "ratio": round(mine / reference, 3), "extra_ns": extra,
                    "first_step": entry["step_min"], "last_step": entry["step_max"],
                })
    anomalies = []
    ranks_col = table.column("rank").to_numpy(zero_copy_only=False)
    for rank, kernels in slow.items():
        kernels.sort(key=lambda k: -k["extra_ns"])
        impact = sum(k["extra_ns"] for k in kernels) / max(totals[rank], 1.0)
        worst = kernels[0]
        firsts = [k["first_step"] for k in kernels if k["first_step"] is not None]
        lasts = [k["last_step"] for k in kernels if k["last_step"] is not None]
        anomalies.append(Anomaly(
            kind="kernel_slow", ranks=[rank], cause="hardware",
            first_step=min(firsts) if firsts else None, last_step=max(lasts) if lasts else None,
            impact=min(1.0, impact),
            confidence=min(0.99, 0.5 + 0.5 * len(kernels) / max(compared.get(rank, 1), 1)),
            summary=(f"rank {rank} runs {len(kernels)} kernel(s) slower than its peers on the "
                     f"same shapes; worst {worst['kernel'][:60]} at {worst['ratio']:.1f}x"),
            evidence={"reference": "peers", "kernels": [
                {k: v for k, v in entry.items() if k != "extra_ns"} for entry in kernels[:10]],
                "kernels_compared": compared.get(rank, 0)},
            trace_ids=gm.trace_ids_of(table, ranks_col == rank),
        ))
    return anomalies


def _below_peak(table: pa.Table, totals: dict[int, float]) -> list[Anomaly]:
    compute = table.filter(pc.and_(
        pc.is_in(table.column(sc.KERNEL_CATEGORY), pa.array([taxonomy.GEMM, taxonomy.ATTENTION])),
        pc.is_valid(table.column(sc.KERNEL_ACHIEVED_TFLOPS))))
    if compute.num_rows == 0:
        return []
    models = _gpu_models(compute)
    groups = compute.group_by(["key", "rank", sc.KERNEL_NAME, sc.KERNEL_DTYPE]).aggregate([
        (sc.KERNEL_ACHIEVED_TFLOPS, "approximate_median"), ("duration_ns", "sum"),
        ("duration_ns", "count"), ("step", "min"), ("step", "max")])
    slow: dict[int, list[dict]] = {}
    for row in groups.to_pylist():
        rank = int(row["rank"])
        dtype = taxonomy.compute_dtype(row[sc.KERNEL_NAME], row[sc.KERNEL_DTYPE])
        peak = taxonomy.peak_tflops(models.get(rank), dtype)
        if peak is None or row["duration_ns_count"] < MIN_SAMPLES:
            continue
        achieved = float(row[f"{sc.KERNEL_ACHIEVED_TFLOPS}_approximate_median"])
        if achieved < PEAK_FRACTION * peak and row["duration_ns_sum"] >= 0.05 * totals[rank]:
            slow.setdefault(rank, []).append({
                "kernel": row[sc.KERNEL_NAME][:160], "shape": row["key"].split("|", 1)[1] or None,
                "dtype": dtype, "achieved_tflops": round(achieved, 3), "peak_tflops": peak,
                "fraction_of_peak": round(achieved / peak, 4),
                "time_share": round(row["duration_ns_sum"] / totals[rank], 4),
                "first_step": row["step_min"], "last_step": row["step_max"],
            })
    anomalies = []
    for rank, kernels in slow.items():
        kernels.sort(key=lambda k: -k["time_share"])
        share = sum(k["time_share"] for k in kernels)
        firsts = [k["first_step"] for k in kernels if k["first_step"] is not None]
        lasts = [k["last_step"] for k in kernels if k["last_step"] is not None]
        anomalies.append(Anomaly(
            kind="kernel_slow", ranks=[rank], cause="software",
            first_step=min(firsts) if firsts else None, last_step=max(lasts) if lasts else None,
            impact=min(1.0, share), confidence=0.7,
            summary=(f"rank {rank}: {len(kernels)} GEMM/attention kernel(s) taking "
                     f"{share:.0%} of GPU time reach under {PEAK_FRACTION:.0%} of the "
                     f"{models.get(rank)} peak (best {max(k['fraction_of_peak'] for k in kernels):.1%})"),
            evidence={"reference": "peak", "gpu_model": models.get(rank),
                      "kernels": kernels[:10]},
            trace_ids=gm.trace_ids_of(table, table.column("rank").to_numpy(
                zero_copy_only=False) == rank),
        ))
    return anomalies


def _gpu_models(table: pa.Table) -> dict[int, str]:
    models: dict[int, str] = {}
    for rank, resource in zip(table.column("rank").to_pylist(), table.column("resource").to_pylist(),
                              strict=True):
        if rank in models or not resource:
            continue
        try:
            model = json.loads(resource).get(sc.GPU_MODEL)
        except ValueError:
            model = None
        if model:
            models[int(rank)] = model
    return models
