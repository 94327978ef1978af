"""The rank correlator at 6,144 simulated ranks, one step per second.

Each simulated rank sends, per step, one OTLP request (its own resource) with a
`train.step` span carrying the always-on summary including per-PG arrays (world,
tensor-parallel, pipeline-parallel and data-parallel groups: 4 PGs per rank, 2,337
PG instances at TP=8, PP=4) and two `dataloader.next` spans. Requests of a step arrive
shuffled; 2% of them are held back and delivered in the middle of the next step
(out of order across steps); 0.5% are delivered twice (duplicates). One rank is a
straggler: it reaches the collectives 80 ms late, so it waits least.

Measured (single thread, the correlator's own work including protobuf parsing):
  latency  from handing the step's last request to the correlator (parse included)
           until the step's `train.step.ranks` span is out;
  step CPU time to ingest one whole step (6,144 requests): must stay under 1 s to
           keep up with one step per second;
  RSS      peak resident set of the process (ru_maxrss), with the correlator's own
           state estimate beside it.
It also checks every emitted step names all ranks, no missing rank, and the straggler
as culprit.

    .venv/bin/python benchmarks/correlator_scale.py [--ranks 6144] [--steps 30] [--realtime]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flare.processors.rank_correlation import SCOPE_NAME, RankCorrelation
from flare.wire import semconv as sc

JOB = "scale-job"
T0 = 1_700_000_000_000_000_000
SEC = 1_000_000_000
TP, PP = 8, 4


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


def pg_names(rank: int, world: int) -> list[str]:
    dp = world // (TP * PP)
    tp_group = rank // TP
    pp_group = (rank % TP) + TP * (rank // (TP * PP))
    dp_group = rank % (TP * PP)
    assert dp > 0
    return ["0", f"tp{tp_group}", f"pp{pp_group}", f"dp{dp_group}"]


class RankTemplate:
    """One rank's request, rewritten in place for each step (cheap to re-serialise)."""

    # Attribute positions in the train.step span, fixed by the order below.
    STEP, WAIT, PG_WAIT, PG_SEQ = 0, 1, 8, 9

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        names = pg_names(rank, world)
        step_attrs = {
            sc.STEP: 0, sc.STEP_COLLECTIVE_WAIT_MS: 0.0, sc.STEP_DATALOADER_MS: 2.5,
            sc.STEP_DATALOADER_COUNT: 2, sc.STEP_COLLECTIVE_COUNT: 14,
            sc.STEP_COLLECTIVE_BYTES: 400_000_000, sc.STEP_GC_MS: 0.4,
            sc.STEP_PG_NAMES: names, sc.STEP_PG_WAIT_MS: [0.0] * 4, sc.STEP_PG_LAST_SEQ: [0] * 4,
            sc.STEP_PG_COUNTS: [2, 6, 2, 4], sc.STEP_COMPUTE_MS: 780.0,
        }
        assert list(step_attrs)[self.PG_WAIT] == sc.STEP_PG_WAIT_MS
        self.request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource={"attributes": kvs({
                sc.SERVICE_NAME: "train", sc.JOB_ID: JOB, sc.RANK: rank, sc.WORLD_SIZE: world,
                sc.LOCAL_RANK: rank % 8, sc.NODE_RANK: rank // 8, sc.HOST_NAME: f"node{rank // 8}",
                sc.PROCESS_PID: 1000 + rank,
            })},
            scope_spans=[ScopeSpans(scope={"name": "flare.instrumentation"}, spans=[
                Span(name=sc.SPAN_STEP, attributes=kvs(step_attrs)),
                Span(name=sc.SPAN_DATALOADER, attributes=kvs({sc.STEP: 0, sc.DATALOADER_WAIT_MS: 1.2})),
                Span(name=sc.SPAN_DATALOADER, attributes=kvs({sc.STEP: 0, sc.DATALOADER_WAIT_MS: 1.3})),
            ])],
        )])
        self.spans = self.request.resource_spans[0].scope_spans[0].spans

    def payload(self, step: int, late_ms: float, rng: random.Random) -> bytes:
        start = T0 + step * SEC
        trace_id = sc.step_trace_id(JOB, step).to_bytes(16, "big")
        # Everybody ends the step together (the collectives equalise it); the late
        # rank simply waited less inside them.
        wait_ms = max(0.5, 100.0 - late_ms + rng.uniform(0, 3))
        step_span = self.spans[0]
        step_span.trace_id = trace_id
        step_span.span_id = rng.getrandbits(64).to_bytes(8, "big")
        step_span.start_time_unix_nano = start
        step_span.end_time_unix_nano = start + SEC - 5_000_000 + rng.randrange(1_000_000)
        attrs = step_span.attributes
        attrs[self.STEP].value.int_value = step
        attrs[self.WAIT].value.double_value = wait_ms
        pg_waits = attrs[self.PG_WAIT].value.array_value.values
        pg_seqs = attrs[self.PG_SEQ].value.array_value.values
        for i, share in enumerate((0.1, 0.5, 0.1, 0.3)):
            pg_waits[i].double_value = round(wait_ms * share, 3)
            pg_seqs[i].int_value = step * (2, 6, 2, 4)[i]
        for i, child in enumerate(self.spans[1:]):
            child.trace_id = trace_id
            child.span_id = rng.getrandbits(64).to_bytes(8, "big")
            child.parent_span_id = step_span.span_id
            child.start_time_unix_nano = start + i * 400_000_000
            child.end_time_unix_nano = child.start_time_unix_nano + 1_200_000
            child.attributes[0].value.int_value = step
        return self.request.SerializeToString()


