"""A small DDP training job (gloo, CPU) with injectable faults.

It knows nothing of Flare: it is the "user script" that Flare must diagnose with zero
code change, e.g.

    torchrun --nproc_per_node 4 examples/train_ddp.py --steps 200
    torchrun --nproc_per_node 4 examples/train_ddp.py --fault compute --fault-rank 2

Faults (on the ranks of --fault-rank, one rank or a comma-separated list such as 1,3,
from step --fault-from on, costing about --fault-ms per faulty step; with
--fault-every N only every Nth step from --fault-from is faulty: a periodic stall; a
second fault at the same time with --also KIND@RANKS, e.g. --fault compute
--fault-rank 1 --also gc@3):
  compute       extra matmuls in the forward pass
  input         the batch collate function sleeps (the dataloader is slow)
  gc            a large live object graph (built before the first step) makes the
                full gc.collect() of each faulty step pause the rank; the pause is
                inside the collector, so gc.callbacks see it
  stall         the rank sleeps in save_checkpoint() inside the step (a checkpoint,
                evaluation or logging stall; e.g. rank 0 with --fault-every 8)
  cpu           a background thread holds the GIL in a pure-Python busy loop for
                about --fault-ms at the start of every step (a metrics or logging
                thread doing Python work beside the training loop)
  hang          the rank blocks forever in wait_for_shared_filesystem() before backward
  hang_subgroup ranks 0 and 1 all-reduce in a sub-group every step; the faulty rank
                skips it and blocks in wait_for_shared_filesystem(), so its peer waits
  input_hang    the batch for step --fault-from blocks forever in
                read_from_a_dead_mount(), inside the DataLoader's worker process with
                --num-workers N (in the rank itself without)
  raise         the rank raises RuntimeError from load_shard()
  kill          the rank is killed by SIGKILL in load_shard(), as the kernel's OOM
                killer does: it dies without a word, and its peers fail after it
  extra_comm    every rank all-reduces an extra ~4 MB tensor every step
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

FAULTS = ("none", "compute", "input", "gc", "cpu", "hang", "hang_subgroup", "raise",
          "kill", "extra_comm", "stall", "input_hang")
FEATURES = 256
CLASSES = 16


def rank_list(text: str) -> tuple[int, ...]:
    """`2` or `1,3`: the faulty ranks."""
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rank or a comma-separated list of ranks: {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"not a rank or a comma-separated list of ranks: {text!r}")
    return ranks


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the DDP model (its first steps compile)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--optimizer", choices=("sgd", "manual"), default="sgd",
                        help="manual: a hand-written SGD update, no torch.optim optimizer (a "
                             "framework's own optimizer, whose steps Flare cannot see)")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=rank_list, default=(1,), metavar="RANKS",
                        help="the faulty rank, or a comma-separated list of ranks (1,3)")
    parser.add_argument("--fault-from", type=int, default=40,
                        help="first step (0-based) at which the fault is active")
    parser.add_argument("--fault-every", type=int, default=0, metavar="N",
                        help="0: the fault is active on every step from --fault-from; N > 0: "
                             "only on steps where (step - fault_from) %% N == 0")
    parser.add_argument("--fault-ms", type=float, default=60.0,
                        help="added cost per step, in milliseconds")
    parser.add_argument("--also", type=second_fault, default=None, metavar="KIND@RANKS",
                        help="a second fault at the same time, e.g. gc@3: that kind on those "
                             "ranks, with the same --fault-from, --fault-every and --fault-ms")
    parser.add_argument("--checksum", metavar="DIR",
                        help="each rank writes a digest of its final parameters (its shard) to DIR/rank<R>.sha256")
    parser.add_argument("--step-times", metavar="PATH",
                        help="rank 0 writes each step's wall time (s) here as JSON")
    return parser.parse_args(argv)


class ManualSgd:
    """Plain SGD written by hand, as a framework's own optimizer is: not a torch.optim
    one, so no step of the loop ends where Flare looks."""

    def __init__(self, parameters, lr: float):
        self.parameters, self.lr = list(parameters), lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for parameter in self.parameters:
            if parameter.grad is not None:
                parameter -= self.lr * parameter.grad


def second_fault(text: str) -> tuple[str, tuple[int, ...]]:
    kind, _, ranks = text.partition("@")
    if kind not in FAULTS or kind == "none" or not ranks:
        raise argparse.ArgumentTypeError(f"expected KIND@RANKS with KIND one of {', '.join(FAULTS[1:])}")
    return kind, rank_list(ranks)


class Fault:
    """Which faults are active on this rank at a given step: --fault on --fault-rank, and
    the --also fault on its ranks."""

    def __init__(self, args: argparse.Namespace, rank: int):
        chosen = [(args.fault, args.fault_rank), *([args.also] if args.also else [])]
        self.kinds = {kind for kind, ranks in chosen if kind != "none" and rank in ranks}
        self.first_step = args.fault_from
        self.every = max(0, args.fault_every)
        self.seconds = args.fault_ms / 1000.0

    def on(self, kind: str) -> bool:
        return kind in self.kinds

    def active(self, kind: str, step: int) -> bool:
        if kind not in self.kinds or step < self.first_step:
            return False
        return self.every == 0 or (step - self.first_step) % self.every == 0


class SyntheticDataset(Dataset):
    """Deterministic random samples: sample i of rank r is the same in every run."""

    def __init__(self, length: int, seed: int, rank: int):
        self.length = length
        self.seed = seed * 1_000_003 + rank

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(self.seed * 7919 + index)
        features = torch.randn(FEATURES, generator=generator)
        label = int(torch.randint(CLASSES, (1,), generator=generator))
        return index, features, label


def read_from_a_dead_mount() -> None:
    """The `input_hang` fault: a read that never returns, in the loader (its worker
    process with --num-workers)."""
    threading.Event().wait()


class SlowableCollate:
    """Batches samples; sleeps when the `input` fault is active for the batch's step.

    A class (not a closure) so that it pickles into DataLoader worker processes.
    """

    def __init__(self, fault: Fault, batch_size: int):
        self.fault = fault
        self.batch_size = batch_size

    def __call__(self, samples):
        step = samples[0][0] // self.batch_size
        if self.fault.active("input", step):
            time.sleep(self.fault.seconds)
        if self.fault.active("input_hang", step) and step == self.fault.first_step:
            read_from_a_dead_mount()
        features = torch.stack([sample[1] for sample in samples])
        labels = torch.tensor([sample[2] for sample in samples])
        return features, labels


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def write_checksum(model: nn.Module, rank: int, folder: str) -> None:
    """The sha256 of the rank's own parameters (its shard, for FSDP2 or tensor parallel)
    in `folder`/rank<R>.sha256: equal digests mean bit-identical training."""
    import hashlib
    import os

    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        local = getattr(parameter, "to_local", None)
        tensor = (local() if callable(local) else parameter).detach().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.sha256"), "w") as handle:
        handle.write(digest.hexdigest() + "\n")


def burn_compute(seconds: float) -> None:
    """Real matrix work for about `seconds` of wall time."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


