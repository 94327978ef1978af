"""The time-lost ledger and what reads it: groups of ranks, several culprits, periodic
and intermittent stalls, whole-run impact, real (sparse) step numbers.

Synthetic spans with known faults (diagnostics/synthetic.py: every rank's own work,
then a barrier the early ranks wait at), so every figure is known exactly.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest

from flare.diagnostics import frame as frames
from flare.diagnostics import ledger as ledgers
from flare.diagnostics.backends.arrow import ArrowJobData
from flare.diagnostics.detectors import straggler
from flare.diagnostics.model import DiagnosisConfig
from flare.diagnostics.pipeline import diagnose
from flare.diagnostics.report_text import render
from flare.diagnostics.synthetic import Fault, job_spans


def _job(table: pa.Table, name: str = "j") -> ArrowJobData:
    return ArrowJobData(name, "synthetic", lambda *_: table)


def _measured_share(table: pa.Table, stall_steps: set[int]) -> float:
    """The share of the run the stalls cost, from the job's own step times: per step the
    median duration over ranks; the stalls' excess over the median step, over the total."""
    steps = np.asarray(table["step"].to_pylist())
    duration = np.asarray(table["duration_ns"].to_pylist(), dtype=float)
    per_step = {s: float(np.median(duration[steps == s])) for s in np.unique(steps)}
    typical = float(np.median(list(per_step.values())))
    excess = sum(per_step[s] - typical for s in stall_steps)
    return excess / sum(per_step.values())


def test_the_ledger_shares_each_steps_loss_among_its_culprits():
    table = job_spans("j", 8, 60, (Fault("compute", 6, 20, 100.0), Fault("compute", 7, 20, 100.0)))
    frame = frames.load(_job(table), DiagnosisConfig())
    book, _ = straggler.prepare(frame, DiagnosisConfig())
    after = np.arange(25, 60)
    assert book.culprits[[6, 7]][:, after].all()  # both arrive last together
    assert not book.culprits[:6][:, after].any()
    assert book.lost_ms[after].mean() == pytest.approx(100.0, rel=0.05)
    assert book.lost_by([6], after) == pytest.approx(book.lost_by([7], after), rel=1e-6)
    assert book.lost_by([6, 7], after) == pytest.approx(float(book.lost_ms[after].sum()), rel=1e-6)


def test_a_slow_node_is_one_label_naming_the_node():
    faults = (Fault("compute", 6, 20, 80.0), Fault("compute", 7, 20, 80.0))
    found = straggler.detect(_job(job_spans("j", 8, 60, faults, node_size=2)), DiagnosisConfig())
    assert [(a.ranks, a.cause, a.first_step) for a in found] == [([6, 7], "compute", 20)]
    evidence = found[0].evidence
    assert evidence["group"] == "node 3"
    assert set(evidence["member_excess_ms"]) == {"6", "7"}
    assert all(v > 60 for v in evidence["member_excess_ms"].values())
    assert "ranks 6,7 (node 3)" in found[0].summary


def test_a_slow_process_group_is_named_when_no_node_matches():
    faults = (Fault("compute", 6, 20, 80.0), Fault("compute", 7, 20, 80.0))
    groups = {"stage3": (6, 7), "stage0": (0, 1)}
    found = straggler.detect(_job(job_spans("j", 8, 60, faults, groups=groups)), DiagnosisConfig())
    assert [(a.ranks, a.evidence.get("group")) for a in found] == [([6, 7], "process group stage3")]


def test_two_unrelated_slow_ranks_are_two_labels():
    faults = (Fault("compute", 1, 20, 40.0), Fault("compute", 3, 20, 40.0))
    found = straggler.detect(_job(job_spans("j", 4, 60, faults, node_size=4)), DiagnosisConfig())
    assert sorted((a.ranks, a.cause, a.first_step) for a in found) == [
        ([1], "compute", 20), ([3], "compute", 20)]
    # Each costs the run its part of the loss: together what the job lost after step 20.
    total = sum(a.impact for a in found)
    assert total == pytest.approx(40 * 40 / (20 * 48 + 40 * 88), rel=0.15)


def test_a_periodic_gc_stall_is_labelled_with_its_period_and_true_share():
    table = job_spans("j", 4, 120, (Fault("gc", 3, 10, 400.0, every=10),))
    found = diagnose(_job(table)).anomalies
    stalls = [a for a in found if a.kind == "straggler"]
    assert [(a.ranks, a.cause) for a in stalls] == [([3], "gc")]
    evidence = stalls[0].evidence
    assert evidence["pattern"] == "periodic" and evidence["period_steps"] == 10
    assert stalls[0].first_step == 10
    measured = _measured_share(table, set(range(10, 120, 10)))
    assert stalls[0].impact == pytest.approx(measured, rel=0.2)
    assert "every 10 steps" in stalls[0].summary


def test_a_periodic_stall_that_begins_while_the_job_settles_keeps_its_first_stall():
    # slow first steps, settling over 11 steps, leave the ledger's baselines to step 11:
    # the stall at step 8 is still the pattern's first, and the label's onset
    for warmup in ((), (300.0, 150.0, 100.0, 100.0, 80.0, 80.0, 80.0, 80.0, 60.0, 60.0, 40.0)):
        table = job_spans("j", 4, 60, (Fault("compute", 0, 8, 80.0, every=8),), warmup=warmup)
        [label] = [a for a in diagnose(_job(table)).anomalies if a.kind == "straggler"]
        assert label.ranks == [0] and label.evidence["pattern"] == "periodic"
        assert label.first_step == 8 and label.evidence["stall_steps"] == list(range(8, 60, 8))


def test_a_periodic_stall_keeps_its_period_past_a_hiccup_off_it():
    """A loaded host: the stalling rank is also descheduled once between two stalls, long
    enough to read as a stall. That breaks two gaps of seven (intermittent, before) but
    not the period; the hiccup is no stall of the label's."""
    faults = (Fault("compute", 0, 8, 80.0, every=8), Fault("compute", 0, 29, 60.0, to_step=30))
    [label] = [a for a in diagnose(_job(job_spans("j", 4, 60, faults))).anomalies
               if a.kind == "straggler"]
    assert label.ranks == [0] and label.evidence["pattern"] == "periodic"
    assert label.evidence["period_steps"] == 8
    assert label.evidence["stall_steps"] == list(range(8, 60, 8))


