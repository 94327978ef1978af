"""GPU detectors on synthetic kernel/step tables with known faults, and on real traces."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from flare.diagnostics import frame as step_frame
from flare.diagnostics.backends.arrow import ArrowJobData
from flare.diagnostics.backends.store import StoreBackend
from flare.diagnostics.detectors import (
    gpu_idle,
    gpu_throttle,
    kernel_slow,
    launch_bound,
    rank_missing,
)
from flare.diagnostics.model import DiagnosisConfig
from flare.exporters import store
from flare.importers import kineto
from flare.wire import semconv as sc

T0 = 1_700_000_000_000_000_000
US = 1_000
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"


class _Job:
    """Columns for a synthetic job, written to a real store file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cols: dict[str, list] = {c: [] for c, _, _ in store.SPAN_COLUMNS}
        self.n = 0

    def span(self, name, rank, step, start, end, attributes, model="NVIDIA H100 80GB HBM3"):
        self.n += 1
        row = {
            "job": self.name, "service": self.name, "trace_id": f"{sc.step_trace_id(self.name, step):032x}",
            "span_id": f"{self.n:016x}", "parent_span_id": "", "name": name, "kind": 1,
            "start_ns": int(start), "end_ns": int(end), "duration_ns": int(end - start),
            "status_code": 0, "status_message": "", "rank": rank, "step": step, "host": "n0",
            "pid": 1, "attributes": json.dumps(attributes),
            "resource": json.dumps({sc.RANK: rank, sc.GPU_MODEL: model, sc.WORLD_SIZE: 4}),
            "events": "[]", "links": "[]",
        }
        for key, values in self.cols.items():
            values.append(row[key])

    def kernel(self, rank, step, start, dur, launch, *, name=GEMM, category="gemm",
               flops=None, launch_dur=5.0):
        attributes = {sc.KERNEL_NAME: name, sc.KERNEL_CATEGORY: category, sc.KERNEL_DEVICE: 0,
                      sc.KERNEL_STREAM: 7, sc.KERNEL_LAUNCH_NS: int(launch),
                      sc.KERNEL_LAUNCH_DUR_US: launch_dur,
                      sc.KERNEL_ISSUE_LATENCY_US: (start - launch) / US,
                      sc.KERNEL_SHAPE: "[[4096, 4096], [4096, 4096]]", sc.KERNEL_DTYPE: "c10::BFloat16"}
        if flops:
            attributes[sc.KERNEL_FLOPS] = flops
            attributes[sc.KERNEL_ACHIEVED_TFLOPS] = flops / (dur / 1e9) / 1e12
        self.span(sc.SPAN_KERNEL, rank, step, start, start + dur, attributes)

    def save(self, path: Path) -> StoreBackend:
        with store.writer(path) as con:
            store.insert_spans(con, store.spans_table(self.cols))
        return StoreBackend(path)


def _training(job: _Job, steps=8, ranks=4, *, gap_us=None, late_launch_rank=None,
              slow_rank=None, slow_factor=1.0):
    """Per step and rank: 20 GEMMs of 1 ms, queued ahead by the CPU (deep queue)."""
    gap_us = gap_us or {}
    for rank in range(ranks):
        t = T0
        for step in range(steps):
            cpu = t - 5_000 * US  # the CPU ran 5 ms ahead of the GPU
            for _ in range(20):
                dur = 1_000 * US * (slow_factor if rank == slow_rank else 1.0)
                gap = gap_us.get(rank, 20) * US
                if rank == late_launch_rank:
                    launch = t + gap - 8 * US  # launched only just before it could start
                else:
                    launch = cpu
                    cpu += 50 * US
                job.kernel(rank, step, t + gap, dur, launch,
                           flops=2 * 4096**3)
                t += gap + dur


def test_gpu_idle_flags_the_starving_rank_only(tmp_path):
    job = _Job("idle")
    _training(job, gap_us={2: 1_500})  # rank 2: 1.5 ms idle before each 1 ms kernel
    found = gpu_idle.detect(job.save(tmp_path / "s.duckdb").job_data("idle"), DiagnosisConfig())
    assert [(a.ranks, a.kind) for a in found] == [([2], "gpu_idle")]
    assert found[0].impact == pytest.approx(0.6, abs=0.02)
    assert found[0].cause == "cpu" and found[0].first_step == 0


def test_gpu_idle_quiet_on_a_busy_job(tmp_path):
    job = _Job("busy")
    _training(job)
    assert gpu_idle.detect(job.save(tmp_path / "s.duckdb").job_data("busy"), DiagnosisConfig()) == []


