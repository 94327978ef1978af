"""The GPU checks' training job: DDP on CUDA, bf16 GEMMs, one rank made slow on purpose.

    torchrun --nproc_per_node 2 tests/gpu/train_gpu.py --steps 300 --slow-rank 1

Flare-unaware, like examples/train_ddp.py. Backend NCCL when every rank has a GPU of its
own; with fewer GPUs than ranks it falls back to gloo on CUDA tensors, because NCCL
refuses two ranks on one GPU ("Duplicate GPU detected", NVIDIA/nccl#418). The slow rank
runs `--extra-gemms` more bf16 matrix products per step from `--slow-from` on, so the
others wait for it in the gradient all-reduce.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-from", type=int, default=60)
    parser.add_argument("--extra-gemms", type=int, default=24)
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--parallel", choices=("ddp", "fsdp2", "fsdp2_tp"), default="ddp",
                        help="fsdp2: fully_shard per layer; fsdp2_tp: a (world/2 x 2) "
                             "DeviceMesh, layer pairs column/row tensor-parallel, then FSDP2 "
                             "(both need NCCL: one GPU per rank)")
    return parser.parse_args()


def _sharded(model: nn.Sequential, parallel: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if parallel == "fsdp2":
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if world % 2:
            raise SystemExit("--parallel fsdp2_tp needs an even number of ranks")
        full = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                for i in range(len(model) - len(model) % 2)}
        parallelize_module(model, full["tp"], plan)
        mesh = full["dp"]
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if gpus >= min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))) else "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    if args.parallel == "ddp":
        model = DistributedDataParallel(model, device_ids=[device.index] if backend == "nccl" else None)
    else:
        model = _sharded(model, args.parallel, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.dim, device=device, dtype=torch.bfloat16)
    extra = torch.randn(args.dim, args.dim, device=device, dtype=torch.bfloat16)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        if rank == args.slow_rank and step >= args.slow_from:
            y = x
            for _ in range(args.extra_gemms):
                y = y @ extra  # the injected slowdown: pure GEMM work on one rank
            loss = loss + 0.0 * y.float().mean()
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()  # a real loop syncs on .item() for logging
    if rank == 0:
        print(f"train_gpu: {args.steps} steps, {args.parallel}, backend {backend}, world {world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
