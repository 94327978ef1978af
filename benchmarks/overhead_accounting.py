"""What Flare adds to each rank-step, counted piece by piece in the running job (#2).

The step-time ratio of `instrumentation_overhead.py` is the difference of two large,
noisy figures: on a shared two-core host the same job's step time and even its CPU time
per step move by several per cent from one minute to the next, far more than the 0.5 %
to be resolved. This benchmark measures the small thing itself, in the real 4-rank job
under exactly `flare run`'s rank environment (examples/train_ddp.py, loopback OTLP/HTTP):

- the training-thread CPU each of Flare's hooks adds per step (step boundary, optimizer
  pre-hook, backward and batch wrappers, DDP gradient hook), as timed in place minus the
  timers' own floor (`hook_cost_in_situ.py`: two runs);
- the CPU of Flare's and the SDK's threads per rank-step (finisher, watchdog, metric
  reader, batch processor; `rank_thread_cpu.py`: one run), and the CPU spent in garbage
  collections per step, against a plain run of the same job without Flare (a third
  run, which also gives that plain job's CPU per rank-step for comparison);

and prints their sum against the instrumented job's own CPU per rank-step (its training
thread less the hooks, and gloo's threads): the overhead ratio these pieces make. Not
counted: what Flare's code and data evict from the caches the training's own work uses,
and the training thread's waits for the GIL while a Flare thread holds it (both are in
the wall-time ratio, within its noise).

    .venv/bin/python benchmarks/overhead_accounting.py --steps 300 \\
        --hidden 1024 --batch-size 128

(arguments go to examples/train_ddp.py; at least 130 steps: the thread figures start at
the 100th step). A training framework's job instead, e.g. the Hugging Face Trainer's
or Lightning's (under torchrun; arguments go to that script):

    .venv/bin/python benchmarks/overhead_accounting.py --script examples/train_hf.py \
        --steps 200 --eval-every 20 --save-every 50
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import rank_thread_cpu  # sibling scripts (this folder is on sys.path)
from hook_cost_in_situ import added_per_step, measure
from rank_thread_cpu import GC, JOB_THREADS, instrumentation_us, run_ranks


def _mean_per_thread(ranks: list[dict]) -> dict[str, float]:
    if not ranks:
        raise SystemExit("overhead_accounting: no rank wrote its thread figures "
                         "(fewer than 100 steps?)")
    names = {name for rank in ranks for name in rank}
    return {name: statistics.fmean(rank.get(name, 0.0) for rank in ranks) for name in names}


def main(train_args: list[str]) -> None:
    hooked, floor = measure(train_args)
    hooks_us = added_per_step(hooked, floor)
    wrapper = rank_thread_cpu.__file__
    instrumented = _mean_per_thread(run_ranks(wrapper, "accounting", "threads", train_args))
    plain = _mean_per_thread(run_ranks(wrapper, "accounting", "threads", train_args,
                                       instrumented=False))
    threads_us = instrumentation_us(instrumented)
    gc_us = instrumented.get(GC, 0.0) - plain.get(GC, 0.0)
    job_us = sum(instrumented.get(name, 0.0) for name in JOB_THREADS) - hooks_us
    plain_job_us = sum(plain.get(name, 0.0) for name in JOB_THREADS)
    flare_us = hooks_us + threads_us + max(gc_us, 0.0)

    print("per rank-step, µs of CPU (mean of the 4 ranks):")
    for name, row in hooked.items():
        added = row["mean"] - floor.get(name, {"mean": 0.0})["mean"]
        print(f"  hook: {name:34s} {added:9.1f}")
    for name in sorted(instrumented):
        if name not in (*JOB_THREADS, GC) and instrumented[name]:
            print(f"  thread: {name:32s} {instrumented[name]:9.1f}")
    print(f"  garbage collection, instrumented − plain {gc_us:+9.2f}  "
          f"({instrumented.get(GC, 0.0):.2f} against {plain.get(GC, 0.0):.2f})")
    print(f"  Flare in all                             {flare_us:9.1f}")
    print(f"the job's own CPU per rank-step: {job_us / 1e3:.2f} ms in the instrumented run "
          f"(training thread less the hooks, gloo's threads); {plain_job_us / 1e3:.2f} ms "
          "in the plain run (another minute of this host)")
    print(f"overhead ratio these pieces make: {1 + flare_us / job_us:.4f} "
          f"(Flare's {flare_us:.0f} µs over the job's {job_us / 1e3:.2f} ms; target <= 1.005)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--script"]:
        if len(args) < 2 or not Path(args[1]).is_file():
            raise SystemExit(f"overhead_accounting: --script needs a training script, got {args[1:2]}")
        rank_thread_cpu.SCRIPT, args = Path(args[1]).resolve(), args[2:]
    main(args)