def test_launch_bound_flags_the_rank_whose_queue_is_empty(tmp_path):
    job = _Job("launch")
    _training(job, gap_us={1: 400}, late_launch_rank=1)
    backend = job.save(tmp_path / "s.duckdb")
    found = launch_bound.detect(backend.job_data("launch"), DiagnosisConfig())
    assert [a.ranks for a in found] == [[1]]
    anomaly = found[0]
    assert anomaly.cause == "cpu" and anomaly.evidence["shifted_vs_peers"] is True
    assert anomaly.evidence["issue_latency_p50_us"] < 10
    assert anomaly.impact == pytest.approx(400 / 1400, abs=0.03)
    # Idle time alone is not launch-bound when the work was queued in time.
    job2 = _Job("queued")
    _training(job2, gap_us={1: 400})
    assert launch_bound.detect(job2.save(tmp_path / "s2.duckdb").job_data("queued"),
                               DiagnosisConfig()) == []


def test_kernel_slow_against_peers_and_against_peak(tmp_path):
    job = _Job("slow")
    _training(job, slow_rank=3, slow_factor=1.6)
    found = kernel_slow.detect(job.save(tmp_path / "s.duckdb").job_data("slow"), DiagnosisConfig())
    by_reference = {a.evidence["reference"]: a for a in found}
    assert sorted(a.evidence["reference"] for a in found) == ["peak", "peers"]
    peers = by_reference["peers"]
    assert peers.ranks == [3] and peers.cause == "hardware"
    assert peers.evidence["kernels"][0]["ratio"] == pytest.approx(1.6, rel=0.01)
    # 2·4096³ FLOPs in 1 ms = 137 TFLOPS, 14% of the H100's 989: not below 10% on the
    # healthy ranks, but the slowed rank's 86 TFLOPS is.
    assert by_reference["peak"].ranks == [3]
    job2 = _Job("peak")
    _training(job2, slow_rank=0, slow_factor=2.0, ranks=1)
    found2 = kernel_slow.detect(job2.save(tmp_path / "s2.duckdb").job_data("peak"), DiagnosisConfig())
    assert [(a.ranks, a.cause, a.evidence["reference"]) for a in found2] == [([0], "software", "peak")]
    assert found2[0].evidence["kernels"][0]["peak_tflops"] == 989.0


def test_kernel_slow_needs_two_peers_to_name_the_slower_rank(tmp_path):
    # Two ranks: which one is odd is not in the kernels (rank 1 of a real 128-rank job's
    # two-rank profile was "slower than its peers" on one data-dependent sort kernel).
    job = _Job("pair")
    _training(job, slow_rank=1, slow_factor=1.6, ranks=2)
    found = kernel_slow.detect(job.save(tmp_path / "s.duckdb").job_data("pair"), DiagnosisConfig())
    assert [a.evidence["reference"] for a in found] == ["peak"]


def _steps(job: _Job, ranks=4, steps=12, throttled_rank=None, from_step=4, culprit=True):
    for step in range(steps):
        for rank in range(ranks):
            attributes = {sc.STEP: step, sc.STEP_COLLECTIVE_WAIT_MS: 30.0}
            hit = rank == throttled_rank and step >= from_step
            if step == 0 or (rank == throttled_rank and step == from_step):
                attributes[sc.STEP_GPU_SM_CLOCK_MHZ] = 1200.0 if hit else 1980.0
                attributes[sc.STEP_GPU_THROTTLE] = 0x20 if hit else 0  # sw thermal slowdown
            if hit and culprit:
                attributes[sc.STEP_COLLECTIVE_WAIT_MS] = 1.0
            start = T0 + step * 200_000_000
            job.span(sc.SPAN_STEP, rank, step, start, start + 100_000_000, attributes)


def test_gpu_throttle_joined_to_the_straggler(tmp_path):
    job = _Job("hot")
    _steps(job, throttled_rank=2)
    found = gpu_throttle.detect(job.save(tmp_path / "s.duckdb").job_data("hot"), DiagnosisConfig())
    assert len(found) == 1
    anomaly = found[0]
    assert anomaly.ranks == [2] and anomaly.cause == "hardware"
    assert (anomaly.first_step, anomaly.last_step) == (4, 11)  # state carried forward
    assert anomaly.evidence["throttle_reasons"] == ["sw_thermal_slowdown"]
    assert anomaly.evidence["culprit_share"] == 1.0 and anomaly.confidence > 0.95
    assert anomaly.impact == pytest.approx(29 / 100, abs=0.01)


