"""In-situ cost of Flare's per-step training-thread hooks.

It times, with the training thread's CPU clock (`thread_time_ns`), the optimizer
post-hook that closes each step (Flare's step boundary), the optimizer pre-hook, and
Flare's backward and batch-fetch wrappers minus the backward and the fetch themselves,
inside the real 4-rank job (cold caches, four ranks on the
cores), and prints per hook the ranks' median, mean, 90th percentile and max in µs.
The mean is what the training thread pays per step: it includes the detail steps
(every FLARE_DETAIL_EVERY-th, which build and hand over the step spans waiting for the
finisher) and the steps that find the caches colder still; the median is the usual
step's cost. The first 20 steps are left out (warm-up). The DDP gradient hook Flare
keeps on each DDP wrapper's first parameter runs inside the backward (so outside the
wrapper's figure): its two calls are timed on their own.

The timers cost something too: a timed region, a frame around each hook, the timed
original the wrappers call. `--drive` therefore also runs the same job with every hook
replaced by nothing (`FLARE_PROBE_FLOOR=1`: the optimizer hooks by nothing, the
wrappers by the timed original itself) and prints that floor and the difference, which
is what Flare adds; the gradient hook's floor is taken as two optimizer-hook floors
(two timed regions).

    .venv/bin/python benchmarks/hook_cost_in_situ.py --drive --steps 300 \\
        --hidden 1024 --batch-size 128

(arguments after `--drive` go to examples/train_ddp.py, which runs under exactly the
environment `flare run` gives its ranks, exporting to a loopback OTLP/HTTP sink;
`FLARE_BENCH_RANKS_PYTHONPATH`, as in rank_thread_cpu.py, measures another tree's
instrumentation side by side). As a
wrapper, by hand:

    ... opentelemetry-instrument torchrun --nproc_per_node 4 \\
        benchmarks/hook_cost_in_situ.py OUT_DIR examples/train_ddp.py --steps 400
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import statistics
import sys
import time

WARM_UP = 20
HOOKS = ("step boundary", "optimizer pre-hook", "backward wrapper", "DDP gradient hook",
         "batch wrapper")


def main() -> None:
    import torch
    from torch.optim import optimizer as torch_optimizer

    out_dir, script = sys.argv[1], sys.argv[2]
    clock = time.thread_time_ns
    samples: dict[str, list[int]] = {name: [] for name in HOOKS}

    # Flare's backward wrapper (installed at startup) is rebuilt around a timed original,
    # from the same StepHooks instance, and timed as a whole.
    flare_backward = torch.autograd.backward
    cells = dict(zip(flare_backward.__code__.co_freevars, flare_backward.__closure__,
                     strict=True))
    step_hooks, original = cells["hooks"].cell_contents, flare_backward.__wrapped__
    inner = [0]

    def timed_original(*a, **k):
        start = clock()
        try:
            return original(*a, **k)
        finally:
            inner[0] = clock() - start

    floor = os.environ.get("FLARE_PROBE_FLOOR") == "1"  # the timers' own cost (see drive)
    rebuilt = timed_original if floor else step_hooks._make_backward(timed_original)

    def timed_backward(*a, **k):
        start = clock()
        try:
            return rebuilt(*a, **k)
        finally:
            samples["backward wrapper"].append(clock() - start - inner[0])

    torch.autograd.backward = timed_backward
    # The DDP gradient hook (GraphDoneMarker) runs inside the backward, so the wrapper's
    # figure above leaves it out: its two calls (the gradient hook, the final callback
    # it queues) are timed here and added up per backward. The class attributes are
    # replaced before the script builds its DDP wrapper, which binds them. The timer's
    # own frame is in this figure (~2-4 µs cold; without it: a cold micro-benchmark
    # gives ~10 µs added to a small backward).
    from flare.instrumentation.ddp_gradients import GraphDoneMarker

    marker_ns = [0]
    on_gradient, mark = GraphDoneMarker._on_gradient, GraphDoneMarker._mark

    def timed_on_gradient(self, param):
        start = clock()
        try:
            return on_gradient(self, param)
        finally:
            marker_ns[0] += clock() - start

    def timed_mark(self):
        start = clock()
        try:
            return mark(self)
        finally:
            marker_ns[0] += clock() - start
            samples["DDP gradient hook"].append(marker_ns[0])
            marker_ns[0] = 0

    GraphDoneMarker._on_gradient, GraphDoneMarker._mark = timed_on_gradient, timed_mark
    # The batch fetch: Flare's wrapper of the base DataLoader iterator's __next__,
    # rebuilt the same way from a DataLoaderHook on the same runtime.
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from flare.instrumentation.dataloader_hook import DataLoaderHook

    flare_next = _BaseDataLoaderIter.__next__
    original_next = flare_next.__wrapped__
    next_cells = dict(zip(flare_next.__code__.co_freevars, flare_next.__closure__,
                          strict=True))
    inner_next = [0]

    def timed_original_next(iterator):
        start = clock()
        try:
            return original_next(iterator)
        finally:
            inner_next[0] = clock() - start

    rebuilt_next = (timed_original_next if floor else DataLoaderHook(
        next_cells["runtime"].cell_contents)._wrap(timed_original_next))

    def timed_next(iterator):
        start = clock()
        try:
            return rebuilt_next(iterator)
        finally:
            samples["batch wrapper"].append(clock() - start - inner_next[0])

    _BaseDataLoaderIter.__next__ = timed_next

    # Flare's optimizer hooks, registered at startup
    for registry, name in ((torch_optimizer._global_optimizer_post_hooks, "step boundary"),
                           (torch_optimizer._global_optimizer_pre_hooks, "optimizer pre-hook")):
        for key, hook in list(registry.items()):
            if floor:  # the timed region with no hook in it
                hook = None

            def timed_hook(*a, _hook=hook, _samples=samples[name], **k):
                start = clock()
                try:
                    return _hook(*a, **k) if _hook is not None else None
                finally:
                    _samples.append(clock() - start)
            registry[key] = timed_hook

    def dump():
        figures = {}
        for name, values in samples.items():
            values = sorted(values[WARM_UP:])
            if values:
                figures[name] = {
                    "median": statistics.median(values) / 1e3,
                    "mean": statistics.fmean(values) / 1e3,
                    "p90": values[int(0.9 * (len(values) - 1))] / 1e3,
                    "max": values[-1] / 1e3,
                }
        with open(os.path.join(out_dir, f"hooks{os.environ.get('RANK', '0')}.json"),
                  "w") as handle:
            json.dump(figures, handle)

    atexit.register(dump)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


def _means(ranks: list[dict]) -> dict[str, dict[str, float]]:
    rows = {}
    for name in HOOKS:
        present = [rank[name] for rank in ranks if name in rank]
        if present:
            rows[name] = {k: sum(p[k] for p in present) / len(present)
                          for k in ("median", "mean", "p90", "max")}
    return rows


def measure(train_args: list[str]) -> tuple[dict, dict]:
    """Run the 4-rank job under `flare run`'s rank environment, once with the timers
    alone (the floor) and once with Flare's hooks; returns each hook's figures (the mean
    over the ranks, µs) in both runs: (hooked, floor)."""
    from rank_thread_cpu import run_ranks  # a sibling script: its directory is on sys.path

    os.environ["FLARE_PROBE_FLOOR"] = "1"
    try:
        floor = _means(run_ranks(__file__, "hook-cost", "hooks", train_args))
    finally:
        os.environ.pop("FLARE_PROBE_FLOOR")
    ranks = run_ranks(__file__, "hook-cost", "hooks", train_args)
    if not ranks or not floor:
        raise SystemExit(f"hook_cost_in_situ: no rank wrote its figures (fewer than "
                         f"{WARM_UP + 1} steps?)")
    if "optimizer pre-hook" in floor:  # two timed regions, each like an optimizer hook's
        floor["DDP gradient hook"] = {k: 2 * v for k, v in floor["optimizer pre-hook"].items()}
    return _means(ranks), floor


def added_per_step(hooked: dict, floor: dict) -> float:
    """µs of training-thread CPU Flare's hooks add per step: the means minus the floor."""
    return sum(row["mean"] - floor.get(name, {"mean": 0.0})["mean"]
               for name, row in hooked.items())


def drive(train_args: list[str]) -> None:
    """Print each hook's figures, the floor, and what Flare adds (the difference)."""
    hooked, floor = measure(train_args)
    print(f"{'us of training-thread CPU':24s} {'median':>8s} {'mean':>8s} {'p90':>8s} {'max':>9s}"
          f"   {'floor med':>9s} {'mean':>6s}   {'added med':>9s} {'mean':>6s}   (mean of the ranks)")
    for name, row in hooked.items():
        low = floor.get(name, {"median": 0.0, "mean": 0.0})
        print(f"{name:24s} {row['median']:8.1f} {row['mean']:8.1f} {row['p90']:8.1f} "
              f"{row['max']:9.1f}   {low['median']:9.1f} {low['mean']:6.1f}   "
              f"{row['median'] - low['median']:9.1f} {row['mean'] - low['mean']:6.1f}")
    print(f"{'added per step (means)':24s} {added_per_step(hooked, floor):8.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2:])
    else:
        main()
