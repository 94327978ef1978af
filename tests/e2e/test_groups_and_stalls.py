"""Failures as they happen at scale, end to end (issue #19): a slow group of ranks (a
node, a pipeline stage) is one label, two unrelated slow ranks are two; a rank that
stalls everyone every N steps (its GC, a checkpoint) is labelled with the pattern.

Real torchrun jobs (gloo, CPU) under `flare run --format json`, as in
test_fault_injection.py, each on a quiet host and on a loaded one (one busy process
per core beside the job: the `host` fixture), which must give the same answer; each
test asserts on the final JSON report. Run with `-s` to see each report's labels and
the measured stall shares.
"""

from __future__ import annotations

import json

import harness
import pytest

# Each scenario is a statistical judgement on a 2-core host shared with busy loops and
# the collector: a run that lands a label on the wrong side of a threshold is run once
# more (and reported as rerun); two in a row fail the test.
pytestmark = [pytest.mark.e2e, pytest.mark.flaky(reruns=1)]


STEPS = 60
ONSET = 20
HIDDEN = 256  # train_ddp.py's default 512 costs twice the CPU for nothing here
DDP = ("--steps", STEPS, "--hidden", HIDDEN)


def _stragglers(report: dict) -> list[dict]:
    return [a for a in report["anomalies"] if a["kind"] == "straggler"]


def _show(name: str, report: dict, extra: str = "") -> None:
    print(f"\nE2E {name}{extra}:\n{harness.describe(report)}")


def _periodic_label(run: harness.FlareRun, report: dict, rank: int, every: int,
                    stall_steps: list[int]) -> tuple[dict, float]:
    """The label of a rank's periodic stall, and the share of the job's time the stalls
    cost, measured from the job's own step times."""
    share = harness.stall_share(run.step_ms(), stall_steps)
    _show(run.job, report, f" (stall share measured from the store: {share:.1%})")
    labels = [a for a in report["anomalies"] if a["ranks"] == [rank]
              and a["evidence"].get("pattern") == "periodic"]
    assert len(labels) == 1, harness.describe(report)
    label = labels[0]
    assert abs(label["evidence"]["period_steps"] - every) <= 1, label["evidence"]
    assert abs(label["impact"] - share) <= 0.2 * share, (label["impact"], share)
    return label, share


def test_two_faults_at_once_are_two_labels_each_with_its_cause(store, host):
    """Two unrelated faults from the same step: rank 1's compute (+40 ms/step) and rank
    3's garbage collections (~+70 ms/step: the GC fault overshoots what it is asked).
    Rank 3 sets the job's pace, so rank 1 is rarely the last to arrive: it is named all
    the same, with its own cause (hidden behind rank 3, where it never is), and the
    job's slowdown is their evidence, not a third label. (Two equal faults, each the
    culprit of half the steps: tests/diagnostics/test_ledger.py.)"""
    run = harness.FlareRun(store, harness.job_name("two_faults", host), harness.torchrun(
        harness.TRAIN_DDP, *DDP, "--fault", "compute", "--fault-rank", 1, "--also", "gc@3",
        "--fault-from", ONSET, "--fault-ms", 40))
    report = run.finish()
    _show("two faults at once", report)
    harness.agree("two faults at once: rank 1 compute, rank 3 gc", host, report)
    assert sorted((a["kind"], a["ranks"], a["cause"]) for a in report["anomalies"]) == [
        ("straggler", [1], "compute"), ("straggler", [3], "gc")], harness.describe(report)
    for label in report["anomalies"]:
        assert abs(label["first_step"] - ONSET) <= 3, harness.describe(report)


def test_a_slow_node_is_one_label_naming_the_node(store, host):
    # Two torchrun agents on this machine, 2 ranks each: node 1 holds ranks 2 and 3.
    run = harness.FlareRun(store, harness.job_name("slow_node", host), harness.two_nodes(
        harness.TRAIN_DDP, *DDP, "--fault", "compute", "--fault-rank", "2,3",
        "--fault-from", ONSET, "--fault-ms", 40))
    report = run.finish()
    _show("slow node", report)
    harness.agree("slow node 1", host, report)
    # the scenario itself: one job, two nodes told apart by flare.node_rank
    nodes = {rank: resource.get("flare.node_rank") for rank, resource in run.resources().items()}
    assert nodes == {0: 0, 1: 0, 2: 1, 3: 1}, nodes
    stragglers = _stragglers(report)
    assert [a["ranks"] for a in stragglers] == [[2, 3]], harness.describe(report)
    assert stragglers[0]["cause"] == "compute", harness.describe(report)
    assert "node" in stragglers[0]["evidence"].get("group", ""), stragglers[0]["evidence"]


