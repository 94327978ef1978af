"""A DeepSpeed job (ZeRO stage 1, a tiny GPT-2 built from a config, CPU, gloo) with
injectable faults.

It knows nothing of Flare: DeepSpeed's engine owns the optimizer step (gradient
accumulation over --accumulation micro-batches, ZeRO's sharded optimizer state) and the
checkpoints (`engine.save_checkpoint`, every rank writing its shard), as in the
pre-training scripts people run, e.g.

    deepspeed --num_gpus 4 examples/train_deepspeed.py --steps 60       # DeepSpeed's launcher
    torchrun --nproc_per_node 4 examples/train_deepspeed.py --steps 60   # torchrun

On a host without GPUs the script asks DeepSpeed for its CPU accelerator
(DS_ACCELERATOR=cpu, which talks gloo). A step is an optimizer step. Faults (on
--fault-rank from optimizer step --fault-from on, about --fault-ms per faulty step):
  compute   the model's forward does extra matmuls (`burn_compute`), split over the
            step's micro-batches
  input     the batch collate function sleeps (`SlowCollate.__call__`)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

if not torch.cuda.is_available():  # (read when deepspeed is imported)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

FAULTS = ("none", "compute", "input")
VOCAB = 256
SEQUENCE = 32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=4, help="per rank and micro-batch")
    parser.add_argument("--eval-every", type=int, default=20, help="0: no evaluation")
    parser.add_argument("--save-every", type=int, default=50, help="0: no checkpoints")
    parser.add_argument("--output", default=None, help="checkpoints (default: a temporary folder)")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-from", type=int, default=20, help="first faulty optimizer step")
    parser.add_argument("--fault-ms", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=None,
                        help="(set by DeepSpeed's launcher; the environment's LOCAL_RANK is used)")
    return parser.parse_args(argv)


def burn_compute(seconds: float) -> None:
    """Real matrix work for about `seconds` of wall time."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


class Fault:
    """Whether the fault is on, asked of the engine (its global_steps counts completed
    optimizer steps)."""

    def __init__(self, args: argparse.Namespace, rank: int):
        self.kind = args.fault if rank == args.fault_rank else "none"
        self.first, self.seconds = args.fault_from, args.fault_ms / 1e3
        self.micro_batches = args.accumulation
        self.engine = None

    def active(self, kind: str) -> bool:
        return (self.kind == kind and self.engine is not None
                and self.engine.global_steps >= self.first)


class SlowableGPT2(GPT2LMHeadModel):
    fault: Fault | None = None

    def forward(self, *args, **kwargs):
        if self.fault is not None and self.fault.active("compute"):
            burn_compute(self.fault.seconds / self.fault.micro_batches)
        return super().forward(*args, **kwargs)


class Tokens(Dataset):
    """Random token sequences, the same on every run (a causal LM's own labels)."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (size, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[index]


class SlowCollate:
    def __init__(self, fault: Fault):
        self.fault = fault

    def __call__(self, items: list[torch.Tensor]) -> torch.Tensor:
        if self.fault.active("input"):
            time.sleep(self.fault.seconds / self.fault.micro_batches)
        return torch.stack(items)


def evaluate(engine, loader: DataLoader) -> float:
    """The mean loss over the evaluation batches, averaged over the ranks."""
    engine.eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for ids in loader:
            ids = ids.to(engine.device)
            total += torch.stack([engine(input_ids=ids, labels=ids).loss.detach().cpu(), torch.ones(())])
    total = total.to(engine.device)
    dist.all_reduce(total)
    engine.train()
    return float(total[0] / total[1])


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # gloo on DeepSpeed's CPU accelerator, NCCL on CUDA
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    fault = Fault(args, rank)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=2)
    model = SlowableGPT2(config)
    model.fault = fault
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.accumulation,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
    })
    fault.engine = engine
    train = Tokens(args.batch_size * args.accumulation * world * args.steps, args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, collate_fn=SlowCollate(fault),
                        sampler=DistributedSampler(train, world, rank, shuffle=False))
    held_out = Tokens(4 * args.batch_size * world, args.seed + 1)
    evaluation = DataLoader(held_out, batch_size=args.batch_size,
                            sampler=DistributedSampler(held_out, world, rank, shuffle=False))
    output = args.output or tempfile.mkdtemp(prefix="train_deepspeed-")
    started, step = time.perf_counter(), 0
    for ids in loader:
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # the optimizer steps at the end of each accumulation
        if engine.global_steps == step:
            continue
        step = engine.global_steps
        if args.eval_every and step % args.eval_every == 0:
            evaluate(engine, evaluation)
        if args.save_every and step % args.save_every == 0:
            engine.save_checkpoint(output, tag=f"step{step}")
        if step >= args.steps:
            break
    if rank == 0:
        elapsed = time.perf_counter() - started
        print(f"done: {engine.global_steps} steps in {elapsed:.2f} s "
              f"({1000 * elapsed / max(engine.global_steps, 1):.1f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
