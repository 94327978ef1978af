"""rank_correlation on synthetic input: out of order, duplicated, late, missing ranks."""

from __future__ import annotations

import itertools
import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.processors import REGISTRY, span_select
from flare.processors.rank_correlation import SCOPE_NAME, RankCorrelation
from flare.wire import semconv as sc


@pytest.fixture(autouse=True, params=["c_picker", "python_reference"])
def picker(request, monkeypatch):
    """Every test runs with the C span picker (when built) and the Python reference."""
    if request.param == "python_reference":
        monkeypatch.setattr(span_select, "_otlp_read", None)
    return request.param


JOB = "job-a"
T0 = 1_700_000_000_000_000_000
MS = 1_000_000
_ids = itertools.count(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def value(v: object) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[value(x) for x in v]))
    return AnyValue(string_value=str(v))


def kvs(attrs: dict[str, object]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in attrs.items()]


def step_span(step: int, wait_ms: float, duration_ms: float = 1000, end_ms: float | None = None,
              pgs: dict[str, tuple[float, int]] | None = None, span_id: int | None = None) -> Span:
    start = T0 + step * 1000 * MS
    end = start + int((end_ms if end_ms is not None else duration_ms) * MS)
    attrs: dict[str, object] = {sc.STEP: step, sc.STEP_COLLECTIVE_WAIT_MS: wait_ms}
    if pgs:
        attrs[sc.STEP_PG_NAMES] = list(pgs)
        attrs[sc.STEP_PG_WAIT_MS] = [w for w, _ in pgs.values()]
        attrs[sc.STEP_PG_LAST_SEQ] = [s for _, s in pgs.values()]
    return Span(
        trace_id=sc.step_trace_id(JOB, step).to_bytes(16, "big"),
        span_id=(span_id or next(_ids)).to_bytes(8, "big"), name=sc.SPAN_STEP,
        start_time_unix_nano=start, end_time_unix_nano=end, attributes=kvs(attrs),
    )


def collective_span(step: int, pg: str, seq: int, arrive_ms: float, group_size: int,
                    group_ranks: list[int] | None = None) -> Span:
    start = T0 + step * 1000 * MS + int(arrive_ms * MS)
    attrs: dict[str, object] = {
        sc.STEP: step, sc.COLL_OP: "all_reduce", sc.COLL_PG: pg, sc.COLL_SEQ: seq,
        sc.COLL_GROUP_SIZE: group_size,
    }
    if group_ranks:
        attrs[sc.COLL_GROUP_RANKS] = group_ranks
    return Span(
        trace_id=sc.step_trace_id(JOB, step).to_bytes(16, "big"),
        span_id=next(_ids).to_bytes(8, "big"), name="collective.all_reduce",
        start_time_unix_nano=start, end_time_unix_nano=start + 5 * MS, attributes=kvs(attrs),
    )


def request(rank: int, spans: list[Span], world_size: int = 4, job: str = JOB) -> ExportTraceServiceRequest:
    resource = {sc.SERVICE_NAME: "train", sc.JOB_ID: job, sc.RANK: rank, sc.WORLD_SIZE: world_size}
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": kvs(resource)},
        scope_spans=[ScopeSpans(scope={"name": "flare.instrumentation"}, spans=spans)],
    )])


def emitted(requests: list[ExportTraceServiceRequest]) -> list[tuple[dict, Span]]:
    """(attributes, span) of every span the correlator added."""
    out = []
    for req in requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                if ss.scope.name != SCOPE_NAME:
                    continue
                for span in ss.spans:
                    attrs = {}
                    for kv in span.attributes:
                        which = kv.value.WhichOneof("value")
                        if which == "array_value":
                            attrs[kv.key] = [getattr(v, v.WhichOneof("value")) for v in kv.value.array_value.values]
                        else:
                            attrs[kv.key] = getattr(kv.value, which)
                    out.append((attrs, span))
    return out


def steps_out(requests) -> dict[int, dict]:
    return {a[sc.STEP]: a for a, s in emitted(requests) if s.name == sc.SPAN_STEP_RANKS}


