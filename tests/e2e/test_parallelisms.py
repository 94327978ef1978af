"""Parallelisms beyond DDP, end to end (issue #20): an FSDP2 job (`fully_shard` per
layer) whose ranks block in FSDP2's all-gathers and reduce-scatters for the slowest.
The slow rank must be named, not spread over all four as compute (the time blocked in
`all_gather_single` / `reduce_scatter_single`, torch >= 2.11, was not seen). Each
diagnosis scenario runs on a quiet host and on a loaded one (one busy process per core
beside the job: the `host` fixture) and must give the same answer on both."""

from __future__ import annotations

import json

import harness
import pytest

# Each scenario is a statistical judgement on a 2-core host shared with busy loops and
# the collector: a run that lands a label on the wrong side of a threshold is run once
# more (and reported as rerun); two in a row fail the test.
pytestmark = [pytest.mark.e2e, pytest.mark.flaky(reruns=1)]

STEPS = 50
ONSET = 20
TRAIN_FSDP2 = harness.ROOT / "examples" / "train_fsdp2.py"


def _only_rank_2_named(report: dict) -> None:
    """Rank 2 alone is named: a job-wide label beside it (a quiet run's collective_slow
    @0 from the first all-gathers, seen once) is false, and the loaded variant would be
    compared with it."""
    assert all(a["ranks"] == [2] for a in report["anomalies"]), harness.describe(report)


@pytest.mark.parametrize("slow_ms", [80])
def test_fsdp2_names_the_slow_rank(store, host, slow_ms):
    run = harness.FlareRun(store, harness.job_name(f"fsdp2_{slow_ms}", host), harness.torchrun(
        TRAIN_FSDP2, "--steps", STEPS, "--slow-rank", 2, "--slow-ms", slow_ms,
        "--fault-from", ONSET))
    report = run.finish()
    print(f"\nE2E fsdp2 slow rank 2 (+{slow_ms} ms, {host}):\n{harness.describe(report)}")
    harness.agree("fsdp2 slow rank 2", host, report)
    _only_rank_2_named(report)
    assert "wait_unknown" not in report  # every FSDP2 collective was seen from Python
    stragglers = [a for a in report["anomalies"] if a["kind"] == "straggler"]
    assert [(a["ranks"], a["cause"]) for a in stragglers] == [([2], "compute")], harness.describe(report)
    assert abs(stragglers[0]["first_step"] - ONSET) <= 3, harness.describe(report)
    # the waits are FSDP2's own collectives, counted once: no step waits longer than it lasts
    for _rank, step, duration_ms, wait_ms in run.query(
            "SELECT rank, step, duration_ns / 1e6, "
            "CAST(attributes->>'flare.step.collective_wait_ms' AS DOUBLE) FROM spans "
            "WHERE job = ? AND name = 'train.step'", [run.job]):
        assert wait_ms <= duration_ms + 1.0, (step, duration_ms, wait_ms)


