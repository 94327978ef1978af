"""CPU per rank-step of every thread of a rank (torchrun wrapper around a training script).

Reads `/proc/self/task/*/schedstat` (nanoseconds each thread ran) at the 100th optimizer
step and at exit, and writes `threads<RANK>.json` into OUT_DIR: microseconds per step
for each thread name (Flare's `flare-step-finisher`, `flare-watchdog`, the batch
processor's `OtelBatchSpanRecordProcessor`, the SDK's metric reader, gRPC's threads if
any, gloo's, MainThread), and a `garbage collection` row: the CPU of the collections that
ran (on any thread) per step, from `gc.callbacks`. Linux only. Used for the per-thread tables of
docs/benchmarks.md. The usual way runs it under exactly the environment `flare run`
gives its ranks (`child_environment()`), exporting to a loopback OTLP/HTTP receiver,
and prints the 4 ranks' mean per thread:

    .venv/bin/python benchmarks/rank_thread_cpu.py --drive --steps 400 \
        --hidden 1024 --batch-size 128

(arguments after `--drive` go to examples/train_ddp.py; `FLARE_BENCH_RANKS_PYTHONPATH=
<other tree's flare-instrumentation, installed with --target>` gives the ranks another
tree's instrumentation, side by side with this one's). As a
wrapper, by hand:

    ... opentelemetry-instrument torchrun --nproc_per_node 4 \
        benchmarks/rank_thread_cpu.py OUT_DIR examples/train_ddp.py --steps 600
"""

from __future__ import annotations

import atexit
import gc
import glob
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Threads that are the job's own, not the instrumentation's.
# (tqdm_monitor: the progress bar of the HF Trainer and Lightning, the job's own)
JOB_THREADS = ("MainThread", "gloo_tcp_loop", "pt_gloo_runloop", "tqdm_monitor")

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


def run_wrapped(prefix: str, start, finish) -> None:
    """The wrapper's side (argv: OUT_DIR, the training script and its arguments): run the
    script, call `start()` at its FIRST_STEP-th optimizer step, and at exit write
    `finish(steps since then)` to OUT_DIR/<prefix><RANK>.json (nothing before that step)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out_dir, script = sys.argv[1], sys.argv[2]
    state = {"steps": 0}

    def count(*_):
        state["steps"] += 1
        if state["steps"] == FIRST_STEP:
            start()

    def dump():
        steps = state["steps"] - FIRST_STEP
        if steps <= 0:
            return
        with open(os.path.join(out_dir, f"{prefix}{os.environ.get('RANK', '0')}.json"),
                  "w") as handle:
            json.dump(finish(steps), handle)

    register_optimizer_step_post_hook(count)
    atexit.register(dump)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


GC = "garbage collection"  # a pseudo-thread: collections' CPU on whatever thread ran them


def main() -> None:
    first: dict[str, int] = {}
    gc_ns = [0, 0]  # CPU in collections since FIRST_STEP, the one in progress's start

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_ns[1] = time.thread_time_ns()
        elif gc_ns[1]:
            gc_ns[0] += time.thread_time_ns() - gc_ns[1]
            gc_ns[1] = 0

    def start() -> None:
        first.update(_threads_ns())
        gc.callbacks.append(on_gc)

    def finish(steps: int) -> dict:
        last = _threads_ns()
        figures = {name: round((ns - first.get(name, 0)) / 1e3 / steps, 1)
                   for name, ns in last.items()}
        figures[GC] = round(gc_ns[0] / 1e3 / steps, 2)
        return figures

    run_wrapped("threads", start, finish)


def plain_environment() -> dict[str, str]:
    """This process's environment without OpenTelemetry's, Flare's and the flight
    recorder's variables: what a plain (uninstrumented) run of the job gets."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "FLARE_", "TORCH_FR"))}


def instrumentation_us(per_thread: dict[str, float]) -> float:
    """The instrumentation's threads together, from µs per rank-step by thread name."""
    return sum(v for name, v in per_thread.items() if name not in (*JOB_THREADS, GC))


# The training script the benchmarks run (overhead_accounting.py --script: a framework's).
SCRIPT = REPO / "examples" / "train_ddp.py"


def run_ranks(wrapper: str, job: str, prefix: str, train_args: list[str],
              instrumented: bool = True) -> list[dict]:
    """Run SCRIPT (examples/train_ddp.py) on 4 ranks through `wrapper` (a script taking OUT_DIR
    and the training script) under exactly `flare run`'s rank environment, exporting to
    a loopback OTLP/HTTP sink (or, not `instrumented`, plain `torchrun` without Flare);
    returns what each rank wrote to OUT_DIR/<prefix>*.json."""
    sys.path.insert(0, str(REPO / "tests" / "instrumentation"))
    from otlp_sink import OtlpSink

    from flare.diagnostics.run import child_environment

    with tempfile.TemporaryDirectory() as out, OtlpSink(protocol="http", raw=True) as sink:
        if instrumented:
            env = child_environment(job, sink.endpoint, opamp=True)  # as flare run: with the OpAMP poll
            if os.environ.get("FLARE_BENCH_RANKS_PYTHONPATH"):  # another tree's instrumentation
                env["PYTHONPATH"] = os.environ["FLARE_BENCH_RANKS_PYTHONPATH"]
            launcher = [str(BIN / "opentelemetry-instrument")]
        else:
            env, launcher = plain_environment(), []
        subprocess.run([*launcher, str(BIN / "torchrun"),
                        "--nproc_per_node", "4", wrapper, out,
                        str(SCRIPT), *train_args],
                       env=env, cwd=REPO, stdout=subprocess.DEVNULL, check=True)
        return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{out}/{prefix}*.json"))]


def drive(train_args: list[str]) -> None:
    """Run the 4-rank job under `flare run`'s rank environment and print the ranks' mean
    CPU per rank-step of each thread, and the instrumentation's threads together."""
    ranks = run_ranks(__file__, "rank-thread-cpu", "threads", train_args)
    if not ranks:
        raise SystemExit("rank_thread_cpu: no rank wrote its figures (fewer than 100 steps?)")
    names = sorted({name for rank in ranks for name in rank})
    mean = {name: round(sum(r.get(name, 0.0) for r in ranks) / len(ranks), 1) for name in names}
    for name in names:
        print(f"{name:36s} {mean[name]:10.1f} us/rank-step")
    print(f"{'instrumentation threads together':36s} {instrumentation_us(mean):10.1f} "
          "us/rank-step")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2:])
    else:
        main()