def test_an_irregular_stall_that_costs_a_real_share_is_intermittent():
    steps = [12, 19, 33, 37, 58, 71, 90, 94, 110]
    faults = tuple(Fault("gc", 2, s, 300.0, to_step=s + 1) for s in steps)
    found = straggler.detect(_job(job_spans("j", 4, 120, faults)), DiagnosisConfig())
    assert [(a.ranks, a.cause, a.evidence["pattern"]) for a in found] == [([2], "gc", "intermittent")]
    assert found[0].evidence["culprit_steps"] == len(steps)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_noisy_healthy_job_has_no_straggler_and_no_stall(seed):
    """A loaded host: every rank is descheduled now and then (8 % of its steps)."""
    table = job_spans("j", 4, 120, seed=seed, hiccups=0.08)
    assert [a.kind for a in diagnose(_job(table)).anomalies] == []


def test_sparse_step_numbers_are_used_as_they_are():
    numbers = list(range(16, 16 + 44 * 28, 28))  # 44 sampled steps, 16 … 1220
    table = job_spans("j", 4, 44, (Fault("compute", 2, 10, 60.0),), step_numbers=numbers)
    found = straggler.detect(_job(table), DiagnosisConfig())
    assert [(a.ranks, a.first_step, a.last_step) for a in found] == [([2], numbers[10], numbers[-1])]
    assert found[0].evidence["culprit_steps"] <= 34
    assert found[0].first_step in numbers and found[0].last_step in numbers


def test_the_text_report_ends_with_where_the_time_went():
    table = job_spans("j", 4, 120, (Fault("gc", 3, 10, 400.0, every=10),
                                    Fault("compute", 1, 60, 50.0)))
    diagnosis = diagnose(_job(table))
    text = render(diagnosis)
    assert "Where the time went" in text
    lines = text[text.index("Where the time went"):].splitlines()
    assert any("rank 3" in line and "gc" in line for line in lines)
    assert any("rank 1" in line and "compute" in line for line in lines)
    rows = diagnosis.time_lost
    assert rows[-1]["who"].startswith("no label")
    assert sum(r["share"] for r in rows) <= 1.0


def test_no_wait_data_gives_no_straggler():
    table = job_spans("j", 4, 60, (Fault("compute", 1, 20, 60.0),))
    import json

    attrs = [json.dumps({k: v for k, v in json.loads(a).items() if "wait" not in k})
             for a in table["attributes"].to_pylist()]
    table = table.set_column(table.schema.get_field_index("attributes"), "attributes",
                             pa.array(attrs))
    assert straggler.detect(_job(table), DiagnosisConfig()) == []
    assert ledgers.noise_ms(np.zeros((2, 1))) == 0.0


def test_the_jobs_slowdown_behind_its_stragglers_is_their_evidence_not_a_label_of_its_own():
    """Two slow ranks of four slow the whole job: one finding per rank, each carrying
    the job's change point; a live fail-slow alert of both is kept, nested in them."""
    from flare.diagnostics.model import Anomaly
    from flare.diagnostics.pipeline import live_alerts, withdrawn

    faults = (Fault("compute", 1, 20, 40.0), Fault("compute", 3, 20, 40.0))
    diagnosis = diagnose(_job(job_spans("j", 4, 80, faults, node_size=4)))
    assert sorted((a.kind, a.ranks, a.cause) for a in diagnosis.anomalies) == [
        ("straggler", [1], "compute"), ("straggler", [3], "compute")]
    for label in diagnosis.anomalies:
        slowdown = label.evidence["job_slowdown"]
        assert slowdown["ranks"] == [1, 3] and abs(slowdown["first_step"] - 20) <= 3
        assert slowdown["step_ms_after"] > slowdown["step_ms_before"] + 30
        assert "the job's step went from" in label.summary
    assert sum(r["share"] for r in diagnosis.time_lost) <= 1.0
    alert = Anomaly("fail_slow", [1, 3], "compute", 20, 40, 0.3, 0.9, "…")
    assert withdrawn([alert], diagnosis.anomalies) == []
    assert live_alerts([alert], diagnosis.anomalies)[0]["kept"]
    # one rank of the two is not the finding the alert made
    assert not live_alerts([Anomaly("fail_slow", [1], "compute", 20, 40, 0.3, 0.9, "…")],
                           diagnosis.anomalies)[0]["kept"]


def test_live_alerts_the_final_report_drops_are_listed_as_withdrawn():
    """A live pass sees only the steps every rank has sent: a short burst can look
    persistent there. The final report says what it withdrew, and why, in one line each."""
    from flare.diagnostics.model import Anomaly
    from flare.diagnostics.pipeline import live_alerts, withdrawn

    table = job_spans("j", 4, 120, (Fault("gc", 3, 10, 400.0, every=10),))
    diagnosis = diagnose(_job(table))
    burst = Anomaly("straggler", [1], "cpu", 30, 45, 0.1, 0.6, "rank 1 …")
    replaced = Anomaly("straggler", [3], "unknown", 10, 20, 0.3, 0.7, "rank 3 …")
    kept = Anomaly("straggler", [3], "gc", 10, 119, 0.3, 0.7, "rank 3 …")
    diagnosis.withdrawn = withdrawn([burst, replaced, kept], diagnosis.anomalies)
    assert [(w["ranks"], w["cause"]) for w in diagnosis.withdrawn] == [([1], "cpu")]
    assert "not confirmed over the whole run" in diagnosis.withdrawn[0]["reason"]
    other = Anomaly("fail_slow", [3], "gc", 10, 119, 0.3, 0.7, "…")
    assert "superseded by [straggler] ranks 3 cause gc" in withdrawn([other], diagnosis.anomalies)[0]["reason"]
    text = render(diagnosis)
    assert "Withdrawn live alerts:" in text
    assert "[straggler] ranks 1 cause cpu from step 30: not confirmed" in text
    assert diagnosis.to_json()["withdrawn_alerts"][0]["ranks"] == [1]
    # with the job's data the reason states the figures it rests on
    figured = withdrawn([burst], diagnosis.anomalies, diagnosis.job_data)[0]["reason"]
    assert re.search(r"\(steps 30-119: its work [\d.]+ ms/step against its peers' [\d.]+ "
                     r"\([+-][\d.]+\), the peers waiting [\d.]+ ms/step\)$", figured), figured
    # and the report lists every live alert, kept or not
    diagnosis.live_alerts = live_alerts([burst, kept], diagnosis.anomalies)
    assert [a["kept"] for a in diagnosis.live_alerts] == [False, True]
    assert "Live alerts: 2 said while the job ran, 1 kept in this report" in render(diagnosis)
    assert diagnosis.to_json()["live_alerts"][1]["kind"] == "straggler"
    healthy = diagnose(_job(job_spans("j", 4, 60, seed=5)))
    healthy.withdrawn = withdrawn([burst], healthy.anomalies)
    assert "No anomalies found.\n\nWithdrawn live alerts:" in render(healthy)


