"""Scale simulation: N ranks in a TP×PP×DP mesh sending OTLP to K real Flare collectors.

What it runs:
- K `python -m flare.collector` processes, each with its own store, write-ahead log and
  Prometheus endpoint (the documented layout's Flare tier);
- a generator for N ranks: per rank per step one `train.step` span with the always-on
  summary (per-PG waits/counts/bytes/sequence numbers for its world, TP, PP and DP
  groups); every `--detail-every` steps the detail children too (one `collective.*`
  span per PG, `dataloader.next`, four `kernel` spans); one injected culprit rank whose
  compute grows by `--culprit-ms` from `--culprit-from`, so the others wait for it;
- the front tier of the layout, simulated: spans are routed to collector
  `trace_id mod K` (the otelcol-contrib loadbalancing exporter's `routing_key: traceID`
  hashes the trace id; Flare derives it from (job, step), so a whole step lands on one
  collector either way) and batched per step and collector into requests of at most
  `--batch-ranks` ranks, as the front's batch processor would.

What it measures (printed, and one JSON line at the end):
- spans/s accepted per collector, and whether the layout keeps up: the collectors'
  queue and write-ahead-log backlog sampled through the run (no growth = keeps up);
- correlation latency: from the acknowledgement of a step's last request to that
  step's `train.step.ranks` span being readable in the store (polled every 0.5 s, so
  the figure includes the 0.5 s flush interval and has 0.5 s resolution);
- collector CPU: seconds of CPU per 1,000 spans ingested (from /proc), hence the cores
  a collector needs at a given rate, a figure that does not depend on how busy the
  shared benchmark machine is;
- store bytes per rank-hour of training (simulated time = steps × step interval) and
  the projection per rank-day;
- diagnosis time of each collector's store (all detectors), and whether the straggler
  found is the injected culprit.

    .venv/bin/python benchmarks/scale_sim.py --ranks 1024 --collectors 1 --steps 200
    .venv/bin/python benchmarks/scale_sim.py --ranks 6144 --collectors 2 --steps 120 --speed 1

`--speed` is steps per second of wall time (1 = real time at one step per second).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from flare.collector.config import embedded_config
from flare.exporters import store
from flare.wire import semconv as sc

JOB = "scale-sim"
SEC = 1_000_000_000
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


# ---------------------------------------------------------------- the mesh


@dataclass(frozen=True)
class Mesh:
    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def groups(self, rank: int) -> list[str]:
        """Megatron order: TP innermost, then DP, then PP."""
        tp_index, rest = rank % self.tp, rank // self.tp
        dp_index, pp_index = rest % self.dp, rest // self.dp
        return ["world", f"tp{rest}", f"pp{tp_index + self.tp * dp_index}",
                f"dp{tp_index + self.tp * pp_index}"]


def _value(v: object) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[_value(x) for x in v]))
    return AnyValue(string_value=str(v))


def _kvs(attrs: dict[str, object]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_value(v)) for k, v in attrs.items()]


# ---------------------------------------------------------------- spans of one rank


# Collectives per step per PG (world, tp, pp, dp) and their bytes, a 7B-ish model.
PG_COUNTS = (1, 96, 16, 2)
PG_BYTES = (8, 96 * 16_777_216, 16 * 33_554_432, 2 * 268_435_456)
PG_OPS = ("all_reduce", "all_reduce", "send", "reduce_scatter")
KERNELS = (("ampere_bf16_s16816gemm_bf16_256x128", "gemm"),
           ("flash_fwd_kernel", "attention"),
           ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
           ("vectorized_elementwise_kernel", "elementwise"))


class RankSpans:
    """One rank's spans inside a long-lived request, rewritten in place each step.

    Each rank lives in two requests (a plain-step one and a detail-step one) so that a
    step only sets numbers and ids: no message is copied or re-created, which keeps the
    generator cheap enough to simulate thousands of ranks in real time.
    """

    STEP, WAIT, COMPUTE, PG_WAIT, PG_SEQ = 0, 1, 2, 3, 4

    def __init__(self, rank: int, mesh: Mesh, plain: ExportTraceServiceRequest,
                 detailed: ExportTraceServiceRequest) -> None:
        self.rank = rank
        groups = mesh.groups(rank)
        step_attrs = {
            sc.STEP: 0, sc.STEP_COLLECTIVE_WAIT_MS: 0.0, sc.STEP_COMPUTE_MS: 0.0,
            sc.STEP_PG_WAIT_MS: [0.0] * 4, sc.STEP_PG_LAST_SEQ: [0] * 4,
            sc.STEP_PG_NAMES: groups, sc.STEP_PG_COUNTS: list(PG_COUNTS),
            sc.STEP_PG_BYTES: list(PG_BYTES), sc.STEP_DATALOADER_MS: 3.1,
            sc.STEP_DATALOADER_COUNT: 1, sc.STEP_GC_MS: 0.0, sc.STEP_GC_COUNT: 0,
            sc.STEP_PYCALL_MS: 1.4, sc.STEP_PYCALL_COUNT: 2,
            sc.STEP_COLLECTIVE_COUNT: sum(PG_COUNTS), sc.STEP_COLLECTIVE_BYTES: sum(PG_BYTES),
            sc.STEP_DETAIL: False,
        }
        resource = _kvs({
            sc.SERVICE_NAME: JOB, sc.JOB_ID: JOB, sc.RANK: rank, sc.WORLD_SIZE: mesh.world,
            sc.LOCAL_RANK: rank % 8, sc.NODE_RANK: rank // 8, sc.HOST_NAME: f"node{rank // 8:04d}",
            sc.PROCESS_PID: 4000 + rank % 8, sc.GPU_INDEX: rank % 8,
        })
        self.step_spans: list[Span] = []
        self.children: list[Span] = []
        for request, detail in ((plain, False), (detailed, True)):
            rs = request.resource_spans.add()
            rs.resource.attributes.extend(resource)
            scope = rs.scope_spans.add()
            scope.scope.name = "flare.instrumentation"
            span = scope.spans.add(name=sc.SPAN_STEP, kind=Span.SPAN_KIND_INTERNAL)
            span.attributes.extend(_kvs({**step_attrs, sc.STEP_DETAIL: detail}))
            self.step_spans.append(span)
            if not detail:
                continue
            for i, group in enumerate(groups):
                child = scope.spans.add(name=sc.collective_span_name(PG_OPS[i]))
                child.attributes.extend(_kvs({
                    sc.STEP: 0, sc.COLL_OP: PG_OPS[i], sc.COLL_PG: group, sc.COLL_SEQ: 0,
                    sc.COLL_GROUP_SIZE: (mesh.world, mesh.tp, mesh.pp, mesh.dp)[i],
                    sc.COLL_BYTES: PG_BYTES[i] // PG_COUNTS[i], sc.COLL_DTYPE: "bfloat16",
                    sc.COLL_BACKEND: "nccl", sc.COLL_WAIT_MS: 0.0,
                }))
                self.children.append(child)
            child = scope.spans.add(name=sc.SPAN_DATALOADER)
            child.attributes.extend(_kvs({sc.STEP: 0, sc.DATALOADER_WAIT_MS: 3.1,
                                          sc.DATALOADER_WORKERS: 8}))
            self.children.append(child)
            for name, category in KERNELS:
                child = scope.spans.add(name=sc.SPAN_KERNEL)
                child.attributes.extend(_kvs({
                    sc.STEP: 0, sc.KERNEL_NAME: name, sc.KERNEL_CATEGORY: category,
                    sc.KERNEL_STREAM: 7, sc.KERNEL_ISSUE_LATENCY_US: 12.5,
                    sc.KERNEL_ACHIEVED_TFLOPS: 610.0}))
                self.children.append(child)

    def fill(self, step: int, trace_id: bytes, start_ns: int, compute_ms: float,
             barrier_ms: float, detail: bool, rng: random.Random) -> int:
        """Rewrite this rank's spans for `step`; returns how many spans it sends."""
        wait_ms = max(0.2, barrier_ms - compute_ms + rng.uniform(0.0, 2.0))
        span = self.step_spans[detail]
        span.trace_id = trace_id
        span.span_id = rng.getrandbits(64).to_bytes(8, "big")
        span.start_time_unix_nano = start_ns
        span.end_time_unix_nano = start_ns + int((compute_ms + wait_ms) * 1e6)
        attrs = span.attributes
        attrs[self.STEP].value.int_value = step
        attrs[self.WAIT].value.double_value = round(wait_ms, 3)
        attrs[self.COMPUTE].value.double_value = round(compute_ms, 3)
        waits = attrs[self.PG_WAIT].value.array_value.values
        seqs = attrs[self.PG_SEQ].value.array_value.values
        for i, share in enumerate((0.05, 0.15, 0.2, 0.6)):
            waits[i].double_value = round(wait_ms * share, 3)
            seqs[i].int_value = (step + 1) * PG_COUNTS[i]
        if not detail:
            return 1
        for i, child in enumerate(self.children):
            child.trace_id = trace_id
            child.span_id = rng.getrandbits(64).to_bytes(8, "big")
            child.parent_span_id = span.span_id
            child.start_time_unix_nano = start_ns + i * 1_000_000
            child.end_time_unix_nano = child.start_time_unix_nano + 800_000
            child.attributes[0].value.int_value = step
            if i < 4:  # the collective spans: sequence number and wait
                child.attributes[3].value.int_value = step * PG_COUNTS[i] + 1
                child.attributes[-1].value.double_value = round(waits[i].double_value, 3)
        return 1 + len(self.children)