def test_registry_builds_from_options():
    proc = REGISTRY["rank_correlation"](grace_period="2s", window="1m", max_state_mib=8)
    assert proc.grace_ns == 2 * 10**9 and proc.window_ns == 60 * 10**9
    with pytest.raises(ValueError, match="grace_period"):
        RankCorrelation(grace_period="soon")
    with pytest.raises(ValueError, match="window"):
        RankCorrelation(grace_period="10s", window="1s")


def test_complete_step_emits_at_once_with_culprit_not_longest_step():
    clock = FakeClock()
    proc = RankCorrelation(clock=clock)
    # Rank 2 is the straggler: it waits least in collectives. Rank 0 has the longest
    # step (it did extra host work after the all-reduce) but waited most: a victim.
    waits = {0: 300.0, 1: 290.0, 2: 5.0, 3: 295.0}
    durations = {0: 1100.0, 1: 1000.0, 2: 1001.0, 3: 1000.0}
    outputs = []
    for rank in (3, 0, 2, 1):  # arrival order differs from rank order
        out = proc.process_traces(request(rank, [step_span(7, waits[rank], durations[rank])]))
        outputs.append(out)
    # Only the last request completes the window; its output carries the span.
    assert steps_out(outputs[:3]) == {}
    attrs = steps_out(outputs)[7]
    assert attrs[sc.RANKS_CULPRIT] == 2
    assert attrs[sc.RANKS_CULPRIT_BASIS] == "collective_wait"
    assert attrs[sc.RANKS_SLOWEST] == 0
    assert attrs[sc.RANKS_COUNT] == 4 and attrs[sc.RANKS_EXPECTED] == 4
    assert attrs.get(sc.RANKS_MISSING, []) == []
    assert attrs[sc.RANKS_SPREAD_MS] == pytest.approx(100.0)
    assert attrs[sc.RANKS_CLOSED_BY] == "complete"
    assert attrs[sc.RANKS_CULPRIT_WAIT_MS] == 5.0
    assert attrs[sc.RANKS_MEDIAN_WAIT_MS] == pytest.approx(292.5)
    (span,) = [s for _, s in emitted(outputs) if s.name == sc.SPAN_STEP_RANKS]
    assert span.trace_id == sc.step_trace_id(JOB, 7).to_bytes(16, "big")
    # It is the root every rank's train.step names as parent.
    assert span.span_id == sc.step_root_span_id(JOB, 7).to_bytes(8, "big")
    assert not span.parent_span_id
    assert len(span.links) == 4
    assert {link.attributes[0].value.int_value for link in span.links} == {0, 1, 2, 3}
    assert proc.metrics()["steps_complete"] == 1
    assert proc.metrics()["state_bytes"] == 0


def test_missing_rank_closes_after_grace_on_tick():
    clock = FakeClock()
    proc = RankCorrelation(grace_period="5s", clock=clock)
    for rank in (0, 1, 3):
        proc.process_traces(request(rank, [step_span(1, 10.0)]))
    clock.now += 4 * 10**9
    assert proc.tick(clock.now) == []
    clock.now += 2 * 10**9
    attrs = steps_out(proc.tick(clock.now))[1]
    assert attrs[sc.RANKS_MISSING] == [2]
    assert attrs[sc.RANKS_COUNT] == 3
    assert attrs[sc.RANKS_CLOSED_BY] == "grace"


