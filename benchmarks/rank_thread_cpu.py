"""CPU per rank-step of every thread of a rank (torchrun wrapper around a training script).

Reads `/proc/self/task/*/schedstat` (nanoseconds each thread ran) at the 100th optimizer
step and at exit, and writes `threads<RANK>.json` into OUT_DIR: microseconds per step
for each thread name (Flare's `flare-step-finisher`, `flare-watchdog`, the batch
processor's `OtelBatchSpanRecordProcessor`, gRPC's threads if any, gloo's, MainThread).
Linux only. Used for the per-thread tables of docs/benchmarks.md, e.g.

    OTEL_TRACES_EXPORTER=flare_otlp OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf \\
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT OTEL_BSP_SCHEDULE_DELAY=5000 \\
    OTEL_METRICS_EXPORTER=none OTEL_LOGS_EXPORTER=none \\
    OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=otel,flare \\
      .venv/bin/opentelemetry-instrument .venv/bin/torchrun --nproc_per_node 4 \\
      benchmarks/rank_thread_cpu.py OUT_DIR examples/train_ddp.py --steps 600

with `python tests/instrumentation/otlp_sink.py PORT_FILE http` as the receiver
(`grpc` and `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` for gRPC; plain `torchrun` for the
uninstrumented job).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading

FIRST_STEP = 100


def _threads_ns() -> dict[str, int]:
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    totals: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as handle:
                ran_ns = int(handle.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as handle:
                comm = handle.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), comm)
        totals[name] = totals.get(name, 0) + ran_ns
    return totals


def main() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out_dir, script = sys.argv[1], sys.argv[2]
    state = {"steps": 0, "first": None}

    def count(*_):
        state["steps"] += 1
        if state["steps"] == FIRST_STEP:
            state["first"] = _threads_ns()

    def dump():
        steps = state["steps"] - FIRST_STEP
        if state["first"] is None or steps <= 0:
            return
        first, last = state["first"], _threads_ns()
        per_step = {name: round((ns - first.get(name, 0)) / 1e3 / steps, 1)
                    for name, ns in last.items()}
        with open(os.path.join(out_dir, f"threads{os.environ.get('RANK', '0')}.json"),
                  "w") as handle:
            json.dump(per_step, handle)

    register_optimizer_step_post_hook(count)
    atexit.register(dump)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