class GcPressure:
    """A live graph of container objects big enough that a full gc.collect() pauses
    the process for about the fault's cost: the collector must traverse live objects
    too, so the pause happens inside the gc machinery (and `gc.callbacks` sees it).

    Sized by measuring: a full collection's cost grows with the tracked objects, so the
    graph grows by what is missing at the measured cost per object (at most doubling the
    tracked objects each round) until a collection takes about `seconds` of CPU (CPU,
    not wall time, so that the size does not depend on what else runs at start-up; on
    a host with fewer cores than busy processes the pause lasts longer). What the
    process already holds is frozen first (gc.freeze(): torch, DDP and the OpenTelemetry
    SDK track ~300k objects, whose traversal alone took 80-130 ms, whatever was asked),
    so the pause is the graph's."""

    def __init__(self, seconds: float):
        self.live: list = []
        gc.freeze()
        baseline = len(gc.get_objects())  # what a full collection traverses already
        while True:
            took = min(self._collect_seconds() for _ in range(2))
            tracked = baseline + len(self.live)
            if took >= 0.9 * seconds or len(self.live) >= 20_000_000:
                break
            missing = (seconds - took) * tracked / max(took, 1e-6)
            grow = int(min(max(missing, 20_000), max(tracked, 20_000)))
            self.live.extend([[i] for i in range(grow)])

    @staticmethod
    def _collect_seconds() -> float:
        start = time.thread_time()
        gc.collect()
        return time.thread_time() - start

    def pause(self) -> None:
        cycle: list = []
        cycle.append(cycle)  # one real cycle, so each collection finds garbage
        del cycle
        gc.collect()