def test_duplicates_late_and_out_of_order_steps():
    clock = FakeClock()
    proc = RankCorrelation(grace_period="5s", clock=clock)
    spans = {(step, rank): step_span(step, 10.0 + rank) for step in (1, 2) for rank in range(4)}
    # Step 2 arrives before step 1; rank 1's step-1 span is sent twice before it closes.
    order = [(2, 0), (2, 1), (1, 0), (2, 2), (1, 1), (1, 1), (2, 3), (1, 2)]
    outs = [proc.process_traces(request(rank, [spans[(step, rank)]])) for step, rank in order]
    assert set(steps_out(outs)) == {2}
    assert proc.metrics()["duplicate_spans"] == 1
    # Step 1 times out without rank 3; then rank 3's copy arrives late, and a resend
    # of rank 0's span (already counted) is a duplicate, not a new window.
    clock.now += 6 * 10**9
    closed = steps_out(proc.tick(clock.now))
    assert closed[1][sc.RANKS_MISSING] == [3]
    late = proc.process_traces(request(3, [spans[(1, 3)]]))
    again = proc.process_traces(request(0, [spans[(1, 0)]]))
    assert steps_out([late, again]) == {}
    m = proc.metrics()
    assert m["late_spans"] == 1 and m["duplicate_spans"] == 2
    assert m["open_step_windows"] == 0
    # The late span itself still flows on to the exporters.
    assert late.resource_spans[0].scope_spans[0].spans[0].name == sc.SPAN_STEP


def test_restarted_rank_latest_attempt_counts():
    clock = FakeClock()
    proc = RankCorrelation(clock=clock)
    proc.process_traces(request(0, [step_span(3, 50.0, end_ms=900)]))
    proc.process_traces(request(0, [step_span(3, 1.0, end_ms=1500)]))  # re-run after restart
    outs = [proc.process_traces(request(r, [step_span(3, 40.0)])) for r in (1, 2, 3)]
    attrs = steps_out(outs)[3]
    assert attrs[sc.RANKS_CULPRIT] == 0  # the later attempt's 1 ms wait counts
    assert proc.metrics()["replaced_reports"] == 1


def test_culprit_falls_back_to_slowest_without_wait_summaries():
    proc = RankCorrelation(clock=FakeClock())
    outs = []
    for rank, dur in enumerate((1000, 1400, 1000, 1000)):
        span = step_span(0, 0.0, duration_ms=dur)
        del span.attributes[1]  # no collective_wait_ms
        outs.append(proc.process_traces(request(rank, [span])))
    attrs = steps_out(outs)[0]
    assert attrs[sc.RANKS_CULPRIT] == 1 and attrs[sc.RANKS_CULPRIT_BASIS] == "duration"


def test_per_pg_summaries_skew_and_rank_behind():
    proc = RankCorrelation(clock=FakeClock())
    # Two DP groups "1" = {0, 1} and "2" = {2, 3}, and the world group "0".
    pgs = {
        0: {"0": (200.0, 10), "1": (80.0, 5)},
        1: {"0": (190.0, 10), "1": (2.0, 5)},
        2: {"0": (195.0, 10), "2": (60.0, 5)},
        3: {"0": (5.0, 9), "2": (1.0, 4)},  # rank 3 never reached seq 10 / 5
    }
    outs = [proc.process_traces(request(r, [step_span(4, pgs[r]["0"][0], pgs=pgs[r])])) for r in range(4)]
    attrs = steps_out(outs)[4]
    names = attrs[sc.RANKS_PG_NAMES]
    by_name = {n: i for i, n in enumerate(names)}
    assert attrs[sc.RANKS_PG_COUNT] == 3
    i = by_name["1"]
    assert attrs[sc.RANKS_PG_LAST_ARRIVAL][i] == 1
    assert attrs[sc.RANKS_PG_ARRIVAL_SKEW_MS][i] == pytest.approx(78.0)
    # PG "0" and "2": rank 3 is behind; PGs with missing ranks are listed first.
    assert attrs[sc.RANKS_PG_MISSING_COUNT][by_name["0"]] == 1
    assert set(names[:2]) == {"0", "2"}
    coll = [a for a, s in emitted(outs) if s.name == sc.SPAN_COLLECTIVE_RANKS]
    by_pg = {a[sc.COLL_PG]: a for a in coll}
    assert set(by_pg) == {"0", "2"}
    assert by_pg["0"][sc.RANKS_MISSING] == [3] and by_pg["0"][sc.COLL_SEQ] == 10
    assert by_pg["2"][sc.COLL_SOURCE] == "step_summary"


