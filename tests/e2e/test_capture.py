"""From a label to the line, end to end: `flare run` asks the culprit and one healthy
peer for a targeted capture when the live label appears, and the label gains the line
the culprit spends its extra time on (the slowing function of the injected fault).
"""

from __future__ import annotations

import re
import time

import harness
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.flaky(reruns=1)]

ONSET = 40


# fault -> the function its line must be in (examples/train_ddp.py): the slowing
# compute, the slow collate function of the data loader, the GIL-holding thread's loop
LINES = {"compute": r"examples/train_ddp\.py:\d+ in burn_compute$",
         "input": r"examples/train_ddp\.py:\d+ in __call__$",
         "cpu": r"^\[thread gil-hog\] .*examples/train_ddp\.py:\d+ in _run$"}


@pytest.mark.parametrize("fault", ["compute", "input", "cpu"])
def test_a_live_straggler_is_given_its_line(store, fault):
    started = time.time()
    run = harness.FlareRun(store, f"capture_{fault}", harness.torchrun(
        harness.TRAIN_DDP, "--steps", 320, "--hidden", 256, "--fault", fault,
        "--fault-rank", 2, "--fault-from", ONSET))
    report = run.finish()
    print(f"\nE2E capture, rank 2 {fault}:\n{harness.describe(report)}")
    straggler = next(a for a in report["anomalies"] if a["kind"] == "straggler")
    assert straggler["ranks"] == [2], harness.describe(report)
    top = straggler["evidence"]["hotspots"][0]
    assert re.search(LINES[fault], top["frame"]), straggler["evidence"]["hotspots"]
    assert top["delta_ms"] > 20 and top["peer_ms"] < 0.3 * top["culprit_ms"], top
    assert straggler["callsite"].startswith(top["frame"] + ": +")
    # asked of the culprit and one peer only: no other rank captured
    captured = {rank for (rank,) in run.query(
        "SELECT DISTINCT rank FROM spans WHERE job = ? AND name = 'flare.capture'", [run.job])}
    assert 2 in captured and len(captured) == 2, captured
    # the line came live, within 30 s of the fault's onset
    located = next((t for t, line in run.alerts if "[straggler]" in line and " at " in line
                    and top["frame"].rsplit(" in ", 1)[-1] in line), None)
    assert located is not None, run.alerts
    onset_s = run.onset_ns(2, ONSET) / 1e9
    print(f"onset -> line: {located / 1e9 - onset_s:.1f} s (run started {started:.0f})")
    assert located / 1e9 - onset_s <= 30
