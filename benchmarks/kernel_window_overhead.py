"""Amortized cost of Flare's sampled kernel windows on the training thread.

    .venv/bin/python benchmarks/kernel_window_overhead.py [--steps 300] [--every 100]

A small transformer trains on CPU (a few hundred operators per step, as a real step
has). The same process runs, interleaved in rounds so machine noise hits both alike:
- baseline: the kernel-window listener installed but every step ordinary;
- windows: every `--every`-th step (default 100, FLARE_DETAIL_EVERY's default) records
  a window, converted to spans by the background thread into an in-memory exporter.
Reported: median ordinary step, extra time of a window step on the training thread,
the background conversion time (CPU time of the worker, which shares cores with
training), and the amortized overhead = (training-thread extra + conversion) /
(every × ordinary step). Target ≤ 1%.
On a GPU the window adds CUPTI activity buffers instead of CPU operator records; run the
same benchmark there through tests/gpu/run_gpu_checks.sh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flare.instrumentation import kernels
from flare.wire import semconv as sc


class BenchRuntime:
    """The step-listener contract of flare.instrumentation.runtime.Runtime."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("bench")
        self.rank = self.local_rank = 0
        self.job_id = "bench"
        self.span_attributes = {sc.RANK: 0}
        self.listeners: list = []

    def add_step_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_step_listener(self, listener) -> None:
        self.listeners.remove(listener)


def make_step(device: str):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024,
                                             batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8, 64, 256, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def run(runtime: BenchRuntime, step, steps: int, every: int | None, offset: int) -> list[tuple[bool, float]]:
    times = []
    for i in range(steps):
        number = offset + i
        detail = every is not None and number % every == 0
        span = runtime.tracer.start_span(sc.SPAN_STEP, attributes={sc.STEP: number})
        start = time.perf_counter()
        for listener in runtime.listeners:
            listener.on_step_start(number, detail)
        step()
        for listener in runtime.listeners:
            listener.on_step_end(number, detail, span)
        times.append((detail, time.perf_counter() - start))
        span.end()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per configuration")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = make_step(device)
    runtime = BenchRuntime()
    if device == "cpu":  # host windows are opt-in without CUDA; this measures that path
        os.environ.setdefault(sc.ENV_KERNEL_WINDOWS, "1")
    windows = kernels.install(runtime)
    if windows is None:
        print("skipped: kernel windows are switched off (FLARE_KERNEL_WINDOWS=0)")
        return 0
    for _ in range(5):
        step()  # warm up allocator and kernels
    # The first profiler start in a process initialises Kineto; it is paid once per run.
    first = run(runtime, step, 1, every=1, offset=0)[0][1]
    windows.flush()
    per_round = args.steps // args.rounds
    baseline, ordinary, window_steps = [], [], []
    conversion_before = windows.conversion_cpu_s
    offset = 1
    for _ in range(args.rounds):
        baseline += [t for _, t in run(runtime, step, per_round, every=None, offset=offset)]
        offset += per_round
        start = offset + (-offset) % args.every  # begin on a detail step
        timed = run(runtime, step, per_round, every=args.every, offset=start)
        offset = start + per_round
        windows.flush()
        ordinary += [t for d, t in timed if not d]
        window_steps += [t for d, t in timed if d]
    conversion_s = windows.conversion_cpu_s - conversion_before
    base_step = statistics.median(baseline)
    with_step = statistics.median(ordinary)
    # Against the ordinary steps of the same rounds: the shared machine's load drifts.
    window_extra = statistics.median(window_steps) - with_step if window_steps else float("nan")
    # Conversion runs on the background thread; counted in full, as if it took its CPU
    # time away from training (true when the cores are all busy).
    conversion_per_window = conversion_s / max(len(window_steps), 1)
    amortized = (window_extra + conversion_per_window) / (args.every * with_step)
    spans = [s for s in runtime.exporter.get_finished_spans() if s.name == sc.SPAN_KERNEL]
    print(f"device {device}; {len(window_steps)} windows, {len(spans)} kernel spans "
          f"({len(spans) / max(windows.windows_recorded, 1):.0f} per window)")
    print(f"ordinary step, windows never due    {base_step * 1e3:8.2f} ms")
    print(f"ordinary step, windows every {args.every:<5}  {with_step * 1e3:8.2f} ms  "
          f"({(with_step / base_step - 1) * 100:+.2f}%: the listener's per-step test, and noise)")
    print(f"window step extra, training thread  {window_extra * 1e3:8.2f} ms")
    print(f"background conversion (CPU time)    {conversion_per_window * 1e3:8.2f} ms per window")
    print(f"first window in a process (Kineto init, once) {(first - base_step) * 1e3:8.1f} ms")
    print(f"amortized overhead at every={args.every}: {amortized * 100:.3f}% of step time "
          f"(target <= 1%)")
    kernels.uninstall(runtime)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