def test_collective_spans_arrival_skew_last_and_missing():
    clock = FakeClock()
    proc = RankCorrelation(grace_period="5s", clock=clock)
    arrivals = {0: 10.0, 1: 12.0, 2: 95.0, 3: 11.0}
    outs = [proc.process_traces(request(r, [collective_span(100, "0", 42, arrivals[r], 4)]))
            for r in (2, 0, 3, 1)]
    ((attrs, span),) = [(a, s) for a, s in emitted(outs) if s.name == sc.SPAN_COLLECTIVE_RANKS]
    assert span.parent_span_id == sc.step_root_span_id(JOB, 100).to_bytes(8, "big")
    assert span.trace_id == sc.step_trace_id(JOB, 100).to_bytes(16, "big")
    assert len(span.links) == 4
    assert attrs[sc.RANKS_LAST_ARRIVAL] == 2
    assert attrs[sc.RANKS_ARRIVAL_SKEW_MS] == pytest.approx(85.0)
    assert attrs[sc.RANKS_CLOSED_BY] == "complete"
    # A group of 4 named members where rank 6 never joins: reported by name.
    for r in (4, 5, 7):
        proc.process_traces(request(r, [collective_span(100, "9", 3, 1.0, 4, [4, 5, 6, 7])], world_size=8))
    clock.now += 6 * 10**9
    (attrs,) = [a for a, s in emitted(proc.tick(clock.now)) if s.name == sc.SPAN_COLLECTIVE_RANKS]
    assert attrs[sc.RANKS_MISSING] == [6] and attrs[sc.RANKS_CLOSED_BY] == "grace"


def test_hang_reports_and_last_heard():
    clock = FakeClock()
    proc = RankCorrelation(grace_period="1s", clock=clock)
    hang = Span(
        trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name=sc.SPAN_HANG,
        start_time_unix_nano=T0 + 5 * 10**9, end_time_unix_nano=T0 + 5 * 10**9,
        attributes=kvs({sc.HANG_OPERATION: "collective.all_reduce", sc.HANG_PG: "0", sc.HANG_SEQ: 17}),
    )
    for rank in (0, 1, 3):
        proc.process_traces(request(rank, [step_span(2, 100.0)]))
    clock.now += 500 * MS
    proc.process_traces(request(1, [hang]))
    heartbeat = Span(trace_id=b"\x03" * 16, span_id=b"\x04" * 8, name=sc.SPAN_HEARTBEAT,
                     start_time_unix_nano=T0, end_time_unix_nano=T0,
                     attributes=kvs({sc.HEARTBEAT_LAST_STEP: 2}))
    proc.process_traces(request(0, [heartbeat]))
    snap = proc.snapshot()[JOB]
    assert snap["hanging"] == {1: "collective.all_reduce pg=0 seq=17"}
    assert snap["ranks"][0]["last_heard_ns"] == clock.now
    assert snap["ranks"][3]["last_heard_ns"] == T0
    assert snap["ranks"][0]["last_step"] == 2
    assert proc.metrics()["hanging_ranks"] == 1
    clock.now += 10**9
    attrs = steps_out(proc.tick(clock.now))[2]
    assert attrs[sc.RANKS_MISSING] == [2]
    assert attrs[sc.RANKS_HANGING] == [1]
    assert attrs[sc.RANKS_HANG_OPERATIONS] == ["collective.all_reduce pg=0 seq=17"]
    # A later completed step from rank 1 clears its hang.
    proc.process_traces(request(1, [step_span(9, 1.0)]))
    assert proc.snapshot()[JOB]["hanging"] == {}


def test_byte_budget_closes_oldest_windows_and_counts():
    clock = FakeClock()
    proc = RankCorrelation(max_state_mib="64KiB", grace_period="1h", window="2h", clock=clock)
    outs = []
    for step in range(200):  # rank 3 never reports: nothing completes on its own
        clock.now += MS
        for rank in range(3):
            outs.append(proc.process_traces(request(rank, [step_span(step, 1.0)])))
    m = proc.metrics()
    assert m["state_bytes"] <= 64 * 1024
    assert m["windows_evicted"] > 0 and m["steps_budget"] == m["windows_evicted"]
    closed = steps_out(outs)
    assert closed and all(a[sc.RANKS_CLOSED_BY] == "budget" for a in closed.values())
    assert min(closed) == 0  # the oldest went first