def test_gaps_duplicates_and_missing_steps_never_give_a_wrong_step_or_a_traceback():
    table = job_spans("j", 6, 80, (Fault("compute", 4, 30, 60.0),))
    rng = np.random.default_rng(0)
    keep = rng.random(table.num_rows) > 0.15  # 15 % of the step spans never arrived
    steps = np.asarray(table["step"].to_pylist())
    ranks = np.asarray(table["rank"].to_pylist())
    keep &= ~((ranks == 5) & (steps >= 50))  # a rank that stopped reporting
    kept = table.filter(pa.array(keep))
    doubled = pa.concat_tables([kept, kept.slice(0, 200)])  # duplicated deliveries
    diagnosis = diagnose(_job(doubled))
    present = set(doubled["step"].to_pylist())
    for anomaly in diagnosis.anomalies:
        assert anomaly.first_step is None or anomaly.first_step in present
        assert anomaly.last_step is None or anomaly.last_step in present
    stragglers = [a for a in diagnosis.anomalies if a.kind == "straggler"]
    assert [a.ranks for a in stragglers] == [[4]]
    assert abs(stragglers[0].first_step - 30) <= 3


def test_a_rank_the_host_starves_is_the_hosts_condition_not_an_anomaly():
    """Another process taking a rank's core: the training thread is runnable but waits
    for a CPU (run-queue time). Said beside the anomalies, never as the job's fault;
    a GIL-holding thread in the rank's own process (its victim sleeps on the GIL, no
    run-queue time) is still the rank's straggler, cause cpu."""
    host = diagnose(_job(job_spans("j", 4, 80, (Fault("host", 2, 30, 40.0),))))
    assert [a.kind for a in host.anomalies] == []
    assert [(h["ranks"], h["first_step"]) for h in host.host_contention] == [([2], 30)]
    assert host.host_contention[0]["runqueue_delta_ms"] > 30
    text = render(host)
    assert "No anomalies found." in text and "The host, not the job" in text
    assert any(r["cause"] == "host CPU" for r in host.time_lost)
    assert host.to_json()["host_contention"][0]["ranks"] == [2]
    gil = diagnose(_job(job_spans("j", 4, 80, (Fault("busy_thread", 2, 30, 40.0),))))
    assert [(a.kind, a.ranks, a.cause) for a in gil.anomalies if a.kind == "straggler"] == [
        ("straggler", [2], "cpu")]
    assert gil.host_contention == []


def test_a_compiled_models_warm_up_is_not_a_slowdown_or_a_straggler():
    """The first steps of a compiled model (compile, recompiles, autotuning) take seconds,
    each rank its own time; then the job settles. No label may come of that."""
    from flare.diagnostics.frame import warm_mask

    warmup = (4000.0, 1500.0, 900.0, 600.0, 400.0, 300.0, 200.0, 120.0)
    table = job_spans("j", 4, 80, warmup=warmup, seed=4)
    assert diagnose(_job(table)).anomalies == []
    frame = frames.load(_job(table), DiagnosisConfig())
    assert int(np.argmax(warm_mask(frame, DiagnosisConfig()))) >= 6  # past the slow prefix
    # A real fault after the warm-up is still found, dated from its own onset.
    faulty = job_spans("j", 4, 80, (Fault("compute", 2, 40, 60.0),), warmup=warmup, seed=4)
    found = [(a.kind, a.ranks, a.first_step) for a in diagnose(_job(faulty)).anomalies]
    assert ("straggler", [2], 40) in found


def test_a_cpu_hungry_culprit_on_a_busy_host_is_still_the_jobs_straggler():
    """On an oversubscribed host a rank whose compute grew waits in the run queue too;
    but its training thread burns the extra CPU, which a starved rank does not."""
    table = job_spans("j", 4, 80, (Fault("compute", 2, 30, 40.0),))
    import json

    rows = []
    for attrs, rank, step in zip(table["attributes"].to_pylist(), table["rank"].to_pylist(),
                                 table["step"].to_pylist(), strict=True):
        values = json.loads(attrs)
        if rank == 2 and step >= 30:  # it also waited for a CPU, as much as it grew
            values["flare.step.cpu.runqueue_ms"] += 40.0
        rows.append(json.dumps(values))
    table = table.set_column(table.schema.get_field_index("attributes"), "attributes", pa.array(rows))
    diagnosis = diagnose(_job(table))
    assert [(a.ranks, a.cause) for a in diagnosis.anomalies if a.kind == "straggler"] == [([2], "compute")]
    assert diagnosis.host_contention == []


def test_a_periodic_stall_stays_periodic_across_a_stretch_where_its_rank_is_slow():
    faults = (Fault("gc", 3, 10, 400.0, every=10), Fault("compute", 3, 40, 30.0, to_step=65))
    found = straggler.detect(_job(job_spans("j", 4, 120, faults)), DiagnosisConfig())
    periodic = [a for a in found if a.evidence.get("pattern") == "periodic"]
    assert [(a.ranks, a.evidence["period_steps"]) for a in periodic] == [([3], 10)]
    assert periodic[0].evidence["stall_steps"] == list(range(10, 120, 10))
    assert any(a.evidence.get("pattern") is None and a.first_step == 40 for a in found)


def test_a_culprit_whose_work_grew_is_the_jobs_however_long_it_also_waited_for_a_cpu():
    """The FSDP2 + TP case on a loaded host: rank 2's own CPU per step grew by about half
    its excess and its run-queue wait by the other half. It did more work: a straggler,
    cause compute, never "the host"."""
    diagnosis = diagnose(_job(job_spans("j", 4, 120, (Fault("busy_compute", 2, 30, 50.0),))))
    assert [(a.ranks, a.cause, a.first_step) for a in diagnosis.anomalies if a.kind == "straggler"] == [
        ([2], "compute", 30)]
    assert diagnosis.host_contention == []


def test_a_job_wide_slowdown_without_more_work_is_the_host_not_compute():
    """Every rank waits longer for a CPU, none does more work (other processes on the
    host): no fail-slow of cause compute or communication; the host, said beside."""
    faults = tuple(Fault("host", rank, 40, 30.0) for rank in range(4))
    diagnosis = diagnose(_job(job_spans("j", 4, 120, faults)))
    assert [(a.kind, a.cause) for a in diagnosis.anomalies] == []
    assert [(h["ranks"], h["first_step"]) for h in diagnosis.host_contention] == [([], 40)]
    text = render(diagnosis)
    assert "No anomalies found." in text and "all ranks steps 40-119" in text
    # the same slowdown with more work on every rank is the job's
    worked = diagnose(_job(job_spans("j", 4, 120, tuple(Fault("compute", r, 40, 30.0) for r in range(4)))))
    assert [(a.kind, a.cause) for a in worked.anomalies] == [("fail_slow", "compute")]



