"""kernel_slow: the same kernel on the same shapes runs slower than it should.

Two references, as in the paper:
- peers: per (kernel name, shapes) the median duration on each rank; a rank whose
  median is `PEER_FACTOR` × the peers' median (`MIN_PEERS` of them at least) is slow there (a slow GPU, clocks, a bad
  node) — cause `hardware`;
- peak: GEMM/attention kernels whose achieved TFLOPS stay below `PEAK_FRACTION` of the
  datasheet peak for the GPU model and dtype (`kernel_taxonomy.peak_tflops`) while
  taking a real share of the GPU time — an unoptimised kernel, cause `software`.
Kernels that take less than `MIN_TIME_SHARE` of a rank's kernel time are ignored.
Medians are exact (numpy's: the mean of the two middle values for an even count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.columns import Table
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData
from flare.wire import kernel_taxonomy as taxonomy
from flare.wire import semconv as sc

PEER_FACTOR = 1.3
PEAK_FRACTION = 0.10
MIN_SAMPLES = 3
MIN_TIME_SHARE = 0.01
# A kernel is compared where at least this many peers ran it: against one peer either
# rank may be the odd one (two ranks of a real 128-rank job's profile read "rank 1 runs
# 1 kernel(s) slower than its peers", a radix sort whose time follows its data, 2.5x).
MIN_PEERS = 2


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    table = gm.detector_activities(job)
    if table.num_rows == 0:
        return []
    names = table.column(sc.KERNEL_NAME).to_pylist()
    shapes = table.column(sc.KERNEL_SHAPE).to_pylist()
    table = table.append_column("key", [
        None if name is None else f"{name}|{shape or ''}" for name, shape in zip(names, shapes, strict=True)])
    durations = table.column("duration_ns").to_numpy()
    per_rank_total = {
        int(keys[0]): float(durations[rows].sum()) for keys, rows in _groups(table, ["rank"])
    }
    groups = _aggregate(table, ["key", "rank"], "duration_ns")
    anomalies = _peer_slow(table, groups, per_rank_total)
    anomalies += _below_peak(job, table, per_rank_total)
    return anomalies


def _groups(table: Table, keys: Sequence[str]) -> list[tuple[tuple, np.ndarray]]:
    """(key values, row indices) per distinct combination of `keys`, in order of first
    appearance (a null is a key value of its own)."""
    found: dict[tuple, list[int]] = {}
    for index, values in enumerate(zip(*(table.column(k).to_pylist() for k in keys), strict=True)):
        found.setdefault(values, []).append(index)
    return [(values, np.array(rows, dtype=np.int64)) for values, rows in found.items()]


def _aggregate(table: Table, keys: Sequence[str], median_of: str) -> list[dict[str, Any]]:
    """Per group of `keys`: the keys, the median of `median_of`, the count, sum of
    durations and first/last step (nulls skipped, None if all are null)."""
    medians = table.column(median_of).to_numpy().astype(np.float64)
    durations = table.column("duration_ns").to_numpy()
    steps = table.column("step").to_pylist()
    out = []
    for values, rows in _groups(table, keys):
        present = [steps[i] for i in rows.tolist() if steps[i] is not None]
        out.append(dict(zip(keys, values, strict=True)) | {
            "median": float(np.median(medians[rows])), "count": len(rows),
            "duration_ns_sum": int(durations[rows].sum()),
            "step_min": min(present) if present else None,
            "step_max": max(present) if present else None,
        })
    return out


def _peer_slow(table: Table, groups: list[dict[str, Any]], totals: dict[int, float]) -> list[Anomaly]:
    rows = [r for r in groups if r["count"] >= MIN_SAMPLES]
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    slow: dict[int, list[dict]] = {}
    compared: dict[int, int] = {}
    for key, entries in by_key.items():
        if len(entries) < 1 + MIN_PEERS:
            continue
        for entry in entries:
            rank = int(entry["rank"])
            compared[rank] = compared.get(rank, 0) + 1
            peers = [e["median"] for e in entries if e is not entry]
            reference = float(np.median(peers))
            mine = float(entry["median"])
            if reference > 0 and mine >= PEER_FACTOR * reference and \
                    entry["duration_ns_sum"] >= MIN_TIME_SHARE * totals[rank]:
                extra = (mine - reference) * entry["count"]
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
                     f"same shapes; worst {short_name(worst['kernel'])} at {worst['ratio']:.1f}x"),
            evidence={"reference": "peers", "kernels": [
                {k: v for k, v in entry.items() if k != "extra_ns"} for entry in kernels[:10]],
                "kernels_compared": compared.get(rank, 0)},
            trace_ids=gm.trace_ids_of(table, ranks_col == rank),
        ))
    return anomalies


def _below_peak(job: JobData, table: Table, totals: dict[int, float]) -> list[Anomaly]:
    category = table.column(sc.KERNEL_CATEGORY)
    compute = table.filter(np.isin(category.data, [taxonomy.GEMM, taxonomy.ATTENTION])
                           & category.is_valid()
                           & table.column(sc.KERNEL_ACHIEVED_TFLOPS).is_valid())
    if compute.num_rows == 0:
        return []
    models = gm.gpu_models(job)
    groups = _aggregate(compute, ["key", "rank", sc.KERNEL_NAME, sc.KERNEL_DTYPE],
                        sc.KERNEL_ACHIEVED_TFLOPS)
    slow: dict[int, list[dict]] = {}
    for row in groups:
        rank = int(row["rank"])
        dtype = taxonomy.compute_dtype(row[sc.KERNEL_NAME], row[sc.KERNEL_DTYPE])
        peak = taxonomy.peak_tflops(models.get(rank), dtype)
        if peak is None or row["count"] < MIN_SAMPLES:
            continue
        achieved = row["median"]
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


def short_name(kernel: str, limit: int = 60) -> str:
    """A kernel's name for a one-line summary: the demangled signature without its
    return type, template arguments and parameters (`void cub::Kernel<...>(...)` ->
    `cub::Kernel`); the full name stays in the evidence."""
    name = kernel.strip()
    if name.startswith("void "):
        name = name[5:]
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    name = name[:cut].strip() or kernel.strip()
    return name if len(name) <= limit else name[:limit - 1] + "…"