def test_window_forgets_silent_jobs_and_closed_keys():
    clock = FakeClock()
    proc = RankCorrelation(grace_period="1s", window="10s", clock=clock)
    for rank in range(4):
        proc.process_traces(request(rank, [step_span(0, 1.0)]))
    clock.now += 11 * 10**9
    proc.tick(clock.now)
    assert proc.metrics()["jobs"] == 0 and proc.metrics()["jobs_evicted"] == 1


def test_shutdown_emits_open_windows_and_several_jobs_stay_apart():
    proc = RankCorrelation(clock=FakeClock())
    proc.process_traces(request(0, [step_span(5, 1.0)], job="a"))
    proc.process_traces(request(0, [step_span(5, 1.0)], job="b"))
    (out,) = proc.shutdown()
    jobs = set()
    for rs in out.resource_spans:
        res = {kv.key: kv.value for kv in rs.resource.attributes}
        jobs.add(res[sc.JOB_ID].string_value)
    assert jobs == {"a", "b"}
    assert all(a[sc.RANKS_CLOSED_BY] == "shutdown" for a, _ in emitted([out]))


def test_random_arrival_order_gives_the_same_answer():
    """Property: any interleaving of the same spans yields the same step summaries."""
    spans = [(rank, step_span(step, 50.0 if rank != step % 4 else 1.0))
             for step in range(10) for rank in range(4)]
    results = []
    for seed in range(3):
        order = spans[:]
        random.Random(seed).shuffle(order)
        proc = RankCorrelation(clock=FakeClock())
        outs = [proc.process_traces(request(rank, [span])) for rank, span in order]
        got = steps_out(outs)
        assert sorted(got) == list(range(10))
        results.append({s: (a[sc.RANKS_CULPRIT], a[sc.RANKS_SPREAD_MS]) for s, a in got.items()})
        assert all(a[sc.RANKS_CULPRIT] == s % 4 for s, a in got.items())
    assert results[0] == results[1] == results[2]


def test_own_output_is_not_correlated_again():
    proc = RankCorrelation(clock=FakeClock())
    outs = [proc.process_traces(request(r, [step_span(1, 1.0)])) for r in range(4)]
    proc2 = RankCorrelation(clock=FakeClock())
    proc2.process_traces(outs[-1])
    assert proc2.metrics()["step_spans"] == 1  # rank 3's own span only


def _hang_reports(proc: RankCorrelation, stuck_rank_says: dict | None) -> None:
    """Ranks 0, 1 and 3 stuck inside all_reduce (pg 0, seq 17) of step 1; rank 2 says
    `stuck_rank_says` (its own hang report's attributes), or nothing (None)."""
    for rank in range(4):  # a healthy step teaches the correlator who is in PG "0"
        proc.process_traces(request(rank, [step_span(0, 5.0, pgs={"0": (5.0, 3)})]))

    def hang(rank: int, **attrs: object) -> Span:
        detected = T0 + 400 * 10**9
        return Span(trace_id=sc.step_trace_id(JOB, 1).to_bytes(16, "big"),
                    span_id=next(_ids).to_bytes(8, "big"), name=sc.SPAN_HANG,
                    start_time_unix_nano=detected, end_time_unix_nano=detected,
                    attributes=kvs({sc.STEP: 1, sc.HANG_ELAPSED_S: 300.0 + rank, **attrs}))

    for rank in (0, 1, 3):
        proc.process_traces(request(rank, [hang(rank, **{
            sc.HANG_OPERATION: "collective.all_reduce", sc.HANG_COLL_OP: "all_reduce",
            sc.HANG_PG: "0", sc.HANG_SEQ: 17})]))
    if stuck_rank_says is not None:
        proc.process_traces(request(2, [hang(2, **stuck_rank_says)]))