def step_outputs(request: ExportTraceServiceRequest) -> list[Span]:
    return [
        span
        for rs in request.resource_spans
        for ss in rs.scope_spans if ss.scope.name == SCOPE_NAME
        for span in ss.spans if span.name == sc.SPAN_STEP_RANKS
    ]


def attributes(span: Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        if which == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in kv.value.array_value.values]
        else:
            out[kv.key] = getattr(kv.value, which)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=6144)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--straggler", type=int, default=4242)
    parser.add_argument("--realtime", action="store_true",
                        help="pace steps at one per wall-clock second")
    args = parser.parse_args()
    if args.ranks % (TP * PP) or not 0 <= args.straggler < args.ranks:
        parser.error(f"--ranks must be a multiple of {TP * PP} and hold --straggler")
    rng = random.Random(1)
    sim_now = [T0]
    correlator = RankCorrelation(grace_period="10s", window="120s", clock=lambda: sim_now[0])
    parse = ExportTraceServiceRequest.FromString
    templates = [RankTemplate(r, args.ranks) for r in range(args.ranks)]
    rss_setup_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    latencies: dict[int, float] = {}
    step_cpu: list[float] = []
    emitted: dict[int, dict[str, object]] = {}
    held_back: list[bytes] = []
    for step in range(args.steps):
        payloads = [
            t.payload(step, 80.0 if t.rank == args.straggler else 0.0, rng) for t in templates
        ]
        rng.shuffle(payloads)
        payloads += [payloads[i] for i in range(0, len(payloads), 200)]  # duplicates
        keep = int(len(payloads) * 0.02)
        next_held, payloads = payloads[:keep], payloads[keep:]
        # Last step's stragglers arrive in the middle of this step.
        half = len(payloads) // 2
        payloads = payloads[:half] + held_back + payloads[half:]
        held_back = next_held
        if step == args.steps - 1:  # no next step: the held-back ones come last
            payloads += held_back
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        sim_now[0] = T0 + (step + 1) * SEC
        for payload in payloads:
            t0 = time.perf_counter()
            out = correlator.process_traces(parse(payload))
            for span in step_outputs(out):
                attrs = attributes(span)
                closed_step = int(attrs[sc.STEP])  # type: ignore[arg-type]
                latencies[closed_step] = time.perf_counter() - t0
                emitted[closed_step] = attrs
        correlator.tick(sim_now[0])
        step_cpu.append(time.process_time() - cpu0)
        if args.realtime:
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - wall0)))
    for out in correlator.shutdown():
        for span in step_outputs(out):
            emitted[int(attributes(span)[sc.STEP])] = attributes(span)  # type: ignore[arg-type]

    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m = correlator.metrics()
    wrong = [
        s for s, a in emitted.items()
        if a[sc.RANKS_COUNT] != args.ranks or a.get(sc.RANKS_MISSING) or a[sc.RANKS_CULPRIT] != args.straggler
    ]
    lat = sorted(latencies.values())
    print(f"{args.ranks} ranks x {args.steps} steps, {len(payloads)} requests per step "
          f"(with duplicates and held-back late ones), single thread")
    print(f"  steps emitted                {len(emitted)} ({len(latencies)} complete on arrival), "
          f"wrong: {len(wrong)}")
    print(f"  latency after last rank      median {statistics.median(lat) * 1e3:7.1f} ms, "
          f"max {lat[-1] * 1e3:7.1f} ms  (target <= 2000 ms)")
    print(f"  CPU per step (all ranks)     median {statistics.median(step_cpu) * 1e3:7.1f} ms, "
          f"max {max(step_cpu) * 1e3:7.1f} ms  (must stay < 1000 ms at 1 step/s)")
    print(f"  peak RSS                     {rss_mib:7.1f} MiB (after building the {args.ranks} "
          f"rank templates: {rss_setup_mib:.1f} MiB; target <= 1024 MiB)")
    print(f"  correlator state estimate    {m['state_bytes'] / 2**20:7.1f} MiB at the end; "
          f"duplicates {m['duplicate_spans']:.0f}, late {m['late_spans']:.0f}, "
          f"evicted {m['windows_evicted']:.0f}")
    ok = not wrong and len(emitted) == args.steps and lat[-1] <= 2.0 and rss_mib <= 1024
    print("  result                       " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
