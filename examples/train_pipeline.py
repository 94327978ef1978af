"""A small 2-stage pipeline-parallel training job (gloo, CPU) with an injectable slow stage.

Like train_ddp.py it knows nothing of Flare, e.g.

    torchrun --nproc_per_node 4 examples/train_pipeline.py --steps 200
    torchrun --nproc_per_node 4 examples/train_pipeline.py --slow-stage 1 --slow-ms 10 --fault-from 40

Layout: the world is 2 pipeline stages x D data-parallel replicas (world size 2*D; 4
ranks: D = 2), rank = stage * D + replica. So stage 0 is ranks 0..D-1 and stage 1 is ranks
D..2D-1; replica d's pipeline runs from rank d (stage 0) to rank D + d (stage 1). With 4
ranks: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3; pipelines 0 -> 2 and 1 -> 3.

Each step is a GPipe schedule over --micro-batches micro-batches, with hand-written
point-to-point messages (torch.distributed isend/recv):
  stage 0  forward of every micro-batch, each activation sent to stage 1; then, micro-batch
           by micro-batch, the activation's gradient received from stage 1 and backward
  stage 1  per micro-batch: the activation received, forward, loss, backward, the
           activation's gradient sent back to stage 0
then each stage all-reduces its gradients over its data-parallel group (the stage's D
replicas, a dist.new_group) and steps its optimizer.

With --schedule gpipe|1f1b the same stages run under torch.distributed.pipelining
(`PipelineStage` per rank on its replica's pipeline group, `ScheduleGPipe` or
`Schedule1F1B`): the schedule moves activations and gradients with
`batch_isend_irecv` and waits the returned works itself.

Fault: --slow-stage S --slow-ms M --fault-from F: from step F on, every rank of stage S
does about M ms more compute (real matrix work) per micro-batch, as a stage on a slower
node or a badly balanced split of the layers would.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from train_ddp import CLASSES, FEATURES, burn_compute, write_checksum

STAGES = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--schedule", choices=("manual", "gpipe", "1f1b"), default="manual",
                        help="manual: the hand-written GPipe below; gpipe / 1f1b: "
                             "torch.distributed.pipelining's schedules")
    parser.add_argument("--slow-stage", type=int, default=-1, choices=(-1, *range(STAGES)),
                        help="the stage whose every rank is slowed (-1: none)")
    parser.add_argument("--slow-ms", type=float, default=10.0,
                        help="added compute per micro-batch on the slow stage, in milliseconds")
    parser.add_argument("--fault-from", type=int, default=40,
                        help="first step (0-based) at which the slow stage is slow")
    parser.add_argument("--checksum", metavar="DIR",
                        help="each rank writes a digest of its final parameters (its shard) to DIR/rank<R>.sha256")
    return parser.parse_args(argv)


def build_stage(stage: int, hidden: int) -> nn.Module:
    if stage == 0:
        return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU())
    return nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


def micro_batch(seed: int, replica: int, step: int, index: int, size: int):
    """Deterministic samples: both stages of a replica draw the same micro-batch (stage 0
    uses its features, stage 1 its labels)."""
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + replica) * 100_003 + step) * 101 + index)
    features = torch.randn(size, FEATURES, generator=generator)
    labels = torch.randint(CLASSES, (size,), generator=generator)
    return features, labels


def first_stage_step(model, args, step: int, replica: int, peer: int, slow: bool) -> None:
    activations, sends = [], []
    for index in range(args.micro_batches):
        features, _ = micro_batch(args.seed, replica, step, index, args.micro_batch_size)
        activation = model(features)
        if slow:
            burn_compute(args.slow_ms / 1000.0)
        activations.append(activation)
        sends.append(dist.isend(activation.detach(), dst=peer))
    for activation in activations:
        gradient = torch.empty_like(activation)
        dist.recv(gradient, src=peer)
        activation.backward(gradient)
    for work in sends:
        work.wait()


def last_stage_step(model, loss_fn, args, step: int, replica: int, peer: int,
                    slow: bool) -> float:
    sends, total = [], 0.0
    for index in range(args.micro_batches):
        _, labels = micro_batch(args.seed, replica, step, index, args.micro_batch_size)
        received = torch.empty(args.micro_batch_size, args.hidden)
        dist.recv(received, src=peer)
        received.requires_grad_()
        loss = loss_fn(model(received), labels) / args.micro_batches
        if slow:
            burn_compute(args.slow_ms / 1000.0)
        loss.backward()
        total += loss.item()
        sends.append(dist.isend(received.grad, dst=peer))
    for work in sends:
        work.wait()
    return total


class SlowStage(nn.Module):
    """The stage's layers, plus --slow-ms of compute per micro-batch forward while
    `slow` is set (the pipelining schedules call the module once per micro-batch)."""

    def __init__(self, layers: nn.Module, slow_ms: float) -> None:
        super().__init__()
        self.layers = layers
        self.slow_ms = slow_ms
        self.slow = False

    def forward(self, x):
        if self.slow:
            burn_compute(self.slow_ms / 1000.0)
        return self.layers(x)


def scheduled_pipeline(args, model: nn.Module, stage: int, replica: int, replicas: int,
                       loss_fn):
    """A torch.distributed.pipelining schedule over this replica's two ranks."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    # every rank takes part in creating every group, in the same order
    pipes = [dist.new_group([r, replicas + r], group_desc=f"pipeline{r}") for r in range(replicas)]
    pipe_stage = PipelineStage(model, stage, STAGES, torch.device("cpu"), group=pipes[replica])
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    return schedule(pipe_stage, n_microbatches=args.micro_batches,
                    loss_fn=lambda output, target: loss_fn(output, target) / args.micro_batches)