def _did_not_join(outs) -> tuple[dict, Span]:
    ((attrs, span),) = [(a, s) for a, s in emitted(outs) if s.name == sc.SPAN_COLLECTIVE_RANKS]
    assert attrs[sc.RANKS_MISSING] == [2]
    assert attrs[sc.COLL_SOURCE] == "hang" and attrs[sc.COLL_SEQ] == 17
    assert attrs[sc.COLL_OP] == "all_reduce" and attrs[sc.STEP] == 1
    assert attrs[sc.RANKS_COUNT] == 3 and attrs[sc.RANKS_EXPECTED] == 4
    # Arrival = detection time minus elapsed: rank 0 (300 s) arrived last.
    assert attrs[sc.RANKS_LAST_ARRIVAL] == 0
    assert span.trace_id == sc.step_trace_id(JOB, 1).to_bytes(16, "big")
    return attrs, span


def test_hang_reports_name_the_rank_that_did_not_join():
    """Ranks stuck inside all_reduce (pg 0, seq 17) arrived; the member that never
    reports is missing, once the hang grace period is out (it may yet arrive)."""
    clock = FakeClock()
    proc = RankCorrelation(grace_period="2s", hang_grace_period="3s", clock=clock)
    _hang_reports(proc, None)
    clock.now += 2500 * MS
    assert proc.tick(clock.now) == []  # hang reports get the longer grace
    clock.now += 1000 * MS
    attrs, _ = _did_not_join(proc.tick(clock.now))
    assert attrs[sc.RANKS_CLOSED_BY] == "grace"


@pytest.mark.parametrize("stuck_rank_says", [
    {sc.HANG_OPERATION: "train.step"},  # stuck in its own Python, before the collective
    {sc.HANG_OPERATION: "collective.all_reduce", sc.HANG_COLL_OP: "all_reduce",
     sc.HANG_PG: "1", sc.HANG_SEQ: 3},  # stuck in another group's collective
])
def test_a_missing_member_that_is_hung_elsewhere_is_named_at_once(stuck_rank_says):
    """The member the collective waits for reports its own hang somewhere else: it
    cannot arrive, so the answer comes at the next tick, not after the grace period."""
    clock = FakeClock()
    proc = RankCorrelation(grace_period="2s", hang_grace_period="30s", clock=clock)
    _hang_reports(proc, stuck_rank_says)
    assert proc.snapshot()[JOB]["hanging"][2].startswith(stuck_rank_says[sc.HANG_OPERATION])
    clock.now += 100 * MS
    attrs, _ = _did_not_join(proc.tick(clock.now))
    assert attrs[sc.RANKS_CLOSED_BY] == "hung_elsewhere"


def test_encoded_path_and_badly_typed_pg_arrays_give_the_same_steps():
    """`process_traces_encoded` (the bytes the request arrived as, what the collector
    uses) concludes what `process_traces` does, also when a sender typed the per-PG
    arrays badly (int waits, string sequence numbers, a short array) and when a rank's
    groups change between steps."""

    def odd_step(step: int, rank: int) -> Span:
        # Each rank's DP group alternates between steps.
        span = step_span(step, 10.0 - rank, pgs={"0": (10.0 - rank, 3), f"dp{(rank + step) % 2}": (1.0, 2)})
        for kv in span.attributes:
            if kv.key == sc.STEP_PG_WAIT_MS and rank == 1:  # ints where doubles belong
                kv.value.array_value.values[0].Clear()
                kv.value.array_value.values[0].int_value = 9
            if kv.key == sc.STEP_PG_LAST_SEQ and rank == 2:  # strings, one missing
                del kv.value.array_value.values[1]
                kv.value.array_value.values[0].Clear()
                kv.value.array_value.values[0].string_value = "3"
        return span

    def run(encoded: bool) -> dict[int, dict]:
        proc = RankCorrelation(clock=FakeClock())
        outs = []
        for step in (1, 2):
            for rank in range(4):
                req = request(rank, [odd_step(step, rank)])
                out = (proc.process_traces_encoded(req, req.SerializeToString()) if encoded
                       else proc.process_traces(req))
                outs.append(out)
        return steps_out(outs)

    plain, encoded = run(False), run(True)
    assert plain == encoded and set(plain) == {1, 2}
    assert plain[2][sc.RANKS_PG_COUNT] == 3  # "0", "dp0", "dp1": groups learned as they change
    pg0 = plain[2][sc.RANKS_PG_NAMES].index("0")
    # rank 1's int wait (9) is read as 9.0 and rank 2's "3" as sequence 3: nobody is
    # behind in the world group, and rank 3 (least wait) arrived last, 3 ms after rank 0.
    assert plain[2][sc.RANKS_PG_MISSING_COUNT][pg0] == 0
    assert plain[2][sc.RANKS_PG_LAST_ARRIVAL][pg0] == 3
    assert plain[2][sc.RANKS_PG_ARRIVAL_SKEW_MS][pg0] == pytest.approx(3.0)