# These synthetic jobs are short (a fraction of a second slowed): the tests below judge
# the cause, not the persistence in seconds (DiagnosisConfig.min_persist_s).
_ANY_LENGTH = DiagnosisConfig(min_persist_s=0)

def test_job_wide_compute_that_burnt_no_more_cpu_is_the_host_even_asleep():
    """A CPU-only job whose every rank's compute grew while its training threads burnt no
    more CPU and the run queue shows only a part of it (the rest asleep: the GIL of a
    descheduled thread, page faults; a healthy 2-rank job on a busy CI host): the host,
    not `fail_slow [] compute`. The same growth with more CPU burnt stays the job's."""
    faults = tuple(f for r in range(2) for f in (Fault("host", r, 10, 3.0), Fault("asleep", r, 10, 5.0)))
    diagnosis = diagnose(_job(job_spans("j", 2, 20, faults, base_ms=10.0)), _ANY_LENGTH)
    assert diagnosis.anomalies == []
    [row] = diagnosis.host_contention
    assert (row["ranks"], row["first_step"]) == ([], 10)
    assert 2.0 < row["runqueue_delta_ms"] < 3.5 and 4.0 < row["asleep_delta_ms"] < 6.5, row
    assert "ms/step asleep" in render(diagnosis)
    burnt = diagnose(_job(job_spans("j", 2, 20, tuple(Fault("compute", r, 10, 8.0) for r in range(2)),
                                    base_ms=10.0)), _ANY_LENGTH)
    assert [(a.kind, a.cause, a.first_step) for a in burnt.anomalies] == [("fail_slow", "compute", 10)]

def test_a_rank_slow_and_stalling_is_counted_once_in_where_the_time_went():
    """Rank 1 computes 30 ms more every step and pauses 100 ms in GC every 5th: two
    labels (two causes), but each lost second is credited once, split by what each adds
    per step, so the table adds up to what was lost and never past it."""
    faults = (Fault("compute", 1, 22, 30.0), Fault("gc", 1, 22, 100.0, every=5))
    diagnosis = diagnose(_job(job_spans("j", 4, 300, faults)))
    labels = {(a.cause, a.evidence.get("pattern")) for a in diagnosis.anomalies if a.kind == "straggler"}
    assert labels == {("compute", None), ("gc", "periodic")}
    rows = {(r["who"], r["cause"]): r["share"] for r in diagnosis.time_lost}
    lost = sum(rows.values())
    assert lost <= 1.0 and abs(lost - 0.49) < 0.05, rows
    # 30 ms every step against 100 ms every 5th: about 60 / 40
    assert 0.5 < rows[("rank 1", "compute")] / (lost - rows[("no label (noise, short stalls)", "-")]) < 0.7, rows


def test_a_straggler_is_not_also_the_hosts_over_the_same_steps():
    """Rank 1 is the job's straggler (its work grew) from step 22; over part of the run a
    second label calls the same rank host-starved. The rank's extra run-queue wait came
    with its extra work: no "The host, not the job" row for it. Another rank the host
    starved is still said."""
    from flare.diagnostics.merging import host_contention as _host_contention
    from flare.diagnostics.model import Anomaly

    def label(ranks, first, last, host=False, cause="compute"):
        return Anomaly(kind="straggler", ranks=ranks, cause=cause, first_step=first, last_step=last,
                       impact=0.1, confidence=0.9, summary="",
                       evidence={"host_starved": True} if host else {})

    job = label([1], 22, 399)
    kept, host = _host_contention([job, label([1], 33, 342, host=True), label([3], 50, 80, host=True)])
    assert kept == [job]
    assert [(h.ranks, h.first_step) for h in host] == [([3], 50)]


def test_a_ranks_stalls_inside_its_own_slowdown_of_the_same_cause_are_its_evidence():
    """`straggler 2 input 40-299` and `straggler 2 input 40-298 … stalls every 2 steps`
    (a slow loader whose workers fall behind every other step) are one problem: one
    label, the stalls its evidence. A stall pattern of another cause stays its own."""
    from flare.diagnostics.model import Anomaly
    from flare.diagnostics.pipeline import merge

    def label(cause, first, last, **evidence):
        return Anomaly(kind="straggler", ranks=[2], cause=cause, first_step=first, last_step=last,
                       impact=0.5, confidence=0.9, summary="rank 2 is slow", evidence=dict(evidence))

    slow = label("input", 40, 299)
    stalls = label("input", 40, 298, pattern="periodic", period_steps=2, stall_ms=80.0)
    gc = label("gc", 40, 290, pattern="periodic", period_steps=10, stall_ms=300.0)
    kept = merge([slow, stalls, gc])
    assert kept == [slow, gc]
    assert slow.evidence["stalls"] == {"pattern": "periodic", "period_steps": 2, "stall_ms": 80.0,
                                       "cause": "input"}
    assert slow.summary.endswith("it stalls every 2 steps")
    # a short stretch of the same cause inside a long pattern is not its owner: it is the
    # pattern's later evidence, and the one label spans both
    burst = label("compute", 48, 58)
    checkpoint = label("compute", 8, 56, pattern="periodic", period_steps=8, stall_ms=80.0)
    assert merge([burst, checkpoint]) == [checkpoint]
    assert (checkpoint.first_step, checkpoint.last_step) == (8, 58)
    assert checkpoint.evidence["later"]["first_step"] == 48


def test_a_hangs_time_is_named_in_where_the_time_went():
    from flare.diagnostics import ledger as ledgers
    from flare.diagnostics.model import Anomaly

    book = ledgers.Ledger(lost_ms=np.zeros(10), step_ms=np.full(10, 100.0), steps=np.ones(10),
                          culprits=np.zeros((4, 10), dtype=bool), significant=np.zeros(10, dtype=bool),
                          warm=np.ones(10, dtype=bool), noise_ms=1.0, has_wait=True)
    hang = Anomaly(kind="hang", ranks=[2], cause="software", first_step=10, last_step=None, impact=1.0,
                   confidence=0.9, summary="hang at step 10", evidence={"elapsed_s": 3.0})
    rows = ledgers.where_the_time_went(book, [hang])
    assert rows[0] == {"who": "rank 2", "cause": "hang (software)", "kind": "hang", "seconds": 3.0,
                       "share": 0.75}  # 3 s stuck of 1 s of steps + 3 s stuck
    assert sum(r["share"] for r in rows) <= 1.0


