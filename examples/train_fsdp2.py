"""A small FSDP2 training job (`fully_shard` per layer, gloo, CPU) with a slow rank;
with `--tp 2`, FSDP2 + tensor parallel on a 2-D DeviceMesh (dp × tp).

    torchrun --nproc_per_node 4 examples/train_fsdp2.py --steps 60 --slow-rank 2 --slow-ms 80
    torchrun --nproc_per_node 4 examples/train_fsdp2.py --tp 2 --slow-rank 2

With --tp, each block is an MLP whose up projection is column-parallel and down
projection row-parallel over the mesh's "tp" dimension (DTensor: the row-parallel
output is all-reduced with functional collectives), then sharded with FSDP2 over "dp".
Ranks r and r+1 (r even) form a TP group; ranks r and r+2 a DP group.

Every layer is sharded over the ranks: each forward all-gathers its parameters, each
backward reduce-scatters its gradients, so every rank blocks in FSDP2's collectives
for the slowest one. From step --fault-from on, rank --slow-rank computes --slow-ms
more per step (a busy loop before the forward, as a slower GPU or a throttled CPU).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from train_ddp import write_checksum


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1: FSDP2 only)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--slow-rank", type=int, default=-1, help="-1: a healthy run")
    parser.add_argument("--slow-ms", type=float, default=80.0)
    parser.add_argument("--fault-from", type=int, default=20)
    parser.add_argument("--checksum", metavar="DIR",
                        help="each rank writes a digest of its final parameters (its shard) to DIR/rank<R>.sha256")
    return parser.parse_args(argv)


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _tensor_parallel(args: argparse.Namespace, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(*[Mlp(args.hidden) for _ in range(args.layers)])
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    return model, mesh


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if args.tp > 1:
        model, mesh = _tensor_parallel(args, dist.get_world_size())
        fully_shard(model, mesh=mesh["dp"])
    else:
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