def test_wire_path_gives_the_bytes_of_the_message_path():
    """`process_traces_wire` (a request the receiver did not parse) returns exactly the
    encoding of what `process_traces` returns: the request's bytes, with the encoding of
    the emitted spans appended when a window completed; the state after each request,
    and what `tick` and `shutdown` emit later, are the same too."""
    rng = random.Random(4)
    inputs = []
    for step in range(1, 5):
        ranks = list(range(4))
        rng.shuffle(ranks)
        for rank in ranks[: 3 if step == 3 else 4]:  # step 3 misses a rank: closed by tick
            spans = [step_span(step, 10.0 - rank, pgs={"0": (10.0 - rank, 7), "dp": (1.0, 2)})]
            spans += [collective_span(step, "0", 7, arrive_ms=rank, group_size=4)]
            spans += [Span(trace_id=b"\x05" * 16, span_id=next(_ids).to_bytes(8, "big"), name="other")]
            inputs.append(request(rank, spans).SerializeToString())
    inputs.append(b"")  # an empty request passes through
    clock_a, clock_b = FakeClock(), FakeClock()
    by_message, by_wire = RankCorrelation(clock=clock_a), RankCorrelation(clock=clock_b)
    grew = 0
    for payload in inputs:
        clock_a.now += 7 * MS
        clock_b.now += 7 * MS
        expected = by_message.process_traces(ExportTraceServiceRequest.FromString(payload)).SerializeToString()
        out = by_wire.process_traces_wire(payload)
        assert out == expected
        grew += len(out) > len(payload)
        assert by_message.snapshot() == by_wire.snapshot()
    assert grew >= 3  # steps 1, 2 and 4 completed on a request
    later = clock_a.now + 60 * 1000 * MS
    ticked = [r.SerializeToString() for r in by_message.tick(later)]
    assert ticked and ticked == [r.SerializeToString() for r in by_wire.tick(later)]
    assert by_message.metrics() == by_wire.metrics()