class JobGenerator:
    def __init__(self, mesh: Mesh, culprit: int, culprit_from: int, culprit_ms: float,
                 step_ms: float, detail_every: int, batch_ranks: int, seed: int = 7) -> None:
        self.mesh = mesh
        self.culprit, self.culprit_from, self.culprit_ms = culprit, culprit_from, culprit_ms
        self.step_ms = step_ms
        self.detail_every = detail_every
        self.rng = random.Random(seed)
        # One request per batch of ranks, as the front's batch processor would send.
        self.batches: list[tuple[ExportTraceServiceRequest, ExportTraceServiceRequest,
                                 list[RankSpans]]] = []
        for lo in range(0, mesh.world, batch_ranks):
            plain, detailed = ExportTraceServiceRequest(), ExportTraceServiceRequest()
            ranks = [RankSpans(r, mesh, plain, detailed)
                     for r in range(lo, min(mesh.world, lo + batch_ranks))]
            self.batches.append((plain, detailed, ranks))

    def requests(self, step: int, start_ns: int) -> list[tuple[bytes, int]]:
        """The step's requests: (payload, spans)."""
        rng = self.rng
        compute = [self.step_ms * rng.gauss(1.0, 0.01) for _ in range(self.mesh.world)]
        if step >= self.culprit_from:
            compute[self.culprit] += self.culprit_ms
        barrier = max(compute) + 5.0
        detail = self.detail_every > 0 and step % self.detail_every == 0
        trace_id = sc.step_trace_id(JOB, step).to_bytes(16, "big")
        out = []
        for plain, detailed, ranks in self.batches:
            spans = sum(r.fill(step, trace_id, start_ns, compute[r.rank], barrier, detail, rng)
                        for r in ranks)
            out.append(((detailed if detail else plain).SerializeToString(), spans))
        return out


