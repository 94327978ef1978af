"""Torchrun worker for benchmarks/instrumentation_overhead.py: the examples/train_ddp.py
job, with Flare instrumented and uninstrumented in alternating blocks of steps inside
the same processes, so the machine's load hits both arms alike (not a user script:
a user's job is instrumented by opentelemetry-instrument, with no code change).

    torchrun --nproc_per_node 4 benchmarks/instrumentation_overhead_worker.py \
        OUT.json STEPS BLOCK [train_ddp.py arguments...]

Every rank writes OUT.json.<rank>: per block, whether Flare was on and each step's wall
time, training-thread CPU time and process CPU time (seconds), the settling steps left
out. Work an instrumented block leaves for later (the step spans the finisher thread has
not built yet, the batch processor's pending export) is done when the block ends, by
`uninstrument()` and a flush of the provider, and its cost is written with that block
(`toggle`: wall, training thread and process CPU seconds), so that it is counted in the
arm that caused it and not in the plain block that follows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTLE_STEPS = 3  # steps after each toggle left out (instrument/uninstrument, detail step 0)


def load_train_module():
    spec = importlib.util.spec_from_file_location("train_ddp", REPO / "examples" / "train_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    out_path, steps, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    train_args = sys.argv[4:]
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "512")  # as the instrumentor would
    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from flare.instrumentation.torch_training import TorchTrainingInstrumentor

    train = load_train_module()
    args = train.parse_args(["--steps", str(steps), *train_args])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    fault = train.Fault(args, rank)
    model = DistributedDataParallel(train.build_model(args.hidden), bucket_cap_mb=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(train.SyntheticDataset(steps * args.batch_size, args.seed, rank),
                        batch_size=args.batch_size,
                        collate_fn=train.SlowableCollate(fault, args.batch_size))
    provider = TracerProvider(resource=Resource.create())
    if os.environ.get("FLARE_BENCH_EXPORTER", "flare_otlp") == "flare_otlp":
        from flare.instrumentation.otlp_exporter import FlareOTLPSpanExporter as OTLPSpanExporter
    elif os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    instrumentor = TorchTrainingInstrumentor()

    blocks: list[dict] = []
    on = False
    last = (time.perf_counter(), time.thread_time(), time.process_time())
    for step, (features, labels) in enumerate(loader):
        if step % block == 0 and step:
            if on:
                before = (time.perf_counter(), time.thread_time(), time.process_time())
                instrumentor.uninstrument()
                provider.force_flush()
                after = (time.perf_counter(), time.thread_time(), time.process_time())
                blocks[-1]["toggle"] = [b - a for a, b in zip(before, after, strict=True)]
            else:
                instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
            on = not on
            blocks.append({"instrumented": on, "steps": block, "wall": [],
                           "thread_cpu": [], "process_cpu": []})
        loss = loss_fn(model(features), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        if blocks and step % block >= SETTLE_STEPS:
            for key, before, after in zip(("wall", "thread_cpu", "process_cpu"), last, now,
                                          strict=True):
                blocks[-1][key].append(after - before)
        last = now
    if on:
        instrumentor.uninstrument()
        blocks.pop()  # its left-over work was not measured
    with open(f"{out_path}.{rank}", "w") as handle:
        json.dump(blocks, handle)
    dist.barrier()
    dist.destroy_process_group()
    provider.shutdown()


if __name__ == "__main__":
    main()
