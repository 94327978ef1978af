"""A Hugging Face `Trainer` job (a tiny GPT-2 built from a config, CPU, gloo) with
injectable faults.

It knows nothing of Flare: the Trainer owns the loop (gradient accumulation, evaluation,
checkpoints, logging callbacks), as in the jobs people run, e.g.

    torchrun --nproc_per_node 4 examples/train_hf.py --steps 60
    accelerate launch --num_processes 4 --cpu examples/train_hf.py --fault compute --fault-rank 2

A step is an optimizer step: with --accumulation 4 it is four forward/backward passes.
Faults (on the ranks of --fault-rank from optimizer step --fault-from on, costing about
--fault-ms per faulty step):
  compute   the model's forward does extra matmuls (`burn_compute`), split over the
            step's micro-batches
  input     the data collator sleeps (`SlowCollator.__call__`)

and, beside them, --slow-save-ms: every checkpoint write (each --save-every steps) goes
to a slow shared disk and takes that much longer — the model's `save_pretrained`, then
`slow_storage` sleeps; the Trainer writes the model from rank 0 only, so rank 0 saves
while the others wait.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

FAULTS = ("none", "compute", "input")
VOCAB = 256
SEQUENCE = 32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=4, help="per device and micro-batch")
    parser.add_argument("--eval-every", type=int, default=20, help="0: no evaluation")
    parser.add_argument("--save-every", type=int, default=50, help="0: no checkpoints")
    parser.add_argument("--output", default=None, help="checkpoints (default: a temporary folder)")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-from", type=int, default=20, help="first faulty optimizer step")
    parser.add_argument("--fault-ms", type=float, default=40.0)
    parser.add_argument("--slow-save-ms", type=float, default=0.0,
                        help="extra time of every checkpoint write (a slow shared disk)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class Clock(TrainerCallback):
    """The optimizer step the Trainer is in (its `global_step` counts completed ones)."""

    def __init__(self):
        self.step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


class Fault:
    def __init__(self, args: argparse.Namespace, rank: int, clock: Clock):
        self.kind, self.clock = args.fault, clock
        self.on_this_rank = args.fault != "none" and rank == args.fault_rank
        self.first = args.fault_from
        self.seconds = args.fault_ms / 1e3

    def active(self, kind: str) -> bool:
        return self.on_this_rank and self.kind == kind and self.clock.step >= self.first


def burn_compute(seconds: float) -> None:
    """Real matrix work for about `seconds` of wall time."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


class SlowableGPT2(GPT2LMHeadModel):
    fault: Fault | None = None
    micro_batches = 1

    def forward(self, *args, **kwargs):
        if self.fault is not None and self.fault.active("compute"):
            burn_compute(self.fault.seconds / self.micro_batches)
        return super().forward(*args, **kwargs)

    slow_save_s = 0.0

    def save_pretrained(self, *args, **kwargs):
        super().save_pretrained(*args, **kwargs)
        if self.slow_save_s:
            slow_storage(self.slow_save_s)


class Tokens(Dataset):
    """Random token sequences, the same on every run (a causal LM's own labels)."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (size, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index]}


class SlowCollator:
    def __init__(self, fault: Fault, micro_batches: int):
        self.fault, self.micro_batches = fault, micro_batches

    def __call__(self, items: list[dict]) -> dict:
        if self.fault.active("input"):
            time.sleep(self.fault.seconds / self.micro_batches)
        ids = torch.stack([item["input_ids"] for item in items])
        return {"input_ids": ids, "labels": ids.clone()}


def slow_storage(seconds: float) -> None:
    """The rest of a checkpoint's write on a slow shared disk."""
    time.sleep(seconds)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    clock = Clock()
    fault = Fault(args, rank, clock)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=2)
    model = SlowableGPT2(config)
    model.fault, model.micro_batches = fault, args.accumulation
    model.slow_save_s = args.slow_save_ms / 1e3
    per_step = args.batch_size * args.accumulation * world
    output = args.output or tempfile.mkdtemp(prefix="train_hf-")
    training = TrainingArguments(
        output_dir=output, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
        learning_rate=1e-3, use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        report_to="none", logging_steps=10, disable_tqdm=True, seed=args.seed,
        eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or None,
        save_only_model=True, dataloader_num_workers=0,
        # the forward takes **kwargs (the fault wrapper): keep the batch as it is
        remove_unused_columns=False)
    trainer = Trainer(model=model, args=training,
                      train_dataset=Tokens(per_step * args.steps, args.seed),
                      eval_dataset=Tokens(8 * args.batch_size * world, args.seed + 1),
                      data_collator=SlowCollator(fault, args.accumulation),
                      callbacks=[clock])
    started = time.perf_counter()
    trainer.train()
    if rank == 0:
        elapsed = time.perf_counter() - started
        print(f"done: {args.steps} steps in {elapsed:.2f} s "
              f"({1000 * elapsed / max(args.steps, 1):.1f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
