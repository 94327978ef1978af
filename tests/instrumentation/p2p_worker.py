"""The per-rank body of test_p2p (a module of its own so spawned processes can import it)."""

from __future__ import annotations

import json
import os
import sys


def rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "FLARE_JOB_ID": "p2p", "FLARE_HEARTBEAT_S": "0",
                       "FLARE_DETAIL_EVERY": "1"})
    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import flare.instrumentation as flare_instrumentation
    from flare.instrumentation import torch_training

    torch_training.GPU_LAYER_MODULES = ()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = torch_training.TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    peer = 1 - rank
    with flare_instrumentation.step():
        outgoing, incoming = torch.full((8,), float(rank)), torch.empty(8)
        if rank == 0:
            dist.send(outgoing, dst=peer)
            dist.recv(incoming, src=peer)
        else:
            dist.recv(incoming, src=peer)
            dist.send(outgoing, dst=peer)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, peer),
                                            dist.P2POp(dist.irecv, incoming, peer)]):
            work.wait()
        request = dist.irecv(incoming, src=peer) if rank else dist.isend(outgoing, dst=peer)
        request.wait()
        dist.all_reduce(outgoing, async_op=True).wait()
    instrumentor.uninstrument()
    spans = [{"name": s.name, "attributes": dict(s.attributes)}
             for s in exporter.get_finished_spans()]
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(spans, handle, default=list)
    # both ranks done with their point-to-point work before either tears gloo down: a
    # rank destroying its group while its peer's last receive is still in gloo's hands
    # aborted that peer ("terminate called without an active exception", once in a
    # fresh-clone run)
    dist.barrier()
    dist.destroy_process_group()
    # Still, a gloo thread aborted one rank at interpreter exit once more ("terminate
    # called without an active exception", fresh-clone tier 1, after the barrier): the
    # spans are written and the group is gone, so the rank leaves without torch's
    # interpreter teardown (the test is about the spans, not about that abort).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