class GilHog:
    """A background thread that, woken at each step, spins in pure Python for about
    `seconds`: it never releases the GIL voluntarily, so the training thread gets it
    back only at the interpreter's switch interval. It works per step rather than
    spinning for ever so that it slows its own rank, not every process sharing the
    host's cores (a forever-spinning thread costs a whole core)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.wake = threading.Event()
        threading.Thread(target=self._run, name="gil-hog", daemon=True).start()

    def _run(self) -> None:
        counter = 0
        while True:
            self.wake.wait()
            self.wake.clear()
            deadline = time.perf_counter() + self.seconds
            while time.perf_counter() < deadline:
                counter += 1


def wait_for_shared_filesystem() -> None:
    """Stands in for a rank stuck on I/O: it never returns."""
    while True:
        time.sleep(0.5)


def save_checkpoint(step: int, fault: Fault) -> None:
    """Stands in for a periodic checkpoint (or evaluation, or logging flush) done inside
    the step; the `stall` fault makes it take --fault-ms."""
    if fault.active("stall", step):
        time.sleep(fault.seconds)


def load_shard(step: int, fault: Fault) -> None:
    """Stands in for reading the next data shard; the `raise` fault corrupts it."""
    if fault.active("raise", step):
        raise RuntimeError(f"corrupt shard {step:05d}: checksum mismatch")
    if fault.active("kill", step):
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Started without a launcher (`python examples/train_ddp.py`): one process, no DDP.
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    fault = Fault(args, rank)

    subgroup = None
    if args.fault in ("hang_subgroup", "extra_comm") and not distributed:
        raise SystemExit(f"--fault {args.fault} needs torchrun (several ranks)")
    if args.fault == "hang_subgroup":
        if len(args.fault_rank) != 1 or args.fault_rank[0] not in (0, 1) or world_size < 2:
            raise SystemExit("--fault hang_subgroup needs --fault-rank 0 or 1 and >= 2 ranks")
        subgroup = dist.new_group([0, 1])  # every rank must take part in creating it

    if not distributed:
        model = torch.compile(build_model(args.hidden)) if args.compile else build_model(args.hidden)
    elif args.compile:  # torch.compile over DDP: the first steps compile (seconds each);
        # dynamo's DDP optimizer wants the default bucket sizes
        model = torch.compile(DistributedDataParallel(build_model(args.hidden)))
    else:
        model = DistributedDataParallel(build_model(args.hidden), bucket_cap_mb=0.5)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                 if args.optimizer == "sgd" else ManualSgd(model.parameters(), lr=0.01))
    loss_fn = nn.CrossEntropyLoss()
    dataset = SyntheticDataset(args.steps * args.batch_size, args.seed, rank)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                        num_workers=args.num_workers,
                        collate_fn=SlowableCollate(fault, args.batch_size),
                        persistent_workers=args.num_workers > 0)
    extra_comm = torch.zeros(1024 * 1024) if args.fault == "extra_comm" else None
    # Built once the model, DDP and the loader exist (it freezes them: see GcPressure);
    # its construction (allocations, calibrating collections) falls in step 0, a warm-up
    # step, and in no faulty one.
    gc_pressure = GcPressure(fault.seconds) if fault.on("gc") else None
    gil_hog = None

    started = time.perf_counter()
    step_times: list[float] = []
    step_started = started
    for step, (features, labels) in enumerate(loader):
        load_shard(step, fault)
        if fault.active("gc", step):
            gc_pressure.pause()
        if fault.active("cpu", step):
            gil_hog = gil_hog or GilHog(fault.seconds)
            gil_hog.wake.set()
        if subgroup is not None and rank in (0, 1):
            if fault.active("hang_subgroup", step):
                wait_for_shared_filesystem()
            dist.all_reduce(torch.ones(4), group=subgroup)

        save_checkpoint(step, fault)
        loss = loss_fn(model(features), labels)
        if fault.active("compute", step):
            burn_compute(fault.seconds)
        if fault.active("hang", step):
            wait_for_shared_filesystem()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if extra_comm is not None:
            dist.all_reduce(extra_comm)
        optimizer.step()
        now = time.perf_counter()
        step_times.append(now - step_started)
        step_started = now
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    elapsed = time.perf_counter() - started
    if rank == 0:
        print(f"done: {args.steps} steps in {elapsed:.2f} s "
              f"({1000 * elapsed / max(args.steps, 1):.1f} ms/step)", flush=True)
    if rank == 0 and args.step_times:
        with open(args.step_times, "w") as handle:
            json.dump(step_times, handle)
    if args.checksum:
        write_checksum(model, rank, args.checksum)
    if distributed:
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
