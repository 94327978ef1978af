"""Culprit against peer, line by line, from captured steps."""

from __future__ import annotations

from flare.diagnostics import hotspots
from flare.wire import semconv as sc


def _capture(rank, step, frames):
    return {"rank": rank, "step": step, sc.CAPTURE_FRAMES: list(frames),
            sc.CAPTURE_SAMPLES: list(frames.values()), sc.CAPTURE_INTERVAL_MS: 10.0}


def test_the_culprits_extra_line_comes_first_with_both_sides_per_step():
    rows = []
    for step in range(40, 44):
        rows.append(_capture(2, step, {"train.py:88 in slow_layer": 6, "train.py:120 in main": 1}))
        rows.append(_capture(0, step, {"train.py:120 in main": 6, "train.py:88 in slow_layer": 0}))
    rows.append(_capture(2, 10, {"train.py:5 in before": 50}))  # before the label: not counted
    found = hotspots._compare(rows, {2}, 40, 60)
    assert found[0] == {"frame": "train.py:88 in slow_layer", "culprit_ms": 60.0, "peer_ms": 0.0,
                        "delta_ms": 60.0, "culprit_steps": 4, "peer_steps": 4}
    assert [h["frame"] for h in found] == ["train.py:88 in slow_layer"]  # main: the peer's more


def test_without_captures_of_the_labels_ranks_there_is_nothing_to_say():
    assert hotspots._compare([_capture(0, 41, {"a.py:1 in f": 5})], {2}, 40, 60) == []


def test_culprit_and_peer_are_compared_over_the_steps_both_were_captured():
    """The culprit captured over 12 steps, the peer over 40 (it was asked earlier): the
    culprit's wait in a collective in its first steps must not outrank the function that
    spends its extra time, so only the steps both have are compared."""
    rows = []
    for step in range(40, 52):  # both captured: the culprit's extra 38 ms in extra_matmuls
        rows.append(_capture(1, step, {"fsdp_tp.py:39 in extra_matmuls": 4, "fsdp_tp.py:66 in main": 5}))
        rows.append(_capture(3, step, {"fsdp_tp.py:66 in main": 5}))
    for step in range(10, 40):  # the peer alone, earlier: not in the culprit's label
        rows.append(_capture(3, step, {"fsdp_tp.py:66 in main": 1}))
    for step in range(52, 55):  # the culprit alone, later, waiting in all_reduce
        rows.append(_capture(1, step, {"fsdp_tp.py:66 in main": 30}))
    found = hotspots._compare(rows, {1}, 10, 60)
    assert found[0]["frame"] == "fsdp_tp.py:39 in extra_matmuls", found
    assert found[0]["culprit_steps"] == found[0]["peer_steps"] == 12
    assert [h["frame"] for h in found] == ["fsdp_tp.py:39 in extra_matmuls"]


def test_a_line_the_culprit_was_blocked_on_never_leads_a_line_it_worked_on():
    """The slow rank waited longer in its all_reduce (+39 ms) than it worked in its extra
    function (+38 ms): the work leads, the wait follows as "waiting in …"; where its
    extra time is all waiting (a loader sleeping in I/O) the wait is the line."""
    wait = "waiting in train.py:59 in main"
    work = "train.py:39 in extra_matmuls"
    rows = [_capture(2, step, {wait: 9.3, work: 3.8}) for step in range(40, 52)]
    rows += [_capture(1, step, {wait: 5.4}) for step in range(40, 52)]
    found = hotspots._compare(rows, {2}, 40, None)
    assert [h["frame"] for h in found] == [work, wait]
    assert found[1]["delta_ms"] > found[0]["delta_ms"]
    sleeping = [_capture(2, step, {"waiting in data.py:12 in __getitem__": 6.0, "train.py:20 in main": 1.3})
                for step in range(40, 50)]  # +3 ms of work (a loaded host) beside +60 ms asleep
    sleeping += [_capture(1, step, {"train.py:20 in main": 1.0}) for step in range(40, 50)]
    found = hotspots._compare(sleeping, {2}, 40, None)
    assert [h["frame"] for h in found] == ["waiting in data.py:12 in __getitem__", "train.py:20 in main"]


