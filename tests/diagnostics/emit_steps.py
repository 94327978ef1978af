"""A stand-in training job for `flare run` tests that need no torch: four "ranks"
(one OTel TracerProvider each, as four processes would have) send `train.step` spans
over real OTLP (the protocol and endpoint `flare run` puts in the environment); rank 3's
compute is 40 ms slower from step 10, so the others wait for it."""

from __future__ import annotations

import os
import sys
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from flare.wire import semconv as sc

WORLD, STEPS, SLOW_RANK, SLOW_FROM = 4, 40, 3, 10


def _exporter(endpoint: str):
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")


def main() -> int:
    job = os.environ[sc.ENV_JOB_ID]
    endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
    providers = []
    for rank in range(WORLD):
        provider = TracerProvider(resource=Resource.create({
            sc.SERVICE_NAME: job, sc.JOB_ID: job, sc.RANK: rank, sc.WORLD_SIZE: WORLD}))
        provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        providers.append(provider)
    t = time.time_ns()
    for step in range(STEPS):
        compute = [20.0 + (40.0 if r == SLOW_RANK and step >= SLOW_FROM else 0.0) + r * 0.3 for r in range(WORLD)]
        barrier = max(compute) + 2.0
        for rank, provider in enumerate(providers):
            wait = barrier - compute[rank] + 2.0
            span = provider.get_tracer("emit").start_span(sc.SPAN_STEP, start_time=t, attributes={
                sc.STEP: step, sc.STEP_COMPUTE_MS: compute[rank], sc.STEP_COLLECTIVE_WAIT_MS: wait,
                sc.STEP_DATALOADER_MS: 1.0, sc.STEP_GC_MS: 0.0, sc.STEP_PYCALL_MS: 0.0})
            span.end(end_time=t + int((compute[rank] + 1.0 + wait) * 1e6))
        t += int((barrier + 4.0) * 1e6)
    for provider in providers:
        provider.shutdown()
    return int(sys.argv[1]) if len(sys.argv) > 1 else 0


if __name__ == "__main__":
    raise SystemExit(main())