def test_a_healthy_compiled_job_gives_no_label(store, host):
    """torch.compile over DDP: the first steps compile (step 0 ~0.5 s against ~12 ms
    after), each rank in its own time. Warm-up read from the data, not a fault. (Four
    ranks: with two, rank 0 was labelled `straggler compute 3-36` in 2 of 3 quiet runs,
    its one peer the whole comparison: issue #28.)"""
    run = harness.FlareRun(store, harness.job_name("compiled", host), harness.torchrun(
        harness.TRAIN_DDP, "--steps", 40, "--hidden", 256, "--compile", "--fault", "none"))
    report = run.finish()
    print(f"\nE2E compiled DDP, healthy ({host}):\n{harness.describe(report)}")
    harness.agree("compiled DDP, healthy", host, report)
    steps = run.step_ms()
    first = sorted(steps)[0]
    assert max(steps[first].values()) > 5 * sorted(max(v.values()) for v in steps.values())[len(steps) // 2]
    assert report["anomalies"] == [], harness.describe(report)
    assert "wait_unknown" not in report  # DDP's reducer is accounted, compiled or not


def test_fsdp2_with_tensor_parallel_names_the_slow_rank(store, host):
    """FSDP2 + TP on a 2x2 DeviceMesh: rank 2's TP partner (3) blocks in DTensor's
    functional all-reduces (waited in `wait_tensor`), its DP partner (0) in FSDP2's
    all-gathers. Before functional collectives were timed, rank 3's wait read as
    compute and the job got one job-wide fail-slow."""
    run = harness.FlareRun(store, harness.job_name("fsdp2_tp", host), harness.torchrun(
        TRAIN_FSDP2, "--tp", 2, "--layers", 2, "--steps", STEPS, "--slow-rank", 2,
        "--slow-ms", 80, "--fault-from", ONSET))
    report = run.finish()
    print(f"\nE2E fsdp2 + tp, slow rank 2 ({host}):\n{harness.describe(report)}")
    harness.agree("fsdp2 + tp slow rank 2", host, report)
    _only_rank_2_named(report)
    assert "wait_unknown" not in report  # DTensor's functional collectives included
    stragglers = [a for a in report["anomalies"] if a["kind"] == "straggler"]
    assert [(a["ranks"], a["cause"]) for a in stragglers] == [([2], "compute")], harness.describe(report)
    assert abs(stragglers[0]["first_step"] - ONSET) <= 3, harness.describe(report)
    waits = {rank: names for rank, names in run.query(
        "SELECT DISTINCT rank, CAST(attributes->'flare.step.pg.names' AS VARCHAR) FROM spans "
        "WHERE job = ? AND name = 'train.step'", [run.job])}
    assert all(len(json.loads(names)) == 2 for names in waits.values())  # the DP and TP groups


def test_a_slow_stage_under_a_pipelining_schedule_is_named_as_the_stage(store, host):
    """torch.distributed.pipelining's Schedule1F1B on 2 stages x 2 replicas: the
    schedule's `batch_isend_irecv` works, waited by the schedule itself, are the P2P
    waits; the pipeline groups (group_desc "pipeline<r>") give the stage."""
    run = harness.FlareRun(store, harness.job_name("pp_1f1b", host), harness.torchrun(
        harness.TRAIN_PIPELINE, "--schedule", "1f1b", "--steps", STEPS, "--slow-stage", 1,
        "--slow-ms", 10, "--fault-from", ONSET))
    report = run.finish()
    print(f"\nE2E pipelining 1F1B, slow stage 1 ({host}):\n{harness.describe(report)}")
    harness.agree("pipelining 1F1B slow stage 1", host, report)
    assert "wait_unknown" not in report
    stragglers = [a for a in report["anomalies"] if a["kind"] == "straggler"]
    assert [(a["ranks"], a["cause"]) for a in stragglers] == [([2, 3], "compute")], harness.describe(report)
    assert abs(stragglers[0]["first_step"] - ONSET) <= 3, harness.describe(report)
    assert "pipeline stage 1" in stragglers[0]["summary"], stragglers[0]["summary"]
    roles = {tuple(json.loads(r)) for (r,) in run.query(
        "SELECT DISTINCT CAST(attributes->'flare.step.pg.roles' AS VARCHAR) FROM spans "
        "WHERE job = ? AND name = 'train.step'", [run.job]) if r}
    assert all("pipeline_parallel" in r for r in roles) and roles, roles


def test_collectives_flare_cannot_see_give_wait_unknown_never_a_wrong_culprit(store, host):
    """A custom communication path (`ProcessGroup.allreduce` called directly, as a C++
    extension would): counted by sequence numbers, its wait unknown. Said once per rank
    in the log and in the report; the slowdown keeps no claimed cause or wrong rank."""
    run = harness.FlareRun(store, harness.job_name("untimed", host), [
        *harness.torchrun(harness.ROOT / "tests" / "e2e" / "untimed_collectives_job.py",
                          "--slow-rank", 2, "--fault-from", ONSET)])
    report = run.finish()
    print(f"\nE2E untimed collectives, slow rank 2 ({host}):\n{harness.describe(report)}")
    harness.agree("untimed collectives slow rank 2", host, report)
    said = [line for line in run.stderr if "Flare cannot time" in line]
    assert len(said) == 4 and {line.split("rank ")[1].split(":")[0] for line in said} == {"0", "1", "2", "3"}
    assert report["wait_unknown"]["ranks"] == [0, 1, 2, 3], report.get("wait_unknown")
    for anomaly in report["anomalies"]:
        assert anomaly["cause"] not in ("compute", "communication"), harness.describe(report)
        assert anomaly["ranks"] in ([], [2]), harness.describe(report)
        if anomaly["kind"] in ("straggler", "fail_slow"):
            assert anomaly["evidence"]["wait_unknown"]["ranks"] == [0, 1, 2, 3]


@pytest.mark.parametrize("example", ["ddp", "fsdp2_tp", "pipeline_1f1b"])
def test_training_is_bit_identical_with_and_without_flare(store, example):
    # (as few ranks as each layout needs: DDP's buckets and hooks are the same on 2)
    script, args, ranks = {
        "ddp": (harness.TRAIN_DDP, ["--hidden", 128], 2),
        "fsdp2_tp": (TRAIN_FSDP2, ["--tp", 2, "--layers", 2], 4),
        "pipeline_1f1b": (harness.TRAIN_PIPELINE, ["--schedule", "1f1b"], 4),
    }[example]
    folders = {mode: store.parent / f"checksum_{example}_{mode}" for mode in ("plain", "flare")}
    command = harness.torchrun(script, "--steps", 12, *args, nproc=ranks)
    harness.run_plain([*command, "--checksum", str(folders["plain"])], cwd=store.parent)
    harness.FlareRun(store, f"identical_{example}",
                     [*command, "--checksum", str(folders["flare"])]).finish()
    digests = {mode: {p.name: p.read_text() for p in folder.glob("rank*.sha256")}
               for mode, folder in folders.items()}
    assert len(digests["plain"]) == ranks and digests["plain"] == digests["flare"], digests


def test_a_single_process_job_without_torchrun_is_diagnosed(store, host):
    """`flare run -- python train.py`: no launcher, no RANK. The process flare run
    started is the job's one rank (its DataLoader workers are not); no cross-rank label,
    the job's own slowdown is labelled."""
    run = harness.FlareRun(store, harness.job_name("single", host), [str(a) for a in (
        harness.BIN / "python", harness.TRAIN_DDP, "--steps", 60, "--hidden", 256,
        "--fault", "input", "--fault-rank", 0, "--fault-from", ONSET, "--fault-ms", 40,
        "--num-workers", 1)])
    report = run.finish()
    print(f"\nE2E single process, slow input from step {ONSET} ({host}):\n{harness.describe(report)}")
    harness.agree("single process slow input", host, report)
    assert sorted(run.step_ms()[ONSET]) == [0]  # one rank, the trainer itself
    kinds = {(a["kind"], a["cause"]) for a in report["anomalies"]}
    assert ("fail_slow", "input") in kinds, harness.describe(report)
    assert not any(a["kind"] == "straggler" for a in report["anomalies"])
    slow = next(a for a in report["anomalies"] if a["kind"] == "fail_slow")
    assert abs(slow["first_step"] - ONSET) <= 3, harness.describe(report)