def test_an_input_bound_ranks_line_is_its_workers_per_step_of_their_recording():
    """The culprit's training thread only waits for its batches; its DataLoader workers,
    recorded over 20 captured steps, spent 1.2 s in the collate function (60 ms per step)
    where the peer's spent 2 ms per step: the worker's line leads, per step, and the wait
    follows."""
    wait = "waiting in train.py:80 in main"
    collate = "[DataLoader worker] data.py:31 in __call__"
    rows = [_capture(2, step, {wait: 5.0, "train.py:60 in forward": 1}) for step in range(40, 60)]
    rows += [_capture(0, step, {"train.py:60 in forward": 1}) for step in range(40, 60)]
    for rank, samples in ((2, 120), (0, 4)):  # two workers' samples together, 10 ms each
        rows.append({**_capture(rank, 59, {collate: samples}), sc.CAPTURE_WINDOW_STEPS: 20})
    found = hotspots._compare(rows, {2}, 40, None)
    assert [h["frame"] for h in found] == [collate, wait]
    assert found[0]["culprit_ms"] == 60.0 and found[0]["peer_ms"] == 2.0
    assert found[0]["culprit_steps"] == found[0]["peer_steps"] == 20  # the steps, not the window row


def test_a_line_read_before_the_culprits_workers_capture_is_in_is_pending():
    """Steps captured while the culprit's workers were being recorded say so; until the
    workers' capture arrives the line is not the final one (flare run waits to print it)."""
    rows = [{**_capture(2, step, {"waiting in train.py:80 in main": 5.0}), sc.CAPTURE_WORKERS: 1}
            for step in range(40, 45)]
    rows += [_capture(0, step, {"train.py:60 in forward": 1}) for step in range(40, 45)]
    assert hotspots._workers_pending(rows, {2})
    assert not hotspots._workers_pending(rows, {0})
    rows.append({**_capture(2, 44, {}), sc.CAPTURE_WINDOW_STEPS: 4.5})  # arrived, even without a line
    assert not hotspots._workers_pending(rows, {2})


def test_a_workers_recording_that_ends_after_a_live_labels_last_step_is_its_line():
    """A live label ends at the last step every rank has sent (248); the culprit's
    workers' recording ended in its step 250, over the 15 steps before: it is the
    label's, and its line leads — not the training thread's wait for its batches (the
    live line on a loaded host, seen, while the final report named the worker)."""
    wait = "waiting in train.py:352 in main"
    collate = "[DataLoader worker] train.py:183 in __call__"
    rows = [{**_capture(2, step, {wait: 5.0}), sc.CAPTURE_WORKERS: 1} for step in range(231, 251)]
    rows += [{**_capture(0, step, {"train.py:371 in main": 5.0}), sc.CAPTURE_WORKERS: 1}
             for step in range(230, 250)]
    rows.append({**_capture(2, 250, {collate: 91}), sc.CAPTURE_WINDOW_STEPS: 14.97})
    rows.append({**_capture(0, 249, {}), sc.CAPTURE_WINDOW_STEPS: 14.22})
    assert not hotspots._workers_pending(rows, {2})
    found = hotspots._compare(rows, {2}, 40, 248)
    assert found[0]["frame"] == collate, found
    # a recording that ended before the label began is not its line
    assert [h["frame"] for h in hotspots._compare(rows, {2}, 251, None)] == []


def test_a_label_whose_capture_never_came_says_when_it_was_asked_and_why():
    """An alert 6 s before the job ended asked rank 1 for a capture; the job ended
    before the capture's window did, and the report had no line and no word of it
    (seen). The label now says when the capture was asked and why no line came."""
    from flare.diagnostics.backends.arrow import ArrowJobData
    from flare.diagnostics.pipeline import diagnose
    from flare.diagnostics.report_text import render
    from flare.diagnostics.synthetic import Fault, job_spans

    table = job_spans("j", 4, 60, (Fault("compute", 1, 20, 60.0),))
    diagnosis = diagnose(ArrowJobData("j", "synthetic", lambda *_: table))
    requests = hotspots.CaptureRequests(lambda job, ranks, steps: {"asked": ranks}, "j")
    requests.asked_at = {1: 52}  # as on_alert records it: the job's last step at the alert
    requests.unanswered(diagnosis.anomalies, diagnosis.steps)
    [label] = diagnosis.anomalies
    assert label.callsite is None
    assert label.evidence["capture"] == {"asked_at_step": 52, "window_steps": 20, "last_step": 59,
                                         "ended_early": True}
    assert ("no line: its ranks were asked for a capture at step 52; the job ended at step 59, "
            "before the capture's 20 steps were done") in render(diagnosis)
    # asked early enough for the whole window: the capture ran, and no line stood out
    requests.asked_at = {1: 30}
    requests.unanswered(diagnosis.anomalies, diagnosis.steps)
    assert label.evidence["capture"]["ended_early"] is False
    assert ("no line: its ranks were captured from step 30; no line of theirs took more time "
            "than their peer's") in render(diagnosis)