def test_a_periodic_gc_pause_is_labelled_with_its_period(store, host):
    # From step 20, as the other faults: begun at step 10, the loaded variant dated the
    # pattern from its second stall (20) while the quiet one said 10; 80 steps keep six.
    every, start, fault_ms, steps = 10, ONSET, 80.0, 80
    run = harness.FlareRun(store, harness.job_name("gc_every_10", host), harness.torchrun(
        harness.TRAIN_DDP, "--steps", steps, "--hidden", HIDDEN, "--fault", "gc", "--fault-rank", 3,
        "--fault-from", start, "--fault-every", every, "--fault-ms", fault_ms))
    report = run.finish()
    harness.agree("gc every 10 steps, rank 3", host, report)
    stall_steps = list(range(start, steps, every))
    # the scenario itself: each stall is a real full collection, in the step's GC time
    gc_ms = {step: json.loads(attributes).get("flare.step.gc_ms", 0.0) for step, attributes in run.query(
        "SELECT step, attributes FROM spans WHERE job = ? AND name = 'train.step' AND rank = 3",
        [run.job])}
    print(f"\nE2E gc_every_10: rank 3's flare.step.gc_ms on the stall steps "
          f"{[gc_ms.get(step) for step in stall_steps]}, elsewhere at most "
          f"{max(v for step, v in gc_ms.items() if step not in stall_steps)}")
    assert all(gc_ms.get(step, 0.0) >= 0.5 * fault_ms for step in stall_steps), gc_ms
    label, _ = _periodic_label(run, report, 3, every, stall_steps)
    assert label["cause"] == "gc", harness.describe(report)


def test_a_periodic_checkpoint_stall_is_labelled_with_its_period(store, host):
    every = 8
    run = harness.FlareRun(store, harness.job_name("stall_every_8", host), harness.torchrun(
        harness.TRAIN_DDP, *DDP, "--fault", "stall", "--fault-rank", 0, "--fault-from", every,
        "--fault-every", every, "--fault-ms", 80))
    report = run.finish()
    harness.agree("checkpoint stall every 8 steps, rank 0", host, report)
    # a sleep in the step: the cause may read unknown (or input); the pattern is the point
    _periodic_label(run, report, 0, every, list(range(every, STEPS, every)))


def test_a_slow_pipeline_stage_is_one_label_with_its_ranks(store, host):
    """A pipeline job's stage 1 (ranks 2 and 3) slowed from step 20: one straggler label
    naming both of its ranks, and nothing else. The pipeline's own shape (bubbles, each
    stage waiting on the one before it, a last stage that runs the loss) is no label:
    steps 0-19 are a healthy pipeline job, and a false label there, or one of the
    healthy stage after the onset, fails the scenario (a separate healthy pipeline job
    cost 30 s of the suite for what this one's labels already show)."""
    # stage = rank // 2: stage 1 is ranks 2 and 3 (examples/train_pipeline.py)
    run = harness.FlareRun(store, harness.job_name("slow_stage", host), harness.torchrun(
        harness.TRAIN_PIPELINE, "--steps", STEPS, "--slow-stage", 1, "--slow-ms", 10,
        "--fault-from", ONSET))
    report = run.finish()
    _show("slow pipeline stage", report)
    harness.agree("slow pipeline stage 1", host, report)
    # the scenario itself: the zero-code instrumentation finds each rank's steps
    steps = run.step_ms()
    assert sorted(steps) == list(range(STEPS)) and all(len(by_rank) == 4 for by_rank in steps.values())
    assert [a["ranks"] for a in _stragglers(report)] == [[2, 3]], harness.describe(report)
    # (a healthy DDP job, quiet and loaded, is test_fault_injection.py's healthy scenario)
    assert all(a["ranks"] == [2, 3] and a["first_step"] >= ONSET - 3 for a in report["anomalies"]), \
        harness.describe(report)
