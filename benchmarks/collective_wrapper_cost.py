"""What Flare's collective wait paths add per call, and per step of the FSDP2 example.

FSDP2, tensor parallel and pipeline schedules issue their collectives from Python, so
each call goes through Flare's wrappers: `torch.distributed.*` (the call, its
`Work.wait()`), and the functional collectives DTensor uses (the issue and
`wait_tensor`). Timed here with the calling thread's CPU clock in one process (a
world-size-1 gloo group, where a collective itself costs a few µs, so the wrapper is
what moves), side by side: blocks of N calls through the wrapper and N through the
original it wraps (`__wrapped__`), alternated, per path:

- `dist.all_reduce` (blocking), `dist.all_reduce(async_op=True)` + `Work.wait()`,
  `dist.all_gather_single` and `dist.reduce_scatter_single`, async + `Work.wait()`,
  as FSDP2 issues them (torch >= 2.11);
- functional `all_reduce` + `wait_tensor` (DTensor's row-parallel output).

It prints per path the median over blocks of the µs per call with and without Flare,
the difference, and that difference times the collectives per step of the FSDP2
example (`--per-step`, default 13: 4 layers' forward and backward all-gathers and
reduce-scatters plus the root's, as `flare.step.pg.counts` reports them), against the
example's own CPU per rank-step when `--step-ms` is given.

    .venv/bin/python benchmarks/collective_wrapper_cost.py --blocks 40 --calls 200
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--per-step", type=int, default=13,
                        help="collectives per step to scale the per-call cost by")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="the job's own CPU per rank-step, for the ratio")
    args = parser.parse_args()

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "FLARE_JOB_ID": "wrapper-cost", "FLARE_HEARTBEAT_S": "0"})
    import logging

    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from torch.distributed import _functional_collectives as funcol

    from flare.instrumentation.torch_training import TorchTrainingInstrumentor

    torch.set_num_threads(1)
    # The plain arm calls the originals, which Flare rightly reports as collectives it
    # could not time: not news here.
    logging.getLogger("flare.instrumentation.collectives").setLevel(logging.ERROR)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    group = dist.group.WORLD
    small = torch.ones(16)
    gathered = torch.empty(16)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def paths(flare: bool) -> dict:
        def pick(fn):
            return fn if flare else getattr(fn, "__wrapped__", fn)

        all_reduce = pick(dist.all_reduce)
        gather = pick(getattr(dist, "all_gather_single", dist.all_gather_into_tensor))
        scatter = pick(getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor))
        wait = pick(dist.Work.wait)
        f_all_reduce, f_wait = pick(funcol.all_reduce), pick(funcol.wait_tensor)

        def asynchronous():
            wait(all_reduce(small, async_op=True))

        def functional():
            f_wait(f_all_reduce(small, "sum", group))

        def fsdp_gather():
            wait(gather(gathered, small, group=group, async_op=True))

        def fsdp_scatter():
            wait(scatter(gathered, small, group=group, async_op=True))

        return {"all_reduce": lambda: all_reduce(small),
                "all_reduce async + Work.wait": asynchronous,
                "FSDP2 all-gather + Work.wait": fsdp_gather,
                "FSDP2 reduce-scatter + Work.wait": fsdp_scatter,
                "functional all_reduce + wait_tensor": functional}

    arms = {True: paths(True), False: paths(False)}
    samples = {(name, flare): [] for name in arms[True] for flare in (True, False)}
    clock = time.thread_time_ns
    for block in range(args.blocks + 2):  # the first two warm up
        for flare in ((True, False) if block % 2 else (False, True)):
            for name, call in arms[flare].items():
                start = clock()
                for _ in range(args.calls):
                    call()
                per_call = (clock() - start) / args.calls / 1e3
                if block >= 2:
                    samples[(name, flare)].append(per_call)
        model(torch.ones(1, 2)).sum().backward()  # a step boundary now and then: the
        optimizer.step()  # step's totals and its span are built as in a job
    dist.destroy_process_group()
    instrumentor.uninstrument()

    print(f"{'path':<38} {'plain µs':>9} {'flare µs':>9} {'added µs':>9} "
          f"{'x' + str(args.per_step) + '/step µs':>14}")
    added_total = 0.0
    for name in arms[True]:
        plain = statistics.median(samples[(name, False)])
        flare = statistics.median(samples[(name, True)])
        added = flare - plain
        if name.startswith("FSDP2"):
            added_total = max(added_total, added)
        print(f"{name:<38} {plain:>9.2f} {flare:>9.2f} {added:>9.2f} {added * args.per_step:>14.1f}")
    per_step = added_total * args.per_step
    line = (f"FSDP2 example: {args.per_step} collectives/step x {added_total:.2f} µs (the "
            f"costlier FSDP2 path) = "
            f"{per_step:.1f} µs per rank-step")
    if args.step_ms:
        line += f" against {args.step_ms:.1f} ms: ratio {1 + per_step / (args.step_ms * 1e3):.4f}"
    print(line)


if __name__ == "__main__":
    main()