def _without_runqueue(table: pa.Table, ranks: set[int]) -> pa.Table:
    """The table as ranks on a host without scheduler statistics report it: their
    training thread's CPU per step, no run-queue wait."""
    import json

    rows = []
    for attrs, rank in zip(table["attributes"].to_pylist(), table["rank"].to_pylist(), strict=True):
        values = json.loads(attrs)
        if rank in ranks:
            values.pop("flare.step.cpu.runqueue_ms", None)
        rows.append(json.dumps(values))
    return table.set_column(table.schema.get_field_index("attributes"), "attributes", pa.array(rows))


def test_ranks_whose_host_hides_scheduler_statistics_are_said_once_and_labelled_by_work():
    """A container that hides /proc/thread-self/schedstat: the ranks report their CPU but
    no run-queue wait. The report says once that contention cannot be told apart there,
    a straggler whose work grew is still named, and nothing is withdrawn as the host's."""
    table = _without_runqueue(job_spans("j", 4, 80, (Fault("compute", 2, 30, 40.0),)), {1, 2})
    diagnosis = diagnose(_job(table))
    assert [(a.ranks, a.cause, a.first_step) for a in diagnosis.anomalies if a.kind == "straggler"] == [
        ([2], "compute", 30)]
    assert diagnosis.contention_unknown["ranks"] == [1, 2]
    assert diagnosis.host_contention == []
    text = render(diagnosis)
    assert text.count("Host contention unknown: ranks 1,2 report no run-queue wait") == 1, text
    assert diagnosis.to_json()["contention_unknown"]["ranks"] == [1, 2]
    # a rank starved by the host, on such a host: not withdrawn as "the host", said once
    starved = diagnose(_job(_without_runqueue(job_spans("j", 4, 80, (Fault("host", 2, 30, 40.0),)),
                                              {0, 1, 2, 3})))
    assert starved.host_contention == []
    assert [a.ranks for a in starved.anomalies if a.kind == "straggler"] == [[2]]
    assert render(starved).count("Host contention unknown") == 1
    # where every rank reports its wait, nothing is said
    assert diagnose(_job(job_spans("j", 4, 80))).contention_unknown is None


def test_a_gil_holding_thread_on_a_busy_host_is_the_ranks_own_not_the_hosts():
    """Rank 2's own thread holds the GIL on a loaded host: its training thread waits for
    a CPU (run-queue) as well as for the GIL, while that thread burns CPU of its own. The
    extra CPU is the rank's: a straggler of cause cpu, never "the host"."""
    diagnosis = diagnose(_job(job_spans("j", 4, 120, (Fault("busy_thread_loaded", 2, 30, 40.0),))))
    assert [(a.ranks, a.cause, a.first_step) for a in diagnosis.anomalies if a.kind == "straggler"] == [
        ([2], "cpu", 30)]
    assert diagnosis.host_contention == []


def test_a_gil_holder_whose_toll_falls_between_its_steps_is_still_its_straggler():
    """A GIL-holding thread that takes the GIL in some steps only: the training thread
    gets it back late as the step's last collective returns, so its next step begins
    late and it arrives last, while its own time in the step barely grows (loaded host,
    by hand: +0.05 ms median own time, +19.6 ms of other-thread CPU per step). Its
    threads' CPU names it; the label starts where that CPU jumped, cause cpu."""
    faults = (Fault("gil_between_steps", 2, 30, 30.0),)
    diagnosis = diagnose(_job(job_spans("j", 4, 120, faults)))
    labels = [(a.kind, a.ranks, a.cause, a.first_step) for a in diagnosis.anomalies]
    assert labels == [("straggler", [2], "cpu", 30)], labels
    evidence = diagnosis.anomalies[0].evidence
    assert evidence["work_grew"] and evidence["cpu_burnt_delta_ms"] > 25
    assert evidence["excess_ms_per_step"] > 0.5  # the means' excess, not the median's ~0.9
    assert diagnosis.host_contention == []
    # the same job without the busy thread's CPU reported: nothing tells it from chance
    # lateness by its own time, and no label is made on so small an excess
    table = job_spans("j", 4, 120, faults)
    blind = table.set_column(table.schema.get_field_index("attributes"), "attributes", pa.array(
        [a.replace('"flare.step.cpu.other_threads_ms"', '"x"') for a in table["attributes"].to_pylist()]))
    assert not [a for a in diagnose(_job(blind)).anomalies if a.kind == "straggler"]


def test_a_slow_loader_on_a_rank_that_waits_anyway_costs_nothing_and_is_no_label():
    """Rank 2 is the straggler (+60 ms of compute); rank 1's loader takes 8 ms more per
    step meanwhile (its worker starved on a busy host): rank 1 still waits for rank 2, so
    its loader slows nothing. Alone, the same slow loader is rank 1's cost and a label."""
    faults = (Fault("compute", 2, 20, 60.0), Fault("input", 1, 20, 8.0))
    diagnosis = diagnose(_job(job_spans("j", 4, 80, faults)))
    assert [(a.kind, a.ranks) for a in diagnosis.anomalies] == [("straggler", [2])], diagnosis.anomalies
    alone = diagnose(_job(job_spans("j", 4, 80, (Fault("input", 1, 20, 8.0),))))
    stalls = [a for a in alone.anomalies if a.ranks == [1] and a.cause == "input"]
    assert stalls and all(a.impact >= 0.05 for a in stalls), alone.anomalies


def test_a_job_wide_slowdown_just_before_a_rank_fails_is_that_failures_echo():
    """Rank 1 raises at step 20; the steps just before it read as a job-wide slowdown of
    communication (the other rank waiting on the failing one): one problem, the error,
    with the slowdown as its evidence. One well before the failure stays its own label."""
    from flare.diagnostics.model import Anomaly
    from flare.diagnostics.pipeline import merge

    error = Anomaly("error", [1], "software", 20, 20, 0.1, 0.99, "rank 1 raised")
    echo = Anomaly("fail_slow", [], "communication", 16, 20, 0.2, 0.8, "the job slowed down")
    assert [a.kind for a in merge([error, echo])] == ["error"]
    assert error.evidence["also"] == ["the job slowed down"]
    hang = Anomaly("hang", [2], "software", 20, None, 1.0, 0.99, "rank 2 hung")
    approach = Anomaly("fail_slow", [], "communication", 13, 19, 0.11, 0.7, "the job slowed down")
    assert [a.kind for a in merge([hang, approach])] == ["hang"]
    early = Anomaly("fail_slow", [], "communication", 5, 20, 0.2, 0.8, "the fabric slowed")
    assert [a.kind for a in merge([Anomaly("error", [1], "software", 20, 20, 0.1, 0.99, "…"), early])] == [
        "error", "fail_slow"]