# ---------------------------------------------------------------- collectors


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class CollectorProc:
    index: int
    store_path: str
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self, workdir: Path) -> None:
        config = embedded_config(self.store_path, grpc_port=self.grpc_port, http_port=0,
                                 metrics_port=self.metrics_port)
        # The largest front batch (batch-ranks ranks of a detail step) must fit.
        config["receivers"]["otlp"]["protocols"]["grpc"]["max_recv_msg_size_mib"] = 64
        path = workdir / f"collector{self.index}.yaml"
        path.write_text(yaml.safe_dump(config))
        log = open(workdir / f"collector{self.index}.log", "w")  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen([sys.executable, "-m", "flare.collector", "--config", str(path)],
                                     stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"collector {self.index} exited; see {workdir}/collector{self.index}.log")
            try:
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit(f"collector {self.index} did not listen within 60 s")

    def metrics(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(flare_collector_[a-z_]+)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU time of the collector process so far (Linux /proc)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)


# ---------------------------------------------------------------- measurement


class LatencyProbe(threading.Thread):
    """Polls each store for the newest correlated step; latency = first seen − acked."""

    def __init__(self, collectors: list[CollectorProc], acked: dict[int, float]) -> None:
        super().__init__(daemon=True)
        self.collectors = collectors
        self.acked = acked
        self.seen: dict[int, float] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        newest = {c.index: -1 for c in self.collectors}
        while not self.stop_event.is_set():
            for c in self.collectors:
                try:
                    con = store.open_reader(c.store_path, timeout_s=0.2)
                except store.StoreError:
                    continue
                try:
                    rows = con.execute(
                        "SELECT DISTINCT step FROM spans WHERE name = ? AND step > ?",
                        [sc.SPAN_STEP_RANKS, newest[c.index]],
                    ).fetchall()
                finally:
                    con.close()
                now = time.monotonic()
                for (step,) in rows:
                    self.seen.setdefault(step, now)
                    newest[c.index] = max(newest[c.index], step)
            self.stop_event.wait(0.5)

    def latencies(self) -> list[float]:
        return sorted(self.seen[s] - self.acked[s] for s in self.seen if s in self.acked)


