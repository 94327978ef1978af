"""Targeted capture in a real instrumented process: nothing sampled until asked, then K
detail steps each with a `flare.capture` child naming the line the rank spends its
time on; removing the request stops it."""

from __future__ import annotations

import time

import torch
from test_instrumentor import finished, make_provider, rank_env  # noqa: F401

from flare.instrumentation import semconv
from flare.instrumentation.torch_training import TorchTrainingInstrumentor


def slow_part(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def steps(n: int, model, optimizer) -> None:
    for _ in range(n):
        slow_part(0.03)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()


def test_a_request_captures_k_steps_and_names_the_busy_line(rank_env, tmp_path):  # noqa: F811
    flag = tmp_path / "capture.{rank}"
    rank_env.setenv(semconv.ENV_CAPTURE_FLAG_FILE, str(flag))
    rank_env.setenv("FLARE_DETAIL_EVERY", "0")
    provider, exporter = make_provider()
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        steps(3, model, optimizer)
        assert finished(exporter, semconv.SPAN_CAPTURE) == []  # not asked: nothing
        (tmp_path / "capture.0").write_text("4")
        instrumentor._watchdog.capture.poll()  # what the watchdog does every second
        steps(8, model, optimizer)
        provider.force_flush()
    finally:
        instrumentor.uninstrument()
    captures = finished(exporter, semconv.SPAN_CAPTURE)
    assert len(captures) == 4
    # Over the captured steps the busy line leads (one step alone, on a loaded host,
    # may catch the sampler mostly outside it: its first step began mid-capture setup).
    totals: dict[str, int] = {}
    for span in captures:
        assert span.attributes[semconv.CAPTURE_TOTAL] >= 1
        for frame, count in zip(span.attributes[semconv.CAPTURE_FRAMES],
                                span.attributes[semconv.CAPTURE_SAMPLES], strict=True):
            totals[frame] = totals.get(frame, 0) + count
    top = max(totals, key=totals.get)
    assert top.startswith(f"{__file__}:") and top.endswith("in slow_part"), totals
