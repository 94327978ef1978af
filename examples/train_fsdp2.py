"""A small FSDP2 training job (`fully_shard` per layer, gloo, CPU) with a slow rank.

    torchrun --nproc_per_node 4 examples/train_fsdp2.py --steps 60 --slow-rank 2 --slow-ms 80

Every layer is sharded over the ranks: each forward all-gathers its parameters, each
backward reduce-scatters its gradients, so every rank blocks in FSDP2's collectives
for the slowest one. From step --fault-from on, rank --slow-rank computes --slow-ms
more per step (a busy loop before the forward, as a slower GPU or a throttled CPU).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--slow-rank", type=int, default=-1, help="-1: a healthy run")
    parser.add_argument("--slow-ms", type=float, default=80.0)
    parser.add_argument("--fault-from", type=int, default=20)
    return parser.parse_args(argv)


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.ReLU())
                            for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        batch = torch.randn(args.batch_size, args.hidden, generator=generator)
        if rank == args.slow_rank and step >= args.fault_from:
            burn(args.slow_ms / 1000.0)
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
