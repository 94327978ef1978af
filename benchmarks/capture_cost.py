"""What a targeted capture costs a captured rank, per step, side by side with the same
steps uncaptured in the same process.

One instrumented process (the real instrumentor, a real in-process collector whose
OpAMP endpoint the rank's agent polls); blocks of steps alternate: ordinary, then
captured (asked through `collector.opamp.request_capture`, as `flare run` asks). Per
step: the training thread's CPU, the sampler thread's CPU (`flare-stack-sampler`,
/proc), and wall time. The step is a small torch model plus pure-Python work (the worst
case for the GIL hand-off to the sampler).

    .venv/bin/python benchmarks/capture_cost.py [--blocks 6] [--steps 40] [--python-ms 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time


def _thread_cpu_s(name: str) -> float:
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as handle:
                return int(handle.read().split()[0]) / 1e9
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6, help="pairs of ordinary and captured blocks")
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--python-ms", type=float, default=20.0, help="pure-Python work per step")
    args = parser.parse_args()
    for key in [k for k in os.environ if k.startswith("FLARE_")]:
        del os.environ[key]
    workdir = tempfile.mkdtemp(prefix="flare-capture-cost-")
    import torch
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from flare.collector.config import embedded_config
    from flare.collector.service import Collector
    from flare.instrumentation.torch_training import TorchTrainingInstrumentor

    collector = Collector(embedded_config(os.path.join(workdir, "store.duckdb")))
    collector.start()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "FLARE_JOB_ID": "capture-cost",
                       "FLARE_HEARTBEAT_S": "0", "FLARE_DETAIL_EVERY": "0",
                       "FLARE_OPAMP_ENDPOINT": f"http://{collector.http_endpoint}/v1/opamp",
                       "FLARE_OPAMP_INTERVAL_S": "0.2"})
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    capture = instrumentor._opamp.capture
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batch = torch.randn(64, 256)

    def python_work(n: int) -> None:
        for _ in range(n):
            sum(range(200))

    started = time.thread_time()
    python_work(2000)
    loops = max(1, int(2000 * args.python_ms / 1e3 / max(time.thread_time() - started, 1e-6)))

    def step() -> None:  # a fixed amount of work: the GIL hand-offs show as time
        python_work(loops)
        model(batch).sum().backward()
        optimizer.step()

    def block(captured: bool) -> tuple[float, float, float]:
        if captured:
            collector.opamp.request_capture("capture-cost", [0], args.steps + 1)
            deadline = time.monotonic() + 10
            while capture.steps_left == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            step()  # the request is served from the next step on
        sampler0, wall0, cpu0 = _thread_cpu_s("flare-stack-sampler"), time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            step()
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        sampler = _thread_cpu_s("flare-stack-sampler") - sampler0
        if captured:
            capture.stop("block done")
        return cpu / args.steps * 1e6, sampler / args.steps * 1e6, wall / args.steps * 1e3

    try:
        for _ in range(5):
            step()
        rows: dict[bool, list] = {False: [], True: []}
        for _ in range(args.blocks):
            for captured in (False, True):
                rows[captured].append(block(captured))
    finally:
        instrumentor.uninstrument()
        collector.stop(10)
    plain, taken = rows[False], rows[True]
    med = [statistics.median(r[i] for r in plain) for i in range(3)]
    cap = [statistics.median(r[i] for r in taken) for i in range(3)]
    print(f"{args.blocks} × {args.steps} steps each way, {args.python_ms:g} ms of pure Python per step "
          "(medians of the blocks)")
    print(f"{'':<28}{'ordinary':>12}{'captured':>12}{'added':>12}")
    print(f"{'training thread µs/step':<28}{med[0]:>12.0f}{cap[0]:>12.0f}{cap[0] - med[0]:>+12.0f}")
    print(f"{'sampler thread µs/step':<28}{med[1]:>12.0f}{cap[1]:>12.0f}{cap[1] - med[1]:>+12.0f}")
    print(f"{'wall ms/step':<28}{med[2]:>12.2f}{cap[2]:>12.2f}{cap[2] - med[2]:>+12.2f}")
    print(f"captured-step CPU ratio: {(cap[0] + cap[1]) / (med[0] + med[1]):.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