def wait_drained(collectors: list[CollectorProc], timeout_s: float) -> float:
    """Seconds until every collector's write-ahead log is committed to its store."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        metrics = [c.metrics() for c in collectors]
        if all(m.get("flare_collector_wal_last_lsn", 0.0) <= m.get("flare_collector_wal_committed_lsn", 0.0)
               and m.get("flare_collector_queue_bytes", 0.0) == 0 for m in metrics):
            break
        time.sleep(0.5)
    return time.monotonic() - started


def stored_rank_steps(path: str) -> tuple[int, int]:
    """(train.step rows, bytes in used blocks). A short run leaves many free blocks in
    the file (each flush appends); a long-running store reuses them, so the used
    blocks are the steady-state size and the file size is what a short run costs."""
    con = store.open_reader(path, timeout_s=30)
    try:
        rows = int(con.execute("SELECT count(*) FROM spans WHERE name = ?", [sc.SPAN_STEP]).fetchone()[0])
        block_size, used = con.execute("SELECT block_size, used_blocks FROM pragma_database_size()").fetchone()
        return rows, int(block_size) * int(used)
    finally:
        con.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def diagnose_store(path: str, job: str) -> tuple[float, list[dict]]:
    from flare.diagnostics.backends import open_backend
    from flare.diagnostics.pipeline import diagnose

    started = time.perf_counter()
    backend = open_backend(f"store:{path}")
    result = diagnose(backend.job_data(job), warn=lambda _line: None)
    return time.perf_counter() - started, [a.to_json() for a in result.anomalies]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--collectors", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--speed", type=float, default=1.0, help="steps per wall-clock second")
    parser.add_argument("--step-ms", type=float, default=950.0, help="simulated step time")
    parser.add_argument("--detail-every", type=int, default=sc.DEFAULT_DETAIL_EVERY)
    parser.add_argument("--culprit", type=int, default=None, help="rank (default: a middle one)")
    parser.add_argument("--culprit-from", type=int, default=None)
    parser.add_argument("--culprit-ms", type=float, default=300.0)
    parser.add_argument("--batch-ranks", type=int, default=512)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--no-diagnose", action="store_true")
    args = parser.parse_args(argv)
    if args.ranks % (args.tp * args.pp):
        parser.error("--ranks must be a multiple of tp × pp")
    mesh = Mesh(args.tp, args.pp, args.ranks // (args.tp * args.pp))
    culprit = args.culprit if args.culprit is not None else mesh.world // 2 + 3
    culprit_from = args.culprit_from if args.culprit_from is not None else args.steps // 3
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="flare-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"mesh TP={mesh.tp} PP={mesh.pp} DP={mesh.dp} ({mesh.world} ranks), "
          f"{args.collectors} collector(s), {args.steps} steps at {args.speed} step/s, "
          f"detail every {args.detail_every}, culprit rank {culprit} from step {culprit_from}; "
          f"workdir {workdir}", flush=True)

    generator = JobGenerator(mesh, culprit, culprit_from, args.culprit_ms, args.step_ms,
                             args.detail_every, args.batch_ranks)
    collectors = [CollectorProc(i, str(workdir / f"store{i}.duckdb")) for i in range(args.collectors)]
    for c in collectors:
        c.start(workdir)
    channels = [grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}", options=[
        ("grpc.max_send_message_length", 64 << 20)]) for c in collectors]
    exports = [ch.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
               for ch in channels]

    acked: dict[int, float] = {}
    probe = LatencyProbe(collectors, acked)
    probe.start()
    backlog: list[tuple[float, list[float], list[float]]] = []
    sent_spans = 0
    generate_s = 0.0
    behind_max_s = 0.0
    cpu_start = [c.cpu_seconds() for c in collectors]
    t_start = time.monotonic()
    sim_t0 = time.time_ns()
    try:
        for step in range(args.steps):
            due = t_start + step / args.speed
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                behind_max_s = max(behind_max_s, -delay)
            g0 = time.perf_counter()
            requests = generator.requests(step, sim_t0 + int(step * (args.step_ms + 50) * 1e6))
            generate_s += time.perf_counter() - g0
            target = sc.step_trace_id(JOB, step) % len(collectors)
            for payload, spans in requests:
                for attempt in range(600):
                    try:
                        exports[target](payload, timeout=30)
                        break
                    except grpc.RpcError as exc:
                        # Backpressure (RESOURCE_EXHAUSTED/UNAVAILABLE): retry like an SDK.
                        if attempt == 599:
                            raise SystemExit(f"collector {target} kept refusing: {exc.code()}")
                        time.sleep(0.1)
                sent_spans += spans
            acked[step] = time.monotonic()
            if step % 10 == 0:
                snap = [c.metrics() for c in collectors]
                backlog.append((
                    time.monotonic() - t_start,
                    [m.get("flare_collector_queue_bytes", 0.0) for m in snap],
                    [m.get("flare_collector_wal_last_lsn", 0.0) - m.get("flare_collector_wal_committed_lsn", 0.0)
                     for m in snap],
                ))
                print(f"  step {step:5d}  sent {sent_spans:>9} spans  queue bytes "
                      f"{[int(b) for b in backlog[-1][1]]}  wal backlog {[int(b) for b in backlog[-1][2]]}",
                      flush=True)
        wall = time.monotonic() - t_start
        final = [c.metrics() for c in collectors]
        cpu = [c.cpu_seconds() - c0 for c, c0 in zip(collectors, cpu_start, strict=True)]
        # Until every acknowledged request is in the store: how far behind the run was.
        drain_s = wait_drained(collectors, timeout_s=900)
        time.sleep(2)  # the last correlation windows close by time
    finally:
        probe.stop_event.set()
        probe.join(timeout=10)
        for ch in channels:
            ch.close()
        for c in collectors:
            c.stop()

    accepted = [m.get("flare_collector_accepted_spans_total", 0.0) for m in final]
    lat = probe.latencies()
    store_bytes = sum(os.path.getsize(c.store_path) for c in collectors)
    sizes = [stored_rank_steps(c.store_path) for c in collectors]
    rank_steps = sum(n for n, _ in sizes)
    used_bytes = sum(b for _, b in sizes)
    # Bytes per stored rank-step (detail steps included at their rate) × steps per hour.
    steps_per_hour = 3600 / (args.step_ms / 1000 + 0.05)
    per_rank_hour = store_bytes / max(rank_steps, 1) * steps_per_hour
    used_per_rank_day = used_bytes / max(rank_steps, 1) * steps_per_hour * 24
    result = {
        "ranks": mesh.world, "mesh": [mesh.tp, mesh.pp, mesh.dp], "collectors": args.collectors,
        "steps": args.steps, "speed_steps_per_s": args.speed, "wall_s": round(wall, 1),
        "sent_spans": sent_spans,
        "spans_per_s_per_collector": [round(a / wall) for a in accepted],
        "generator_cpu_share": round(generate_s / wall, 3),
        "collector_cpu_s": [round(x, 1) for x in cpu],
        "collector_cpu_ms_per_1000_spans": [round(1e6 * x / max(a, 1), 1)
                                            for x, a in zip(cpu, accepted, strict=True)],
        "sender_behind_max_s": round(behind_max_s, 2),
        "queue_bytes_first_last": [backlog[0][1], backlog[-1][1]] if backlog else None,
        "wal_backlog_max": max((max(b[2]) for b in backlog), default=0),
        "correlated_steps": len(lat),
        "correlation_latency_s": {"p50": round(percentile(lat, 0.5), 2),
                                  "p95": round(percentile(lat, 0.95), 2),
                                  "max": round(lat[-1], 2) if lat else None},
        "drain_after_last_step_s": round(drain_s, 1),
        "store_bytes": store_bytes, "stored_rank_steps": rank_steps,
        "store_mb_per_rank_hour": round(per_rank_hour / 1e6, 3),
        "store_mb_per_rank_day": round(per_rank_hour * 24 / 1e6, 2),
        "store_used_blocks_mb_per_rank_day": round(used_per_rank_day / 1e6, 2),
    }
    if not args.no_diagnose:
        times, found, per_store = [], [], []
        for c in collectors:
            seconds, anomalies = diagnose_store(c.store_path, JOB)
            times.append(round(seconds, 2))
            found.extend(anomalies)
            stragglers = [a for a in anomalies if a["kind"] == "straggler"]
            per_store.append(bool(stragglers) and all(a["ranks"] == [culprit] for a in stragglers))
        result["diagnosis_s_per_store"] = times
        result["anomalies"] = sorted({(a["kind"], tuple(a["ranks"]), a["cause"]) for a in found})
        # Each store holds whole steps (a 1/K interleave): each must name the culprit.
        result["culprit_found_per_store"] = per_store
        result["culprit_found"] = all(per_store)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