def test_gpu_throttle_on_bucketed_steps_from_store_and_arrow(tmp_path):
    """A long job reaches the detector in step buckets: the clock is a bucket mean, the
    NVML mask the OR of the bucket's masks (not a mean), on both kinds of backend."""
    job = _Job("long")
    _steps(job, ranks=4, steps=24, throttled_rank=1, from_step=8)
    config = DiagnosisConfig(max_step_columns=6)  # 24 steps → buckets of 4
    store_job = job.save(tmp_path / "s.duckdb").job_data("long")
    frame_of_store = step_frame.load(store_job, config)
    assert frame_of_store.bucket == 4
    arrow_job = ArrowJobData("long", "arrow:test", lambda *_: store.spans_table(job.cols))
    for data in (store_job, arrow_job):
        found = gpu_throttle.detect(data, config)
        assert [(a.ranks, a.cause, a.first_step, a.last_step) for a in found] == [([1], "hardware", 8, 23)]
        assert found[0].evidence["throttle_mask"] == 0x20
        assert found[0].evidence["steps_throttled"] == 16
    # Masks within one bucket are ORed: 0x4 (power cap) and 0x20 (thermal) → 0x24.
    mixed = _Job("mixed")
    for step, mask in enumerate((0x4, 0x20, 0, 0)):
        mixed.span(sc.SPAN_STEP, 0, step, T0 + step * 10, T0 + step * 10 + 5,
                   {sc.STEP: step, sc.STEP_GPU_THROTTLE: mask})
    summary = mixed.save(tmp_path / "m.duckdb").job_data("mixed").step_summary(
        [sc.STEP_GPU_THROTTLE], step_bucket=4)
    assert summary[sc.STEP_GPU_THROTTLE].to_pylist() == [float(0x24)]
    arrow_summary = ArrowJobData("mixed", "arrow:test", lambda *_: store.spans_table(mixed.cols)).step_summary(
        [sc.STEP_GPU_THROTTLE], step_bucket=4)
    assert arrow_summary[sc.STEP_GPU_THROTTLE].to_pylist() == [float(0x24)]


def test_rank_missing_still_fires_on_a_live_store(tmp_path):
    """The same 4-rank world with rank 3 silent, written as a live job (no flare.source)."""
    job = _Job("live")
    _steps(job, ranks=3)
    data = job.save(tmp_path / "s.duckdb").job_data("live")
    assert data.source() is None
    assert [(a.kind, a.ranks) for a in rank_missing.detect(data, DiagnosisConfig())] == [("rank_missing", [3])]


def test_gpu_throttle_quiet_without_throttling_or_nvml(tmp_path):
    job = _Job("cool")
    _steps(job)
    assert gpu_throttle.detect(job.save(tmp_path / "s.duckdb").job_data("cool"), DiagnosisConfig()) == []
    bare = _Job("bare")
    bare.span(sc.SPAN_STEP, 0, 0, T0, T0 + 10, {sc.STEP: 0})
    assert gpu_throttle.detect(bare.save(tmp_path / "b.duckdb").job_data("bare"), DiagnosisConfig()) == []


DATA = Path(os.environ.get("FLARE_KINETO_DATA", Path(__file__).resolve().parents[3] / "shared/data/kineto"))


@pytest.mark.skipif(not (DATA / "ws16_rank0.json.gz").exists(), reason="shared Kineto traces absent")
def test_gpu_detectors_on_real_traces(tmp_path):
    path = tmp_path / "s.duckdb"
    kineto.import_directory(DATA / "ws16_rank0.json.gz", path, job="ws16")
    kineto.import_directory(DATA / "nccl2ranks_rank0.json.gz", path, job="nccl2")
    backend = StoreBackend(path)
    config = DiagnosisConfig()
    idle = gpu_idle.detect(backend.job_data("ws16"), config)
    assert [(a.kind, a.ranks) for a in idle] == [("gpu_idle", [0])]
    # Per-step void shares of the 5 steps; HTA's whole-trace figure is 69.44%.
    assert 0.6 < idle[0].impact < 0.7 and (idle[0].first_step, idle[0].last_step) == (550, 554)
    launch = launch_bound.detect(backend.job_data("nccl2"), config)
    assert [(a.kind, a.ranks) for a in launch] == [("launch_bound", [0])]
    assert launch[0].evidence["issue_latency_p50_us"] < 50
    for detector in (kernel_slow, gpu_throttle):
        assert detector.detect(backend.job_data("ws16"), config) == []
    # One rank file of a 16-rank job: an import, not a live job whose other ranks vanished.
    assert backend.job_data("ws16").source() == sc.JOB_SOURCE_KINETO
    assert rank_missing.detect(backend.job_data("ws16"), config) == []
    json.dumps([a.to_json() for a in idle + launch])  # the ARCHITECTURE §5 shape serialises
    assert np.isfinite(idle[0].confidence)


def test_kernel_names_in_summaries_are_short():
    from flare.diagnostics.detectors.kernel_slow import short_name

    assert short_name("void cub::DeviceRadixSortOnesweepKernel<cub::Policy<long, int>, true>"
                      "(int*, int)") == "cub::DeviceRadixSortOnesweepKernel"
    assert short_name("at::native::elementwise_kernel<128, 2>(int)") == "at::native::elementwise_kernel"
    assert short_name("ampere_sgemm_128x64_nn") == "ampere_sgemm_128x64_nn"
    assert short_name("(anonymous)") == "(anonymous)"
    assert len(short_name("k" * 200)) == 60
