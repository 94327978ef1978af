"""Overhead of Flare's always-on instrumentation (issues 2 and 3).

Macro: the same 4-rank gloo DDP job (examples/train_ddp.py), plain `torchrun` versus
`opentelemetry-instrument torchrun` exporting real OTLP to a loopback receiver, runs
alternated (plain, instrumented, plain, ...), the instrumented arm with the environment
`flare run` gives its ranks (`flare_otlp` over OTLP/HTTP, a 2 s batch delay; `--exporter
otlp` for the SDK's stock encoder, `--protocol grpc` for gRPC). Prints the median step time of each
run, the median of the per-pair ratios, the bytes on the wire per rank per step, and
the detail-step cost on its own line. Both arms run through benchmarks/step_cpu_probe.py,
which also gives the CPU the instrumentation adds per rank and step (training thread and
whole process): a figure the machine's wall-time noise does not move. `--train-args`
changes the job's step (e.g. '--hidden 1024 --batch-size 128' for ~100 ms). Collective tracing is part of the instrumented
runs (it is always on).

Interleaved: the same job with the instrumentor switched on and off in alternating
blocks of steps inside the same four processes (benchmarks/instrumentation_overhead_
worker.py): the fairest comparison on a loaded machine, as both arms share its load.

Micro: each hot path A/B in this process (instrument / uninstrument around the same
loop), world-size-1 gloo, printing the added microseconds per call.

    .venv/bin/python benchmarks/instrumentation_overhead.py [--pairs 3] [--steps 220]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "tests" / "instrumentation"))

from otlp_sink import OtlpSink, rank_of  # noqa: E402
from rank_thread_cpu import plain_environment  # noqa: E402  (a sibling script)

RANKS = 4


# ---------------------------------------------------------------------------- macro
PROTOCOL = "http/protobuf"  # set by main(): --protocol


def rank_environment(sink: OtlpSink, exporter: str) -> dict[str, str]:
    """What `flare run` gives its ranks (exporter, protocol, batch delay, metrics, ...),
    pointed at `sink`; `--exporter`/`--protocol` may change the first two."""
    from flare.diagnostics.run import child_environment

    env = child_environment("bench", sink.endpoint, base={})
    env["OTEL_TRACES_EXPORTER"] = exporter
    env["OTEL_EXPORTER_OTLP_PROTOCOL"] = PROTOCOL
    if PROTOCOL == "grpc":
        env["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    return env


def _sink(raw: bool = False) -> OtlpSink:
    return OtlpSink(raw=raw, protocol="grpc" if PROTOCOL == "grpc" else "http")


def run_job(steps: int, instrumented: bool, sink: OtlpSink | None,
            train_args: list[str], exporter: str = "flare_otlp") -> tuple[list[float], dict]:
    """One run; returns rank 0's step wall times and the ranks' mean per-step CPU
    medians (training thread, whole process) from benchmarks/step_cpu_probe.py."""
    with tempfile.TemporaryDirectory() as tmp:
        times_path = os.path.join(tmp, "steps.json")
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(RANKS),
                   str(REPO / "benchmarks" / "step_cpu_probe.py"), tmp,
                   str(REPO / "examples" / "train_ddp.py"), "--steps", str(steps),
                   "--step-times", times_path, *train_args]
        env = plain_environment()
        if instrumented:
            command = [str(BIN / "opentelemetry-instrument"), *command]
            env.update(rank_environment(sink, exporter))
        result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                                timeout=900)
        if result.returncode != 0:
            raise SystemExit(f"training run failed:\n{result.stdout[-2000:]}"
                             f"{result.stderr[-2000:]}")
        with open(times_path) as handle:
            times = json.load(handle)
        probes = []
        for rank in range(RANKS):
            with open(os.path.join(tmp, f"rank{rank}.json")) as handle:
                probes.append(json.load(handle))
        cpu = {key: statistics.fmean(p[key] for p in probes)
               for key in ("thread_cpu_ms", "process_cpu_ms")}
        return times, cpu


def macro(pairs: int, steps: int, train_args: list[str], exporter: str) -> dict:
    warmup = 10  # first steps include DDP bucket rebuilding and allocator warm-up
    plain_medians, instrumented_medians, ratios = [], [], []
    wire_per_rank_step, detail_costs = [], []
    thread_added, process_added, plain_process_cpu = [], [], []
    for pair in range(pairs):
        # ABBA order (plain first in even pairs, instrumented first in odd ones), so
        # that a drift of the machine's speed over the session cancels out.
        if pair % 2 == 0:
            plain_times, plain_cpu = run_job(steps, False, None, train_args)
        # raw: the sink stands for a remote collector; parsing happens after the run
        with _sink(raw=True) as sink:
            times, cpu = run_job(steps, True, sink, train_args, exporter)
            time.sleep(1.0)  # the last batch export
            by_rank = sink.bytes_by_rank()
            step_spans = [s for s in sink.spans() if s["name"] == "train.step"]
        if pair % 2 == 1:
            plain_times, plain_cpu = run_job(steps, False, None, train_args)
        plain = statistics.median(plain_times[warmup:])
        thread_added.append(cpu["thread_cpu_ms"] - plain_cpu["thread_cpu_ms"])
        process_added.append(cpu["process_cpu_ms"] - plain_cpu["process_cpu_ms"])
        plain_process_cpu.append(plain_cpu["process_cpu_ms"])
        instrumented = statistics.median(times[warmup:])
        plain_medians.append(plain)
        instrumented_medians.append(instrumented)
        ratios.append(instrumented / plain)
        wire_per_rank_step.append(statistics.mean(by_rank.get(r, 0) for r in range(RANKS))
                                  / steps)
        detail = [(s["end_ns"] - s["start_ns"]) / 1e6 for s in step_spans
                  if s["attributes"].get("flare.step.detail")
                  and s["attributes"]["flare.step"] >= warmup]
        normal = [(s["end_ns"] - s["start_ns"]) / 1e6 for s in step_spans
                  if not s["attributes"].get("flare.step.detail")
                  and s["attributes"]["flare.step"] >= warmup]
        if detail and normal:
            detail_costs.append(statistics.mean(detail) - statistics.median(normal))
        print(f"pair {pair}: plain {plain * 1e3:.2f} ms/step, instrumented "
              f"{instrumented * 1e3:.2f} ms/step, ratio {instrumented / plain:.4f}, "
              f"{wire_per_rank_step[-1]:.0f} B/rank/step, CPU added per rank-step "
              f"{thread_added[-1] * 1e3:+.0f} us training thread, "
              f"{process_added[-1] * 1e3:+.0f} us process, ranks seen "
              f"{sorted({rank_of(s) for s in step_spans})}", flush=True)
    mean = statistics.fmean(ratios)
    # 95 % confidence interval of the mean pair ratio (Student's t, two-sided).
    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31,
           9: 2.26, 10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}
    half = (t95.get(len(ratios) - 1, 2.0) * statistics.stdev(ratios) / len(ratios) ** 0.5
            if len(ratios) > 1 else float("nan"))
    return {
        "thread_added_us": statistics.median(thread_added) * 1e3,
        "process_added_us": statistics.median(process_added) * 1e3,
        "ratios": ratios, "ratio_mean": mean, "ratio_ci95": (mean - half, mean + half),
        "plain_ms": statistics.median(plain_medians) * 1e3,
        "plain_process_cpu_ms": statistics.median(plain_process_cpu),
        "instrumented_ms": statistics.median(instrumented_medians) * 1e3,
        "ratio_median_of_pairs": statistics.median(ratios),
        "ratio_of_medians": statistics.median(instrumented_medians)
        / statistics.median(plain_medians),
        "bytes_per_rank_per_step": statistics.median(wire_per_rank_step),
        "detail_step_extra_ms": statistics.median(detail_costs) if detail_costs else None,
    }


# ---------------------------------------------------------------------------- interleaved
def interleaved(steps: int, block: int, train_args: list[str], exporter: str) -> dict:
    with _sink() as sink, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        env = plain_environment()
        env.update(rank_environment(sink, exporter))
        # Always-on cost only: detail steps (and the GPU layer's kernel windows, whose
        # conversion runs on after the window) are measured apart, on their own line.
        env.update({"FLARE_HEARTBEAT_S": "10", "FLARE_DETAIL_EVERY": "0",
                    "FLARE_BENCH_EXPORTER": exporter})
        result = subprocess.run(
            [str(BIN / "torchrun"), "--nproc_per_node", str(RANKS),
             str(REPO / "benchmarks" / "instrumentation_overhead_worker.py"), out,
             str(steps), str(block), *train_args], env=env, cwd=REPO, capture_output=True,
            text=True, timeout=1800)
        if result.returncode != 0:
            raise SystemExit(f"interleaved run failed:\n{result.stderr[-3000:]}")
        ranks = []
        for rank in range(RANKS):
            with open(f"{out}.{rank}") as handle:
                ranks.append(json.load(handle))
    return interleaved_figures(ranks)


def _ci95(values: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(values)
    half = (1.96 * statistics.stdev(values) / len(values) ** 0.5
            if len(values) > 1 else float("nan"))
    return mean, mean - half, mean + half


def interleaved_figures(ranks: list[list[dict]]) -> dict:
    """The in-process A/B's figures from every rank's blocks (the worker's files).

    Each instrumented block is compared with the mean of the plain blocks on either side
    of it, so that a drift of the machine's speed over the run cancels to first order.
    Wall time: rank 0's median step (the ranks wait for each other at every all-reduce).
    CPU: the mean per step of the four processes together (every thread: the training
    thread, Flare's and the SDK's, gloo's), the instrumented block's left-over work done
    at its end (`toggle`) spread over its steps: on a machine whose cores the ranks
    share, it is the job's CPU that sets its step time."""
    med, mean = statistics.median, statistics.fmean
    blocks = ranks[0]
    wall_ratios, cpu_ratios, process_added, thread_added = [], [], [], []
    for i, current in enumerate(blocks):
        if not current["instrumented"] or not current["wall"]:
            continue
        neighbours = [j for j in (i - 1, i + 1)
                      if 0 <= j < len(blocks) and not blocks[j]["instrumented"]
                      and blocks[j]["wall"]]
        if not neighbours:
            continue
        wall_ratios.append(med(current["wall"])
                           / mean(med(blocks[j]["wall"]) for j in neighbours))
        on_cpu = off_cpu = on_thread = off_thread = 0.0
        for rank_blocks in ranks:
            block = rank_blocks[i]
            toggle = block.get("toggle", (0.0, 0.0, 0.0))
            on_cpu += mean(block["process_cpu"]) + toggle[2] / block["steps"]
            off_cpu += mean(mean(rank_blocks[j]["process_cpu"]) for j in neighbours)
            on_thread += mean(block["thread_cpu"])
            off_thread += mean(mean(rank_blocks[j]["thread_cpu"]) for j in neighbours)
        cpu_ratios.append(on_cpu / off_cpu)
        process_added.append((on_cpu - off_cpu) / len(ranks) * 1e6)
        thread_added.append((on_thread - off_thread) / len(ranks) * 1e6)
    if not wall_ratios:
        raise SystemExit("interleaved: no instrumented block with a plain one beside it "
                         "(raise --interleaved-steps or lower --block)")
    everything = {arm: [t for b in blocks if b["instrumented"] == (arm == "on")
                        for t in b["wall"]] for arm in ("on", "off")}
    wall_mean, wall_low, wall_high = _ci95(wall_ratios)
    cpu_mean, cpu_low, cpu_high = _ci95(cpu_ratios)
    added_mean, added_low, added_high = _ci95(process_added)
    return {"plain_ms": med(everything["off"]) * 1e3,
            "instrumented_ms": med(everything["on"]) * 1e3,
            "ratio": med(everything["on"]) / med(everything["off"]),
            "block_ratio_median": med(wall_ratios), "block_ratio_mean": wall_mean,
            "block_ratio_ci95": (wall_low, wall_high), "blocks": len(wall_ratios),
            "cpu_ratio_median": med(cpu_ratios), "cpu_ratio_mean": cpu_mean,
            "cpu_ratio_ci95": (cpu_low, cpu_high),
            "process_added_us": added_mean, "process_added_ci95": (added_low, added_high),
            "thread_added_us": mean(thread_added),
            "samples": (len(everything["off"]), len(everything["on"]))}


# ---------------------------------------------------------------------------- micro
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _per_call_us(function, calls: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the machine is shared
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _encoding_us(spans: list) -> tuple[float, float, float]:
    """µs per step span to encode an export request: the SDK's encoder (`otlp`), Flare's
    writer (`flare_otlp`, incl. the parse into the request object the gRPC stub sends)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    try:
        from flare.instrumentation.otlp_encoding import encode_request
    except ImportError:  # an older tree on PYTHONPATH (before/after comparisons)
        return (float("nan"),) * 3
    if not spans:
        return (float("nan"),) * 3
    sdk = _per_call_us(lambda: encode_spans(spans), 3) / len(spans)
    flare = _per_call_us(
        lambda: ExportTraceServiceRequest.FromString(encode_request(spans)), 3) / len(spans)
    return sdk, flare, flare - sdk


def micro() -> dict:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "FLARE_JOB_ID": "bench", "FLARE_HEARTBEAT_S": "0",
                       "FLARE_DETAIL_EVERY": "0", "TORCH_FR_BUFFER_SIZE": "256"})
    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from torch.utils.data import DataLoader

    from flare.instrumentation import torch_training
    from flare.instrumentation.flight_recorder import FlightRecorder
    from flare.instrumentation.torch_training import TorchTrainingInstrumentor

    class DropExporter(SpanExporter):
        def __init__(self):
            self.step_spans = []  # a few, for the encoding figure

        def export(self, spans):
            if len(self.step_spans) < 500:
                self.step_spans.extend(s for s in spans if s.name == "train.step")
            return SpanExportResult.SUCCESS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(list(range(10**6)), batch_size=None)
    iterator = iter(loader)
    tensor = torch.ones(4)
    loss_input = torch.randn(2, 4)

    def backward():
        model(loss_input).sum().backward()

    paths = {
        "optimizer step boundary (per step)": (optimizer.step, 2000),
        "dataloader __next__ (per batch)": (lambda: next(iterator), 5000),
        "gc collection callback (per GC, gen 0)": (lambda: gc.collect(0), 2000),
        "collective wrapper (per all_reduce)": (lambda: dist.all_reduce(tensor), 2000),
        "backward wrapper (per backward)": (backward, 1000),
    }

    def ddp_backward():
        """Built in each arm (DDP wrappers are sized at construction), then timed: the
        backward wrapper plus the gradient-bytes add, on top of DDP's own all-reduce."""
        from torch.nn.parallel import DistributedDataParallel

        ddp_model = DistributedDataParallel(torch.nn.Linear(4, 1))
        return lambda: ddp_model(loss_input).sum().backward()

    built_per_arm = {"DDP backward (per backward, incl. bucket bytes)": (ddp_backward, 1000)}
    torch_training.GPU_LAYER_MODULES = ()  # measure this layer alone
    provider = TracerProvider()
    dropped = DropExporter()
    provider.add_span_processor(BatchSpanProcessor(dropped))
    instrumentor = TorchTrainingInstrumentor()
    results = {}
    for name, (function, calls) in paths.items():
        plain = _per_call_us(function, calls)
        instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
        with_flare = _per_call_us(function, calls)
        instrumentor.uninstrument()
        results[name] = (plain, with_flare, with_flare - plain)
    for name, (build, calls) in built_per_arm.items():
        plain = _per_call_us(build(), calls)
        instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
        with_flare = _per_call_us(build(), calls)
        instrumentor.uninstrument()
        results[name] = (plain, with_flare, with_flare - plain)
    # The finisher thread's share: ordinary steps' spans are built off the training
    # thread (runtime.drain), so the boundary above no longer includes them.
    import flare.instrumentation as flare_instrumentation

    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    runtime = flare_instrumentation.active_runtime()
    best = float("inf")
    for _ in range(5):
        runtime.drain()
        for _ in range(500):
            optimizer.step()
        start = time.perf_counter()
        built = len(runtime.finisher.deferred)
        runtime.drain()
        if built:
            best = min(best, (time.perf_counter() - start) / built)
    instrumentor.uninstrument()
    results["step span build (per step, finisher thread)"] = (0.0, best * 1e6, best * 1e6)
    provider.force_flush()
    results["OTLP encoding per step span, exporter thread"] = _encoding_us(dropped.step_spans)
    recorder = FlightRecorder()
    for _ in range(600):  # fill the 256-entry buffer Flare sets by default
        dist.all_reduce(tensor)
    results["flight recorder read, 256 entries (after detail steps, finisher thread)"] = (
        0.0, _per_call_us(recorder.entries, 20), _per_call_us(recorder.entries, 20))
    dist.destroy_process_group()
    provider.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--interleaved-steps", type=int, default=1200)
    parser.add_argument("--block", type=int, default=25)
    parser.add_argument("--skip-macro", action="store_true")
    parser.add_argument("--train-args", default="",
                        help="extra arguments for examples/train_ddp.py, e.g. "
                        "'--hidden 1024 --batch-size 128' for a ~100 ms step")
    parser.add_argument("--exporter", default="flare_otlp", choices=("flare_otlp", "otlp"),
                        help="OTEL_TRACES_EXPORTER of the instrumented arm: flare_otlp (what "
                        "`flare run` uses) or the SDK's stock otlp")
    parser.add_argument("--protocol", default="http/protobuf",
                        choices=("http/protobuf", "grpc"),
                        help="OTLP protocol of the instrumented arm (flare run: http/protobuf)")
    args = parser.parse_args()
    global PROTOCOL
    PROTOCOL = args.protocol
    shown = {k: v for k, v in rank_environment(_sink(), args.exporter).items()
             if k.startswith("OTEL_") and k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    print("instrumented arm: the environment `flare run` gives its ranks: "
          + " ".join(f"{k}={v}" for k, v in sorted(shown.items())), flush=True)
    if args.interleaved_steps:
        figures = interleaved(args.interleaved_steps, args.block, args.train_args.split(),
                              args.exporter)
        low, high = figures["block_ratio_ci95"]
        print(f"interleaved in-process A/B ({args.block}-step blocks, "
              f"{figures['samples'][0]}/{figures['samples'][1]} steps, always-on work only: "
              f"no detail steps): plain {figures['plain_ms']:.2f} ms, instrumented "
              f"{figures['instrumented_ms']:.2f} ms, ratio of medians {figures['ratio']:.4f}; "
              f"each instrumented block against its plain neighbours ({figures['blocks']} "
              f"blocks): wall median {figures['block_ratio_median']:.4f}, mean "
              f"{figures['block_ratio_mean']:.4f} [{low:.4f}, {high:.4f}] (95 %)", flush=True)
        low, high = figures["cpu_ratio_ci95"]
        added_low, added_high = figures["process_added_ci95"]
        print(f"  CPU of the four processes per step (all threads, the left-over work done "
              f"at each block's end included): ratio median {figures['cpu_ratio_median']:.4f}"
              f", mean {figures['cpu_ratio_mean']:.4f} [{low:.4f}, {high:.4f}] (95 %); added "
              f"per rank-step {figures['process_added_us']:+.0f} us [{added_low:+.0f}, "
              f"{added_high:+.0f}], of it on the training thread "
              f"{figures['thread_added_us']:+.0f} us", flush=True)
    if not args.skip_macro:
        figures = macro(args.pairs, args.steps, args.train_args.split(), args.exporter)
        print(f"plain median step: {figures['plain_ms']:.2f} ms; instrumented: "
              f"{figures['instrumented_ms']:.2f} ms")
        print(f"step-time overhead ratio (median of {args.pairs} alternated pairs): "
              f"{figures['ratio_median_of_pairs']:.4f} (ratio of medians "
              f"{figures['ratio_of_medians']:.4f}); targets <= 1.005 (issue 2), <= 1.01 "
              "with collectives (issue 3)")
        print(f"CPU added per rank per step (median of pairs, ranks' mean of per-step "
              f"medians): training thread {figures['thread_added_us']:+.0f} us, whole "
              f"process {figures['process_added_us']:+.0f} us")
        low, high = figures["ratio_ci95"]
        print(f"mean pair ratio {figures['ratio_mean']:.4f}, 95% confidence interval "
              f"[{low:.4f}, {high:.4f}]; pairs: "
              + ", ".join(f"{r:.4f}" for r in figures["ratios"]))
        print(f"bytes on the wire per rank per step: {figures['bytes_per_rank_per_step']:.0f} "
              f"(target <= 4096, default FLARE_DETAIL_EVERY=100, {args.steps} steps)")
        detail = figures["detail_step_extra_ms"]
        print("detail step cost: "
              + (f"+{detail:.1f} ms over a median step" if detail is not None else "n/a"))
    print("micro-benchmarks (best of 5, µs per call: plain / instrumented / added):")
    hooks = micro()
    encoding = hooks.pop("OTLP encoding per step span, exporter thread")
    for name, (plain, with_flare, added) in hooks.items():
        print(f"  {name:45s} {plain:8.2f} {with_flare:8.2f} {added:+8.2f}")
    print(f"OTLP encoding per train.step span (exporter thread, µs): SDK encoder (otlp) "
          f"{encoding[0]:.1f}, Flare's writer (flare_otlp) {encoding[1]:.1f}")
    if not args.skip_macro:
        # The same figure from the measured hook costs, which the machine's noise moves
        # far less than whole-run medians: one step boundary, one backward, one batch
        # and a few gen-0 collections per step of this job.
        per_step_us = (hooks["optimizer step boundary (per step)"][2]
                       + hooks["step span build (per step, finisher thread)"][2]
                       + hooks["backward wrapper (per backward)"][2]
                       + hooks["dataloader __next__ (per batch)"][2]
                       + 5 * hooks["gc collection callback (per GC, gen 0)"][2])
        # Against the CPU of one rank's step (the cost is paid per rank), not the wall
        # step: with four ranks on fewer cores a step's wall time spans several ranks' CPU.
        print(f"hook cost per step: {per_step_us:.0f} µs = "
              f"{100 * per_step_us / (figures['plain_process_cpu_ms'] * 1e3):.2f}% of the "
              f"plain job's CPU per rank-step ({figures['plain_process_cpu_ms']:.1f} ms; warm "
              "micro-benchmark figures: benchmarks/overhead_accounting.py counts them in "
              "the running job)")


if __name__ == "__main__":
    main()
