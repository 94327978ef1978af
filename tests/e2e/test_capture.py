"""From a label to the line, end to end: `flare run` asks the culprit and one healthy
peer for a targeted capture when the live label appears, and the label gains the line
the culprit spends its extra time on (the slowing function of the injected fault). Each
scenario is also fault injection's rank-level cause (compute, input, cpu): its labels and
onset are asserted here (`_rank_labels`), and for compute its live alerts and HTML
report (`_compute_labels_and_report`). Each runs on a quiet host and on
a loaded one (one busy process per core beside the job: the `host` fixture), which must
give the same labels and the same line.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import harness
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.flaky(reruns=1)]

ONSET = 40
# The job's length at most: it is stopped (Ctrl-C, as its user would) once the live
# alerts have said what the scenario looks for, which on a quiet host comes near step
# 200. The GIL-holding thread's steps are short (~33 ms loaded): with 400 steps the job
# had ended before its line came in 2 of 4 loaded runs by hand, when its label rested on
# its own time in the step; named by its threads' CPU (straggler.find), its line came
# 12-17 s after the onset in 7 of 7 loaded runs.
STEPS_AT_MOST = 1000


# fault -> the function its line must be in (examples/train_ddp.py): the slowing
# compute, the slow collate function, run in the rank's DataLoader worker process (the
# input scenario's loader has one: its line is the worker's, not the training thread's
# wait for the batch), the GIL-holding thread's loop
LINES = {"compute": r"examples/train_ddp\.py:\d+ in burn_compute$",
         "input": r"^\[DataLoader worker\] .*examples/train_ddp\.py:\d+ in __call__$",
         "cpu": r"^\[thread gil-hog\] .*examples/train_ddp\.py:\d+ in _run$"}
FUNCTIONS = {"compute": "burn_compute", "input": "__call__", "cpu": "_run"}


def _located(alerts: list[tuple[int, str]], function: str) -> tuple[int, str] | None:
    """The live straggler alert that gives rank 2 a line in `function`."""
    return next(((t, line) for t, line in alerts if "[straggler] ranks 2 " in line
                 and " at " in line and f" in {function}" in line), None)


def _said_enough(fault: str):
    """Whether the live alerts hold the line the scenario looks for."""
    function = FUNCTIONS[fault]
    return lambda alerts: _located(alerts, function) is not None


@pytest.mark.parametrize("fault", ["compute", "input", "cpu"])
def test_a_live_straggler_is_given_its_line(store, host, fault):
    started = time.time()
    workers = ("--num-workers", 1) if fault == "input" else ()
    run = harness.FlareRun(store, harness.job_name(f"capture_{fault}", host), harness.torchrun(
        harness.TRAIN_DDP, "--steps", STEPS_AT_MOST, "--hidden", 256, "--fault", fault,
        "--fault-rank", 2, "--fault-from", ONSET, *workers))
    if run.wait_until(_said_enough(fault), timeout_s=240):
        run.interrupt()
    report = run.finish()
    print(f"\nE2E capture, rank 2 {fault} ({host}):\n{harness.describe(report)}")
    straggler = next((a for a in report["anomalies"] if a["kind"] == "straggler"), None)
    if straggler is None or "hotspots" not in straggler["evidence"]:  # no label, or no line
        harness.agree(f"capture rank 2 {fault}", host, report, None)
    assert straggler is not None and straggler["ranks"] == [2], harness.describe(report)
    assert "hotspots" in straggler["evidence"], harness.describe(report)
    top = straggler["evidence"]["hotspots"][0]
    harness.agree(f"capture rank 2 {fault}", host, report, top["frame"].split(":")[0] + " in "
                  + top["frame"].rsplit(" in ", 1)[-1])
    assert re.search(LINES[fault], top["frame"]), straggler["evidence"]["hotspots"]
    # a real share of the step, the culprit's own (the GIL-holding thread's 60 ms a step
    # read 18 ms per step on a loaded host, where the hog thread waits for a CPU too)
    assert top["delta_ms"] > 10 and top["peer_ms"] < 0.3 * top["culprit_ms"], top
    assert straggler["callsite"].startswith(top["frame"] + ": +")
    # asked of the culprit and one peer only, and of a rank a live alert named that the
    # final report withdrew with its reason (loaded: rank 1's loader worker starved for
    # 14 steps, a short episode): no other rank captured
    captured = {rank for (rank,) in run.query(
        "SELECT DISTINCT rank FROM spans WHERE job = ? AND name = 'flare.capture'", [run.job])}
    withdrawn = {r for alert in report.get("withdrawn_alerts", []) for r in alert["ranks"]}
    assert 2 in captured and len(captured - withdrawn) == 2, (captured, withdrawn, "".join(
        line for line in run.stderr if line.startswith(("flare:", "1", "0", "2"))))
    # the line came live, within 30 s of the fault's onset
    located = _located(run.alerts, top["frame"].rsplit(" in ", 1)[-1])
    assert located is not None, run.alerts
    onset_s = run.onset_ns(2, ONSET) / 1e9
    print(f"onset -> line: {located[0] / 1e9 - onset_s:.1f} s (run started {started:.0f})")
    assert located[0] / 1e9 - onset_s <= 30
    # the written-back anomaly span links to the captured steps it was given its line from
    captured_ids = {s for (s,) in run.query(
        "SELECT span_id FROM spans WHERE job = ? AND name = 'flare.capture'", [run.job])}
    linked = {link["span_id"] for (links,) in run.query(
        "SELECT links FROM spans WHERE job = ? AND name = 'flare.anomaly'", [run.job])
        for link in json.loads(links or "[]")}
    assert linked & captured_ids, (linked, len(captured_ids))
    _rank_labels(report, fault)
    if fault == "compute":
        _compute_labels_and_report(store, run, report, top)


def _rank_labels(report: dict, fault: str) -> None:
    """The rank-level cause as fault injection asserts it: every label of rank 2 has the
    fault's cause and starts at its onset, and no other rank is named. The cpu fault's
    hog spins at the start of every step: named from its direct sign, the hog's CPU, and
    its labels may start a few steps late."""
    labels = [a for a in report["anomalies"] if a["ranks"] == [2]]
    assert {a["cause"] for a in labels} == {fault}, harness.describe(report)
    late = 5 if fault == "cpu" else 3
    assert all(-3 <= a["first_step"] - ONSET <= late for a in labels), harness.describe(report)
    assert not [a for a in report["anomalies"] if a["ranks"] and a["ranks"] != [2]], harness.describe(report)
    if fault == "cpu":
        straggler = next(a for a in labels if a["kind"] == "straggler")
        assert straggler["evidence"]["other_threads_cpu_delta_ms"] >= 2.0, straggler
        assert "other threads burn" in straggler["summary"], straggler["summary"]


def _compute_labels_and_report(store, run, report, top) -> None:
    """The compute scenario's labels as fault injection asserts them (kind, cause, onset,
    no other rank, the live alert within 30 s), the job's slowdown nested in its one
    straggler label (one finding, one label), and the HTML report's flame graph."""
    labels = [a for a in report["anomalies"] if a["ranks"] == [2]]
    assert [a["kind"] for a in labels] == ["straggler"], harness.describe(report)
    assert all(a["cause"] == "compute" and abs(a["first_step"] - ONSET) <= 2 for a in labels), \
        harness.describe(report)
    slowdown = labels[0]["evidence"]["job_slowdown"]
    assert slowdown["ranks"] == [2] and abs(slowdown["first_step"] - ONSET) <= 2, slowdown
    assert not [a for a in report["anomalies"] if a["ranks"] and a["ranks"] != [2]], harness.describe(report)
    onset_s = run.onset_ns(2, ONSET) / 1e9
    alert = next((t for t, line in run.alerts if "[straggler] ranks 2 " in line), None)
    assert alert is not None and alert / 1e9 - onset_s <= 30, run.alerts
    print(f"onset -> straggler alert: {alert / 1e9 - onset_s:.1f} s")
    # a live fail-slow of rank 2 (a pass that saw the change point before the straggler
    # persisted) is listed as kept: the final report carries it inside the straggler
    assert all(a["kept"] for a in report.get("live_alerts", []) if a["ranks"] == [2]), report.get("live_alerts")
    # the HTML report draws the culprit against the peer, the slow function in red
    page = store.parent / f"{run.job}.html"
    subprocess.run([str(harness.BIN / "flare"), "diagnose", "--store", str(store), "--job", run.job,
                    "--format", "html", "-o", str(page)], check=True, capture_output=True, timeout=120)
    text = page.read_text()
    function = top["frame"].rsplit(" in ", 1)[-1]
    assert "culprit vs peer" in text and re.search(
        r"<title>[^<]*in " + function + r": [\d.]+ ms/step</title><rect [^>]*fill='#e0533d'", text), \
        "the flame graph does not mark the slow function"