def test_a_checkpoint_that_rank_0_saves_while_the_others_wait_is_labelled_as_such():
    """A framework's checkpoint, saved by rank 0 every 10 steps while the other ranks
    wait for it (the Trainer's save on the main process): one periodic label whose cause
    is the phase, in the words a user reads ("saves a checkpoint every 10 steps (+0.4 s
    each, …)"), with its true share of the run; no `cpu` or `compute` label."""
    table = job_spans("j", 4, 120, (Fault("checkpoint", 0, 10, 400.0, every=10),))
    found = diagnose(_job(table)).anomalies
    assert [(a.kind, a.ranks, a.cause) for a in found] == [("straggler", [0], "checkpoint")]
    label = found[0]
    assert label.evidence["pattern"] == "periodic" and label.evidence["period_steps"] == 10
    assert label.first_step == 10
    assert label.impact == pytest.approx(_measured_share(table, set(range(10, 120, 10))), rel=0.2)
    assert re.match(r"rank 0 saves a checkpoint every 10 steps \(\+0\.4 s each, 11 times from "
                    r"step 10 to 1\d\d\) while the other 3 ranks wait; \d+% of the run's time$",
                    label.summary), label.summary


def test_an_evaluation_every_rank_runs_is_time_spent_not_a_label():
    """Every rank evaluates for 300 ms every 20 steps, and every rank saves for 100 ms
    every 50: no label (nobody waits for anybody, and the job did not get slower), and
    "where the time went" lists each phase with its period and its share."""
    faults = (Fault("evaluation", -1, 20, 300.0, every=20), Fault("checkpoint", -1, 50, 100.0, every=50))
    table = job_spans("j", 4, 200, faults)
    diagnosis = diagnose(_job(table))
    assert diagnosis.anomalies == [], [a.summary for a in diagnosis.anomalies]
    phases = {row["cause"]: row for row in diagnosis.time_lost if row["kind"] == "phase"}
    assert set(phases) == {"evaluation", "checkpoint"}, diagnosis.time_lost
    assert phases["evaluation"]["who"] == "all ranks (every 20 steps)"
    assert phases["evaluation"]["seconds"] == pytest.approx(9 * 0.3, rel=0.05)
    assert phases["checkpoint"]["who"] == "all ranks (every 50 steps)"
    assert phases["checkpoint"]["seconds"] == pytest.approx(3 * 0.1, rel=0.05)
    # a share of the run: the steps' median durations summed
    steps, durations = np.asarray(table["step"].to_pylist()), np.asarray(table["duration_ns"].to_pylist())
    run_s = sum(float(np.median(durations[steps == s])) for s in np.unique(steps)) / 1e9
    assert phases["evaluation"]["share"] == pytest.approx(2.7 / run_s, rel=0.1)
    assert sum(row["share"] for row in diagnosis.time_lost) <= 1.0
    text = render(diagnosis)
    assert "No anomalies found." in text and re.search(r"all ranks \(every 20 steps\) +evaluation", text), text


def test_a_slow_ranks_slower_evaluation_is_its_compute_labels_evidence():
    """Rank 2's forward is slower from step 20, and its evaluation every 10 steps (the
    same forward passes) slower with it: one compute label that says so, not a second,
    periodic `evaluation` straggler. Rank 0's slow checkpoint, other work on another
    rank, stays a label of its own."""
    faults = (Fault("compute", 2, 20, 60.0), Fault("evaluation", -1, 10, 200.0, every=10),
              Fault("evaluation", 2, 20, 300.0, every=10), Fault("checkpoint", 0, 10, 400.0, every=10))
    found = diagnose(_job(job_spans("j", 4, 120, faults))).anomalies
    assert sorted((a.ranks, a.cause) for a in found) == [([0], "checkpoint"), ([2], "compute")], \
        [a.summary for a in found]
    [compute] = [a for a in found if a.cause == "compute"]
    assert compute.evidence["stalls"]["cause"] == "evaluation"
    assert "its evaluation every 10 steps is slower too" in compute.summary


def test_a_short_episode_in_a_long_run_is_no_label_and_its_live_alert_says_why():
    """Rank 1 slower for 14 steps early on (a loaded host starving its loader): a label
    while the run is short (what the live monitor saw), a blip of a long one (under
    straggler_min_run_share: 0.2 % of a 1,000-step run, seen), and the live alert of it
    is withdrawn with its figures."""
    from flare.diagnostics.pipeline import withdrawn

    episode = (Fault("compute", 1, 25, 15.0, to_step=38),)
    [live] = [a for a in diagnose(_job(job_spans("j", 4, 50, episode)), _ANY_LENGTH).anomalies]
    assert (live.kind, live.ranks) == ("straggler", [1]) and live.impact >= 0.01
    final = diagnose(_job(job_spans("j", 4, 600, episode)), _ANY_LENGTH)
    assert final.anomalies == []
    [why] = withdrawn([live], final.anomalies, blips=final.blips)
    assert why["reason"].startswith("a short episode: steps 25-3") and "under the 1% a label needs" in why["reason"], why


def test_a_group_whose_members_begin_together_is_one_label_though_one_recovers_first():
    """A slowed pipeline stage (ranks 2 and 3) on a loaded host: rank 2 stopped arriving
    last 17 steps before rank 3 (its runs overlap under 60 % of their union). Begun at
    the same step, it is one episode: one label of the group, not two of its members."""
    faults = (Fault("compute", 2, 20, 60.0, to_step=33), Fault("compute", 3, 20, 60.0))
    groups = {"stage1": (2, 3), "stage0": (0, 1)}
    found = straggler.detect(_job(job_spans("j", 4, 50, faults, groups=groups)), DiagnosisConfig())
    assert [(a.ranks, a.first_step) for a in found] == [([2, 3], 20)], [(a.ranks, a.first_step, a.last_step) for a in found]


