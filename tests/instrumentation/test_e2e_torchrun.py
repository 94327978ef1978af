"""End to end: real `opentelemetry-instrument torchrun` jobs (gloo, CPU) on
examples/train_ddp.py exporting real OTLP/gRPC to a loopback receiver. Each job has as
few ranks as what it checks needs (2; 3 for a hang's victims to agree; 4 for a
sub-group beside the world): a rank costs ~3 s of CPU to start on this 2-core host."""

from __future__ import annotations

import collections
import os
import signal
import socket
import time

import pytest
from otlp_sink import OtlpSink, rank_of
from torchrun_job import TorchrunJob, wait_until

pytestmark = pytest.mark.e2e
HANG_TIMEOUT_S = 3  # (the hang report at 3-5 s, the alert within 10 s more)


def by_name(spans, name):
    return [s for s in spans if s["name"] == name]


def step_spans_by_rank(spans):
    steps = collections.defaultdict(dict)
    for span in by_name(spans, "train.step"):
        steps[rank_of(span)][span["attributes"]["flare.step"]] = span
    return steps


def test_healthy_ddp_job_reports_every_step_from_every_rank():
    steps_run, ranks = 30, 2
    with OtlpSink() as sink:
        job = TorchrunJob(sink.endpoint, ["--steps", str(steps_run), "--num-workers", "2",
                                          "--fault", "gc", "--fault-rank", "1",
                                          "--fault-from", "0", "--fault-ms", "5"], nproc=ranks,
                          FLARE_DETAIL_EVERY=5, FLARE_HEARTBEAT_S=1,
                          OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,flare").start()
        assert job.wait(timeout=120) == 0, job.output[-3000:]
        time.sleep(0.5)
        spans = sink.spans()

    # nothing from the launcher (or DataLoader workers): every span names a rank, and
    # each rank's spans come from one process
    assert all(rank_of(s) in range(ranks) for s in spans)
    pids = collections.defaultdict(set)
    for span in spans:
        pids[rank_of(span)].add(span["resource"]["process.pid"])
    assert all(len(p) == 1 for p in pids.values()), pids

    steps = step_spans_by_rank(spans)
    assert sorted(steps) == list(range(ranks))
    for rank, numbered in steps.items():
        assert sorted(numbered) == list(range(steps_run)), f"rank {rank} lost steps"
        resource = next(iter(numbered.values()))["resource"]
        assert resource["flare.rank"] == rank
        assert resource["flare.local_rank"] == rank
        assert resource["flare.world_size"] == ranks
        assert resource["service.name"] == "train_ddp_test"
        assert "flare.rank" not in next(iter(numbered.values()))["attributes"]
    job_ids = {s["resource"]["flare.job.id"] for s in spans}
    assert len(job_ids) == 1

    # one trace per step, shared by all ranks; different traces for different steps
    trace_of_step = {}
    for numbered in steps.values():
        for step, span in numbered.items():
            assert trace_of_step.setdefault(step, span["trace_id"]) == span["trace_id"]
    assert len(set(trace_of_step.values())) == steps_run

    # always-on summary on every step
    for numbered in steps.values():
        for span in numbered.values():
            attributes = span["attributes"]
            assert attributes["flare.step.dataloader_count"] >= 1
            assert attributes["flare.step.pg.names"] == ["0"]
            assert attributes["flare.step.pg.counts"][0] >= 1
            assert attributes["flare.step.detail"] == (attributes["flare.step"] % 5 == 0)

    # children nest under their rank's step span, in the step's trace
    span_ids = {(rank_of(s), s["span_id"]): s for s in by_name(spans, "train.step")}
    loader = by_name(spans, "dataloader.next")
    gcs = by_name(spans, "gc.collect")
    assert loader and {rank_of(s) for s in loader} == set(range(ranks))
    assert any(rank_of(s) == 1 for s in gcs), "the gc fault on rank 1 must show"
    for child in loader + gcs:
        parent = span_ids[(rank_of(child), child["parent_span_id"])]
        assert parent["trace_id"] == child["trace_id"]
        assert parent["start_ns"] <= child["start_ns"] <= child["end_ns"] <= parent["end_ns"]
    assert all(s["attributes"]["flare.dataloader.workers"] == 2 for s in loader)
    gc_fault_steps = [s for s in steps[1].values() if s["attributes"]["flare.step.gc_count"]]
    assert len(gc_fault_steps) >= steps_run // 2

    # DDP's C++ bucket all-reduces, from the flight recorder, with sequence ids that
    # agree across ranks on each detail step
    buckets = [s for s in by_name(spans, "collective.all_reduce")
               if s["attributes"]["flare.collective.source"] == "flight_recorder"]
    seqs = collections.defaultdict(set)
    for span in buckets:
        assert span["attributes"]["flare.collective.pg"] == "0"
        seqs[rank_of(span)].add(span["attributes"]["flare.collective.seq"])
    assert sorted(seqs) == list(range(ranks))
    assert len({frozenset(s) for s in seqs.values()}) == 1, seqs
    assert len(seqs[0]) >= 3 * (steps_run // 5 - 1)  # DDP rebuilds its buckets after step 0

    # ...and sized on every step, detail or not: the always-on bytes are the model's
    # gradient bytes, which is also what the flight recorder's buckets add up to
    gradient_bytes = 4 * sum(n_in * n_out + n_out for n_in, n_out in
                             ((256, 512), (512, 512), (512, 512), (512, 16)))
    for numbered in steps.values():
        for span in numbered.values():
            assert span["attributes"]["flare.step.pg.bytes"] == [gradient_bytes]
            assert span["attributes"]["flare.step.collective_bytes"] == gradient_bytes
    detail_trace = steps[0][10]["trace_id"]
    assert sum(s["attributes"]["flare.collective.bytes"] for s in buckets
               if rank_of(s) == 0 and s["trace_id"] == detail_trace) == gradient_bytes

    heartbeats = by_name(spans, "flare.heartbeat")
    assert {rank_of(s) for s in heartbeats} == set(range(ranks))


def _hang_spans(sink):
    return {rank_of(s): s for s in by_name(sink.spans(), "flare.hang")}


def _run_hang(fault: str, fault_rank: int, fault_from: int, ranks: int):
    with OtlpSink() as sink:
        job = TorchrunJob(sink.endpoint, ["--steps", "200", "--fault", fault,
                                          "--fault-rank", str(fault_rank),
                                          "--fault-from", str(fault_from)], nproc=ranks,
                          FLARE_HANG_TIMEOUT_S=HANG_TIMEOUT_S, FLARE_HEARTBEAT_S=1,
                          FLARE_DETAIL_EVERY=5).start()
        try:
            arrived = wait_until(lambda: len(_hang_spans(sink)) == ranks,
                                 timeout=60 + HANG_TIMEOUT_S + 10)
        finally:
            job.stop()
        spans = sink.spans()
    assert arrived, f"hang spans only from {sorted(_hang_spans(sink))}\n{job.output[-2000:]}"
    hangs = {rank_of(s): s for s in by_name(spans, "flare.hang")}
    stuck_step = step_spans_by_rank(spans)[fault_rank]
    onset_ns = max(s["end_ns"] for s in stuck_step.values() if s["status_code"] != 2)
    latest = max(s["arrived"] for s in hangs.values())
    latency_s = (latest - onset_ns) / 1e9
    print(f"{fault}: last hang span arrived {latency_s:.1f} s after the stuck rank's last step")
    assert latency_s <= HANG_TIMEOUT_S + 10
    return spans, hangs


def test_hang_in_python_before_all_reduce_is_reported_by_every_rank():
    spans, hangs = _run_hang("hang", fault_rank=1, fault_from=12, ranks=3)
    stuck = hangs[1]["attributes"]
    assert "wait_for_shared_filesystem" in stuck["flare.hang.stacks"]
    assert stuck["flare.callsite"].endswith("in wait_for_shared_filesystem")
    for rank in (0, 2):
        victim = hangs[rank]["attributes"]
        assert victim["flare.hang.collective_op"] == "all_reduce"
        assert victim["flare.hang.pg"] == "0"
        assert isinstance(victim["flare.hang.seq"], int)
        assert "wait_for_shared_filesystem" not in victim["flare.hang.stacks"]
    assert len({hangs[r]["attributes"]["flare.hang.seq"] for r in (0, 2)}) == 1
    assert {hangs[r]["attributes"]["flare.step"] for r in range(3)} == {12}
    # the launcher's SIGTERM is recorded on each rank's step in progress, then flushed
    killed = [s for s in by_name(spans, "train.step") if s["status_code"] == 2]
    assert {rank_of(s) for s in killed} == set(range(3))


def test_hang_in_subgroup_collective_names_the_group():
    spans, hangs = _run_hang("hang_subgroup", fault_rank=0, fault_from=12, ranks=4)
    assert "wait_for_shared_filesystem" in hangs[0]["attributes"]["flare.hang.stacks"]
    peer = hangs[1]["attributes"]
    assert peer["flare.hang.operation"] == "collective.all_reduce"
    assert peer["flare.hang.collective_op"] == "all_reduce"
    assert peer["flare.hang.pg"] == "1"
    assert peer["flare.hang.seq"] == 13  # the 13th sub-group all-reduce never completes
    assert peer["flare.callsite"].split(" in ")[-1] == "main"
    # before the hang: the sub-group all-reduces are attributed to their group
    subgroup = [s for s in by_name(spans, "collective.all_reduce")
                if s["attributes"].get("flare.collective.pg") == "1"]
    assert subgroup and {rank_of(s) for s in subgroup} == {0, 1}
    for span in subgroup:
        attributes = span["attributes"]
        assert attributes["flare.collective.group_ranks"] == [0, 1]
        assert attributes["flare.collective.group_size"] == 2
        assert attributes["flare.collective.source"] == "python"
        assert attributes["flare.collective.bytes"] == 16
        assert "train_ddp.py" in attributes["flare.callsite"]
    summary = step_spans_by_rank(spans)[1][5]["attributes"]
    assert summary["flare.step.pg.names"] == ["0", "1"]
    assert summary["flare.step.pg.counts"][1] == 1


def test_raise_arrives_as_error_step_with_call_site():
    with OtlpSink() as sink:
        job = TorchrunJob(sink.endpoint, ["--steps", "60", "--fault", "raise",
                                          "--fault-rank", "1", "--fault-from", "10"], nproc=2,
                          FLARE_HEARTBEAT_S=1).start()
        assert job.wait(timeout=120) != 0
        time.sleep(0.5)
        spans = sink.spans()
    errors = [s for s in by_name(spans, "train.step")
              if s["status_code"] == 2 and rank_of(s) == 1]
    assert len(errors) == 1, job.output[-2000:]
    error = errors[0]
    assert error["attributes"]["flare.step"] == 10
    assert error["attributes"]["flare.callsite"].endswith("in load_shard")
    assert "corrupt shard" in error["status_message"]
    event_name, event = error["events"][0]
    assert event_name == "exception" and event["exception.type"] == "RuntimeError"
    # rank attributes travel on the spans when no resource detector is configured
    assert error["attributes"]["flare.rank"] == 1


def test_sigkill_of_one_rank_loses_nothing_from_the_others():
    with OtlpSink() as sink:
        job = TorchrunJob(sink.endpoint, ["--steps", "100000"], nproc=3, FLARE_HEARTBEAT_S=0.5,
                          OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,flare").start()
        try:
            assert wait_until(lambda: {rank_of(s) for s in by_name(sink.spans(), "train.step")
                                       if s["attributes"]["flare.step"] >= 20}
                              == set(range(3)), timeout=90), job.output
            victim_pid = next(s["resource"]["process.pid"] for s in sink.spans()
                              if rank_of(s) == 2)
            os.kill(victim_pid, signal.SIGKILL)
            killed_at = time.time_ns()
            job.wait(timeout=60)
        finally:
            job.stop()
        time.sleep(0.5)
        spans = sink.spans()
    steps = step_spans_by_rank(spans)
    for rank in (0, 1):
        numbered = steps[rank]
        assert sorted(numbered) == list(range(max(numbered) + 1)), f"rank {rank} has gaps"
        last = numbered[max(numbered)]
        # the survivors fail (gloo: peer closed) or get torchrun's SIGTERM: either way
        # the step in progress arrives marked ERROR
        assert last["status_code"] == 2, last
    late_beats = [s for s in by_name(spans, "flare.heartbeat")
                  if rank_of(s) == 2 and s["start_ns"] > killed_at + 1e9]
    assert not late_beats
    assert any(rank_of(s) == 2 for s in by_name(spans, "flare.heartbeat"))


def test_unreachable_endpoint_never_disturbs_training():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    job = TorchrunJob(f"http://127.0.0.1:{port}", ["--steps", "40"], nproc=2, FLARE_HEARTBEAT_S=1,
                      FLARE_DETAIL_EVERY=10).start()
    assert job.wait(timeout=180) == 0, job.output[-3000:]
    assert "done: 40 steps" in job.output
    assert "Traceback" not in job.output
    done_line = next(line for line in job.output.splitlines() if line.startswith("done:"))
    print(f"unreachable endpoint: {done_line}; whole job (exit included, where the SDK "
          f"retries the last export) {time.monotonic() - started:.1f} s")