def scheduled_step(schedule, args, step: int, stage: int, replica: int) -> float | None:
    batches = [micro_batch(args.seed, replica, step, index, args.micro_batch_size)
               for index in range(args.micro_batches)]
    if stage == 0:
        schedule.step(torch.cat([features for features, _ in batches]))
        return None
    losses: list = []
    schedule.step(target=torch.cat([labels for _, labels in batches]), losses=losses)
    return float(sum(loss.item() for loss in losses))


def all_reduce_gradients(model: nn.Module, group, replicas: int) -> None:
    if replicas < 2:
        return
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size % STAGES:
        raise SystemExit(f"train_pipeline.py needs a multiple of {STAGES} ranks, not {world_size}")
    replicas = world_size // STAGES
    stage, replica = divmod(rank, replicas)
    # every rank takes part in creating every group, in the same order
    dp_groups = [dist.new_group(list(range(s * replicas, (s + 1) * replicas)), group_desc=f"stage{s}")
                 for s in range(STAGES)]
    peer = rank + replicas if stage == 0 else rank - replicas

    torch.manual_seed(args.seed * STAGES + stage)  # the replicas of a stage start equal
    model = SlowStage(build_stage(stage, args.hidden), args.slow_ms)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    schedule = (scheduled_pipeline(args, model, stage, replica, replicas, loss_fn)
                if args.schedule != "manual" else None)

    started = time.perf_counter()
    for step in range(args.steps):
        slow = stage == args.slow_stage and step >= args.fault_from
        optimizer.zero_grad(set_to_none=True)
        loss = None
        if schedule is not None:
            model.slow = slow
            loss = scheduled_step(schedule, args, step, stage, replica)
        elif stage == 0:
            first_stage_step(model.layers, args, step, replica, peer, slow)
        else:
            loss = last_stage_step(model.layers, loss_fn, args, step, replica, peer, slow)
        if loss is not None and replica == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss:.4f}", flush=True)
        all_reduce_gradients(model, dp_groups[stage], replicas)
        optimizer.step()

    elapsed = time.perf_counter() - started
    if rank == 0:
        print(f"done: {args.steps} steps in {elapsed:.2f} s "
              f"({1000 * elapsed / max(args.steps, 1):.1f} ms/step)", flush=True)
    if args.checksum:
        write_checksum(model, rank, args.checksum)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    finally:
        # Done or failed, every file closed: end without the interpreter's last garbage
        # collection over the ~300,000 objects torch holds (about 1 s of CPU per rank at
        # exit; 3 s of a 4-rank job's wall on a 2-core host, and as much again where the
        # ranks of a failed job exit one after another). Exit hooks, Flare's among them,
        # and the traceback of a failure still run first.
        gc.freeze()