def test_a_members_stalls_inside_its_groups_label_are_its_evidence():
    """Rank 3 of a slowed stage also stalls in bursts (a loaded host): the bursts are
    the stage's label's evidence (`stalls`, with the member), not a second label."""
    bursts = [Fault("compute", 3, s, 300.0, to_step=s + 1) for s in (25, 29, 35)]
    faults = (Fault("compute", 2, 20, 60.0), Fault("compute", 3, 20, 60.0), *bursts)
    groups = {"stage1": (2, 3), "stage0": (0, 1)}
    found = [a for a in diagnose(_job(job_spans("j", 4, 50, faults, groups=groups))).anomalies
             if a.kind == "straggler"]
    assert [a.ranks for a in found] == [[2, 3]], [(a.ranks, a.first_step, a.evidence.get("pattern")) for a in found]


@pytest.mark.parametrize("extra_ms", [8.0, 30.0])
def test_a_rank_that_stalls_periodically_then_slows_on_every_step_is_one_label(extra_ms):
    """Rank 0 stalls every 8 steps from step 8, and from step 47 its compute is slower on
    every step too (seen on a loaded host as `straggler [0] compute @8` beside a second
    `straggler [0] compute @47`): one rank, one cause, one label from the first stall,
    the later stretch its evidence; where the time went credits both, once."""
    table = job_spans("j", 4, 64, (Fault("compute", 0, 8, 80.0, every=8), Fault("compute", 0, 47, extra_ms)))
    diagnosis = diagnose(_job(table))
    assert [(a.kind, a.ranks, a.cause, a.first_step) for a in diagnosis.anomalies] == [
        ("straggler", [0], "compute", 8)], diagnosis.anomalies
    label = diagnosis.anomalies[0]
    assert label.evidence["period_steps"] == 8 and label.last_step == 63
    assert abs(label.evidence["later"]["first_step"] - 47) <= 1, label.evidence["later"]
    assert "slower on every step too" in label.summary, label.summary
    stall_steps = set(range(8, 64, 8)) | set(range(47, 64))
    row = next(r for r in diagnosis.time_lost if r["kind"] == "straggler")
    assert row["share"] == pytest.approx(_measured_share(table, stall_steps), rel=0.25), diagnosis.time_lost
    assert sum(r["share"] for r in diagnosis.time_lost) <= 1.0


def test_a_group_whose_members_slow_unequally_is_one_label_not_one_hidden_behind_the_other():
    """A slowed pipeline stage on a loaded host: rank 2 of stage 1 +62 ms/step, rank 3
    +44 ms/step, from step 20 (seen). The job waits for rank 2 first, so rank 3 is never
    a culprit and was named `hidden behind rank 2` — but both members of the group began
    together, for the same cause: the stage is slow, one label of the group."""
    faults = (Fault("compute", 2, 20, 62.0), Fault("compute", 3, 21, 44.0))
    groups = {"stage1": (2, 3), "stage0": (0, 1)}
    found = straggler.detect(_job(job_spans("j", 4, 50, faults, groups=groups)), DiagnosisConfig())
    assert [(a.ranks, a.cause) for a in found] == [([2, 3], "compute")], [
        (a.ranks, a.first_step, a.evidence.get("hidden_behind")) for a in found]
    assert abs(found[0].first_step - 20) <= 1 and found[0].impact > 0.3
    assert "stage1" in found[0].summary, found[0].summary


def test_two_causes_in_one_group_stay_two_labels_one_hidden():
    """Rank 1's compute +40 ms/step behind rank 2's slower input: one node, two faults —
    the hidden one keeps its own label and cause."""
    faults = (Fault("input", 2, 20, 70.0), Fault("compute", 3, 20, 40.0))
    groups = {"stage1": (2, 3), "stage0": (0, 1)}
    found = straggler.detect(_job(job_spans("j", 4, 50, faults, groups=groups)), DiagnosisConfig())
    assert sorted((a.ranks, a.cause) for a in found) == [([2], "input"), ([3], "compute")], [
        (a.ranks, a.cause, a.first_step) for a in found]


def test_compute_burnt_as_cpu_is_dated_by_the_cpu_not_by_the_sleep_before_it():
    """A slow node (ranks 2 and 3, +40 ms of CPU-burning compute from step 20) whose
    ranks slept 12 ms more per step from step 8 (the GIL of a thread a busy host
    descheduled): its compute rose at 8, its training threads' CPU at 20. The fault is
    dated by the CPU it burns (CI: this label was dated @6 and @10)."""
    faults = tuple(f for r in (2, 3) for f in (Fault("asleep", r, 8, 12.0, to_step=20),
                                               Fault("compute", r, 20, 40.0)))
    for seed in range(3):
        diagnosis = diagnose(_job(job_spans("j", 4, 60, faults, base_ms=15.0, seed=seed, node_size=2)))
        assert [(a.kind, a.ranks, a.cause, a.first_step, a.evidence.get("group"))
                for a in diagnosis.anomalies] == [("straggler", [2, 3], "compute", 20, "node 1")]


def test_a_slowdown_dated_by_one_ranks_change_is_never_made_job_wide():
    """When the job's step time is too noisy to split, fail_slow dates a slowdown by the
    ranks whose own time changed; if then no rank drove it, nothing stands behind a
    job-wide label. Rank 0 +4 ms of compute from step 15 on a host that delays a quarter
    to a third of the steps (a healthy compiled job at 2 busy processes per core gave
    "fail_slow [] communication" this way): 3 job-wide labels at steps 21-25 over these
    120 runs before, none now."""
    from flare.diagnostics.detectors import fail_slow

    config = DiagnosisConfig()
    wide = []
    for hiccups in (0.25, 0.35):
        for seed in range(60):
            table = job_spans("j", 4, 40, (Fault("compute", 0, 15, 4.0),), base_ms=8.0, seed=seed,
                              hiccups=hiccups, comm_ms=2.0)
            frame = frames.load(_job(table), config)
            wide += [(hiccups, seed, a.first_step) for a in fail_slow.find(frame, config) if not a.ranks]
    assert wide == []


def test_a_job_wide_slowdown_burnt_as_cpu_is_dated_by_the_cpu_in_fail_slow_too():
    """The same rule in fail_slow (causes.dating_series): every rank's compute +40 ms of
    CPU-burning work from step 20, after sleeping 16 ms more per step from step 8 (a
    host that descheduled a GIL holder). The job slowed at 20, where its threads' CPU
    rose; its compute had risen at 8."""
    from flare.diagnostics.detectors import fail_slow

    config = DiagnosisConfig()
    faults = tuple(f for r in range(4) for f in (Fault("asleep", r, 8, 16.0, to_step=20),
                                                 Fault("compute", r, 20, 40.0)))
    for seed in range(3):
        frame = frames.load(_job(job_spans("j", 4, 60, faults, base_ms=15.0, seed=seed)), config)
        assert [(a.ranks, a.cause, a.first_step) for a in fail_slow.find(frame, config)] == \
            [([], "compute", 20)]


