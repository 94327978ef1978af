"""A PyTorch Lightning job (a small MLP, CPU, gloo, `strategy="ddp"`) with injectable
faults.

It knows nothing of Flare: Lightning owns the loop (gradient accumulation, validation,
checkpoints, logging) and, started as a plain script with --devices 4, launches the
other ranks itself, e.g.

    python examples/train_lightning.py --devices 4 --steps 60          # Lightning launches
    torchrun --nproc_per_node 4 examples/train_lightning.py --steps 60  # torchrun launches

--strategy picks how Lightning distributes the module: `ddp`; `fsdp2`, Lightning's
ModelParallelStrategy with the layers sharded by `fully_shard` in `configure_model`
(runs on CPU); `fsdp`, Lightning's FSDPStrategy (Lightning allows it on a GPU only:
add --accelerator gpu).

A step is an optimizer step: with --accumulation 4 it is four forward/backward passes.
Faults (on the ranks of --fault-rank from optimizer step --fault-from on, costing about
--fault-ms per faulty step):
  compute   the module's forward does extra matmuls (`burn_compute`), split over the
            step's micro-batches
  input     the batch collate function sleeps (`SlowCollate.__call__`)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

FAULTS = ("none", "compute", "input")
FEATURES, CLASSES = 256, 16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--devices", type=int, default=None,
                        help="ranks Lightning launches (default: WORLD_SIZE, else 1)")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=20, help="0: no validation")
    parser.add_argument("--save-every", type=int, default=50, help="0: no checkpoints")
    parser.add_argument("--output", default=None, help="checkpoints (default: a temporary folder)")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-from", type=int, default=20, help="first faulty optimizer step")
    parser.add_argument("--fault-ms", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2", "fsdp"), default="ddp")
    parser.add_argument("--accelerator", default="cpu")
    return parser.parse_args(argv)


def burn_compute(seconds: float) -> None:
    """Real matrix work for about `seconds` of wall time."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


class Fault:
    """Whether the fault is on, asked of the module's trainer (its global_step counts
    completed optimizer steps); the rank is known only once Lightning set it up."""

    def __init__(self, args: argparse.Namespace):
        self.kind, self.rank, self.first = args.fault, args.fault_rank, args.fault_from
        self.seconds = args.fault_ms / 1e3
        self.trainer: L.Trainer | None = None

    def active(self, kind: str) -> bool:
        trainer = self.trainer
        return (self.kind == kind and trainer is not None and trainer.global_rank == self.rank
                and trainer.global_step >= self.first)


class Classifier(L.LightningModule):
    def __init__(self, fault: Fault, micro_batches: int, shard: bool = False):
        super().__init__()
        self.fault, self.micro_batches, self.shard = fault, micro_batches, shard
        self.net = nn.Sequential(nn.Linear(FEATURES, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, CLASSES))

    def configure_model(self):
        """FSDP2 under ModelParallelStrategy: each layer, then the whole, sharded over
        the data-parallel ranks (Lightning calls this once the mesh exists)."""
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, features):
        if self.fault.active("compute"):
            burn_compute(self.fault.seconds / self.micro_batches)
        return self.net(features)

    def training_step(self, batch, batch_index):
        features, labels = batch
        loss = nn.functional.cross_entropy(self(features), labels)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_index):
        features, labels = batch
        self.log("val_loss", nn.functional.cross_entropy(self(features), labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Synthetic(Dataset):
    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.features = torch.randn(size, FEATURES, generator=generator)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.features[index], self.labels[index]


class SlowCollate:
    def __init__(self, fault: Fault, micro_batches: int):
        self.fault, self.micro_batches = fault, micro_batches

    def __call__(self, items):
        if self.fault.active("input"):
            time.sleep(self.fault.seconds / self.micro_batches)
        return (torch.stack([f for f, _ in items]), torch.stack([label for _, label in items]))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    devices = args.devices or int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(args.seed, verbose=False)
    fault = Fault(args)
    module = Classifier(fault, args.accumulation, shard=args.strategy == "fsdp2")
    micro_batches = args.steps * args.accumulation
    train = DataLoader(Synthetic(micro_batches * args.batch_size, args.seed),
                       batch_size=args.batch_size, collate_fn=SlowCollate(fault, args.accumulation))
    validation = DataLoader(Synthetic(4 * args.batch_size * devices, args.seed + 1),
                            batch_size=args.batch_size)
    callbacks = []
    if args.save_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=args.output or tempfile.mkdtemp(prefix="train_lightning-"),
            every_n_train_steps=args.save_every, save_top_k=-1))
    if args.strategy == "fsdp2":
        strategy = L.pytorch.strategies.ModelParallelStrategy(
            data_parallel_size=devices, tensor_parallel_size=1)
    else:
        strategy = args.strategy if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=devices, strategy=strategy,
        max_steps=args.steps, accumulate_grad_batches=args.accumulation,
        val_check_interval=args.eval_every * args.accumulation if args.eval_every else None,
        limit_val_batches=4 if args.eval_every else 0, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=bool(args.save_every), callbacks=callbacks,
        log_every_n_steps=10)
    fault.trainer = trainer
    started = time.perf_counter()
    trainer.fit(module, train, validation)
    if trainer.global_rank == 0:
        elapsed = time.perf_counter() - started
        print(f"done: {trainer.global_step} steps in {elapsed:.2f} s "
              f"({1000 * elapsed / max(trainer.global_step, 1):.1f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
