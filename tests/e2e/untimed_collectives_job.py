"""A data-parallel loop whose gradient all-reduce goes to the ProcessGroup object itself
(`pg.allreduce`), as a C++ extension or a custom communication library would: past
torch.distributed's Python API, so no wrapper of Flare sees the call or its wait.

    torchrun --nproc_per_node 4 tests/e2e/untimed_collectives_job.py --slow-rank 2

From --fault-from on, --slow-rank computes --slow-ms more per step.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=60.0)
    parser.add_argument("--fault-from", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = distributed_c10d._get_default_group()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        loss = model(torch.randn(32, 64, generator=generator)).pow(2).mean()
        if rank == args.slow_rank and step >= args.fault_from:
            end = time.perf_counter() + args.slow_ms / 1000.0
            while time.perf_counter() < end:
                pass
        optimizer.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        pg.allreduce([flat]).wait()  # the "extension's" collective
        flat /= world
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
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