def test_one_ranks_late_slowdown_without_more_work_is_the_host_not_compute():
    """A healthy 2-rank job of 40 steps beside three busy test workers: rank 0's compute
    grew over the last 8 steps (too few for a straggler) while its threads burnt no more
    CPU, the run queue showing under half of it and the rest asleep. That is the host
    (`asleep_delta_ms` in its row), as it is job-wide; before, "fail_slow [0] compute @32"
    (tier-1 rerun, fresh clone). The same growth burnt as CPU stays the rank's."""
    for seed in range(3):
        idle = diagnose(_job(job_spans("j", 2, 40, (Fault("host", 0, 32, 2.0), Fault("asleep", 0, 32, 5.0)),
                                       base_ms=8.0, seed=seed)), _ANY_LENGTH)
        assert idle.anomalies == [], [(a.kind, a.ranks, a.cause) for a in idle.anomalies]
        assert [(row["ranks"], 4.0 < row["asleep_delta_ms"] < 6.5) for row in idle.host_contention] == [([0], True)]
        busy = diagnose(_job(job_spans("j", 2, 40, (Fault("compute", 0, 32, 7.0),), base_ms=8.0, seed=seed)),
                        _ANY_LENGTH)
        assert [(a.kind, a.ranks, a.cause, a.first_step) for a in busy.anomalies] == [("fail_slow", [0], "compute", 32)]


def test_a_frame_holds_at_most_max_frame_cells_cells():
    """Columns are capped by `max_step_columns` and by `max_frame_cells` / ranks: an
    hour of 1,024 ranks keeps 1,200 columns (buckets of 3 steps), an hour of 6,144
    ranks 244 (buckets of 15), so its matrices stay near 1.5 M cells, not 7.4 M."""
    config = DiagnosisConfig()
    hour = (0, 3599)
    assert frames.bucket_for(hour, config, 3600, 1024) == 3
    assert frames.bucket_for(hour, config, 3600, 6144) == 15
    assert frames.bucket_for(hour, config, 3600) == 3  # rank count unknown: the column cap
    assert frames.bucket_for((0, 99), config, 100, 6144) == 1
    # a real frame built through a backend is bucketed the same way
    small = DiagnosisConfig(max_frame_cells=40)
    frame = frames.load(_job(job_spans("j", 4, 60, (), base_ms=8.0)), small)
    assert frame.bucket == 6 and frame.duration.size <= 40


def test_a_step_that_sleeps_in_the_jobs_own_code_is_the_job_not_the_host():
    """Every rank's step grows by 40 ms that burn no CPU while the run queue stays flat:
    the job's own code waits (a sleep, blocking I/O). Read before as the host, "+41.5
    ms/step asleep", and no label (one process, `time.sleep(0.04)` per step, seen);
    without run-queue wait no busy host stands behind it (causes.cpu_only_idle)."""
    faults = tuple(Fault("asleep", r, 20, 40.0) for r in range(2))
    diagnosis = diagnose(_job(job_spans("j", 2, 60, faults, base_ms=10.0)))
    assert [(a.kind, a.ranks, a.cause, a.first_step) for a in diagnosis.anomalies] == [
        ("fail_slow", [], "compute", 20)]
    assert "burning no more CPU: the step waits" in diagnosis.anomalies[0].summary
    assert diagnosis.host_contention == []
    # without the run queue reported (off Linux) nothing tells the two apart: the host,
    # as before this rule
    table = job_spans("j", 2, 60, faults, base_ms=10.0)
    blind = table.set_column(table.schema.get_field_index("attributes"), "attributes", pa.array(
        [a.replace('"flare.step.cpu.runqueue_ms"', '"x"') for a in table["attributes"].to_pylist()]))
    unreported = diagnose(_job(blind))
    assert unreported.anomalies == [] and len(unreported.host_contention) == 1


def test_compute_shared_with_torchs_intra_op_threads_is_compute_not_starvation():
    """A matmul from step 100 in one process with two OpenMP threads (per-step means,
    measured): the other thread burns +40.8 ms, as a GIL holder would, but the training
    thread burns +39.5 ms itself — it computes, it is not kept waiting. Cause compute,
    not "starved of CPU" (seen). With the training thread's CPU flat, it is starvation."""
    from flare.diagnostics.causes import attribute

    parts = {"dataloader": 0.1, "gc": 0.0, "pycall": 0.0, "checkpoint": 0.0, "evaluation": 0.0}
    past = {**parts, "compute": 1.2, "other_cpu": 0.0, "thread_cpu": 1.4}
    now = {**parts, "compute": 42.4, "other_cpu": 40.8, "thread_cpu": 40.9}
    medians = {k: v for k, v in now.items() if k in (*parts, "compute")}
    before = {k: v for k, v in past.items() if k in (*parts, "compute")}
    assert attribute(medians, before, 0.5, 42.5, 1.3, now, past).cause == "compute"
    starved = {**now, "thread_cpu": 1.5}
    assert attribute(medians, before, 0.5, 42.5, 1.3, starved, past).cause == "cpu"


def test_a_straggler_that_waits_in_its_own_code_says_it_burns_no_more_cpu():
    """Rank 1 sleeps 60 ms in every step from step 20 (a new user's `time.sleep` in a
    callback): compute, as its own step's time, but the words say it burnt no more CPU
    — "its compute is slower" alone sent the reader to its maths."""
    diagnosis = diagnose(_job(job_spans("j", 4, 60, (Fault("asleep", 1, 20, 60.0),))))
    [label] = diagnosis.anomalies
    assert (label.kind, label.ranks, label.cause) == ("straggler", [1], "compute")
    assert "its compute is slower without burning more CPU: it waits" in label.summary
    burnt = diagnose(_job(job_spans("j", 4, 60, (Fault("compute", 1, 20, 60.0),))))
    assert "without burning more CPU" not in burnt.anomalies[0].summary


def test_the_step_a_users_stop_cut_short_is_read_by_no_detector():
    """The step each rank was in when its user stopped the job ends at the stop (rank 1
    of a stopped 2-rank job: 6.1 s to its SIGTERM, seen read as "fail_slow [1] cpu"): no
    detector reads it once the job is known to be stopped."""
    frame = frames.load(_job(job_spans("j", 2, 40)), DiagnosisConfig())
    ended = frames.warm_mask(frame, DiagnosisConfig())
    stopped = frames.warm_mask(frame, DiagnosisConfig(stopped_by_user=True))
    assert ended[-1] and not stopped[-1]
    assert (ended[:-1] == stopped[:-1]).all()