def test_compact_step_records_give_what_the_attribute_dicts_give(picker, monkeypatch):
    """The C picker's compact step records and the dict records they replace: the same
    emitted bytes and counters, over out-of-order, duplicated, late and oddly typed input."""
    if picker != "c_picker" or span_select._otlp_read is None:
        pytest.skip("compact records come from the C picker")
    from flare.processors import rank_correlation

    rng = random.Random(21)
    payloads = []
    for step in range(30):
        for rank in rng.sample(range(8), 8 - (step % 7 == 3)):  # a rank missing now and then
            attrs: dict[str, object] = {
                sc.STEP: step, sc.RANK: rank, sc.STEP_COLLECTIVE_WAIT_MS: rng.choice([1.5, 20.0, 3.25]),
                sc.STEP_PG_NAMES: ["0", f"tp{rank // 4}"], sc.STEP_PG_WAIT_MS: [rng.random(), 0.5],
                sc.STEP_PG_LAST_SEQ: [step * 4 - (rank == 5 and step % 5 == 0), step * 2],
            }
            odd = rng.random()
            if odd < 0.05:
                attrs[sc.STEP] = str(step)  # converted on the dict path
            elif odd < 0.1:
                del attrs[sc.RANK]  # the resource's rank
            elif odd < 0.15:
                attrs[sc.STEP_PG_WAIT_MS] = ["x"]  # converted, padded
            elif odd < 0.2:
                attrs[sc.STEP_COLLECTIVE_WAIT_MS] = 7  # an int wait
            span = Span(trace_id=sc.step_trace_id(JOB, step).to_bytes(16, "big"),
                        span_id=next(_ids).to_bytes(8, "big"), name=sc.SPAN_STEP,
                        start_time_unix_nano=T0 + step * 1000 * MS,
                        end_time_unix_nano=T0 + step * 1000 * MS + rng.randrange(900, 1100) * MS,
                        attributes=kvs(attrs))
            payloads.append(ExportTraceServiceRequest(resource_spans=[ResourceSpans(
                resource={"attributes": kvs({sc.JOB_ID: JOB, sc.RANK: rank, sc.WORLD_SIZE: 8})},
                scope_spans=[ScopeSpans(spans=[span])])]).SerializeToString())
    rng.shuffle(payloads)
    payloads += rng.sample(payloads, 20)  # duplicates, and late copies of closed steps

    def run() -> tuple[list[bytes], dict[str, float]]:
        clock = FakeClock()
        proc = RankCorrelation(clock=clock, grace_period="2s", window="60s")
        out = []
        for i, payload in enumerate(payloads):
            clock.now = T0 + i * 10 * MS
            out.append(proc.process_traces_wire(payload))
            if i % 25 == 0:
                out.extend(r.SerializeToString() for r in proc.tick(clock.now))
        out.extend(r.SerializeToString() for r in proc.shutdown())
        metrics = proc.metrics()
        metrics.pop("picker_fallbacks")
        return out, metrics

    compact = run()
    monkeypatch.setattr(rank_correlation._SELECTION, "step", None)  # dict records only
    assert run() == compact
    assert compact[1]["steps_emitted"] == 30 and compact[1]["duplicate_spans"] > 0


def test_window_summaries_match_their_references():
    """The shortcuts of a closing window (one least wait found without a key per rank,
    no set when every member reported, the median inline) against the plain forms, on
    windows with ties, -0.0, NaN and missing waits."""
    import math
    import statistics

    from flare.processors import correlation_windows as cw

    def reference_culprit(ranks):
        with_wait = [(r, s) for r, s in ranks.items() if s.collective_wait_ms is not None]
        if with_wait:
            rank, step = min(with_wait, key=lambda rs: (rs[1].collective_wait_ms, -rs[1].end_ns, rs[0]))
            median = statistics.median(s.collective_wait_ms for _, s in with_wait)
            return rank, "collective_wait", step.collective_wait_ms, round(median, 3)
        return cw.culprit(ranks)  # the duration fallback is unchanged

    rng = random.Random(8)
    pool = [0.0, -0.0, 1.5, 1.5, 2.25, 7.0, math.inf, math.nan, None]
    for _ in range(3000):
        n = rng.randint(1, 9)
        names = ("0", "tp", "dp")
        ranks = {}
        for rank in rng.sample(range(12), n):
            waits = tuple(rng.choice(pool[:-1]) for _ in names)
            seqs = tuple(rng.choice([4, 4, 4, 3]) for _ in names)
            ranks[rank] = cw.RankStep(b"s", b"t", 0, rng.randrange(3), rng.choice(pool), names, waits, seqs)
        got, want = cw.culprit(ranks), reference_culprit(ranks)
        assert repr(got) == repr(want), (ranks, got, want)
        members = {name: set(rng.sample(range(12), rng.randint(0, 12))) for name in names}
        assert repr(cw._uniform_pg_summaries(ranks, names, members)) == repr(cw._general_pg_summaries(ranks, members))
