"""Step spans emitted finished (flare.instrumentation.finished_span) against the SDK path.

The fast path must be indistinguishable from `Tracer.start_span` + `end()` for what an
exporter sees, honour the sampler, and step aside for processors that do work in
`on_start`."""

from __future__ import annotations

import collections
import itertools

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from test_instrumentor import finished, make_provider, rank_env, train  # noqa: F401  (fixture)

import flare.instrumentation as flare_instrumentation
from flare.instrumentation.finished_span import FinishedSpans
from flare.instrumentation.torch_training import TorchTrainingInstrumentor
from flare.wire import semconv

_TIMINGS = {semconv.STEP_DATALOADER_MS, semconv.STEP_GC_MS, semconv.STEP_PYCALL_MS,
            semconv.STEP_BACKWARD_MS, semconv.STEP_COMPUTE_MS,
            semconv.STEP_OTHER_THREADS_CPU_MS, semconv.STEP_RUNQUEUE_MS,
            semconv.STEP_THREAD_CPU_MS, semconv.STEP_COLLECTIVE_WAIT_MS,
            semconv.STEP_GC_COUNT}


class StartCounting(SpanProcessor):
    """A processor with its own on_start: step spans must reach it through the SDK."""

    def __init__(self):
        self.started = []

    def on_start(self, span, parent_context=None):
        self.started.append(span.name)


class Listener:
    def on_step_start(self, step, detail):
        pass

    def on_step_end(self, step, detail, span):
        span.set_attribute("test.list", [1, 2, 3])
        span.set_attributes({"test.none": None, "test.step": step})


def run(provider, steps=3):
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    try:
        runtime = flare_instrumentation.active_runtime()
        runtime.add_step_listener(Listener())
        fast = runtime._finished is not None and runtime._finished.usable()
        train(steps)
    finally:
        instrumentor.uninstrument()
    return fast, finished(exporter, semconv.SPAN_STEP), exporter


def comparable(span):
    return {
        "name": span.name, "kind": span.kind, "status": span.status.status_code,
        "trace_id": span.context.trace_id, "sampled": span.context.trace_flags.sampled,
        "parent": (span.parent.trace_id, span.parent.span_id),
        "resource": dict(span.resource.attributes),
        "scope": span.instrumentation_scope.name,
        "attributes": {k: tuple(v) if isinstance(v, (list, tuple)) else v
                       for k, v in span.attributes.items() if k not in _TIMINGS},
        "valid_times": span.start_time < span.end_time,
    }


def test_finished_step_spans_match_the_sdk_path(rank_env):  # noqa: F811
    resource = Resource({"service.name": "t"})
    fast, fast_spans, fast_exporter = run(TracerProvider(resource=resource))
    slow_provider = TracerProvider(resource=resource)
    counting = StartCounting()
    slow_provider.add_span_processor(counting)
    slow, slow_spans, _ = run(slow_provider)
    assert fast and not slow
    assert counting.started.count(semconv.SPAN_STEP) == 3  # it saw every step span start
    for fast_span, slow_span in zip(fast_spans, slow_spans, strict=True):
        want, got = comparable(slow_span), comparable(fast_span)
        got_attributes, want_attributes = got.pop("attributes"), want.pop("attributes")
        assert {k: (got_attributes.get(k), v) for k, v in want_attributes.items()
                if got_attributes.get(k) != v} == {}
        assert set(got_attributes) == set(want_attributes)
        assert got == want
    assert len(fast_spans) == 3
    for span in fast_spans:
        assert span.attributes["test.list"] == (1, 2, 3)
        assert span.attributes["test.none"] is None  # kept, as the SDK keeps it
        assert span.attributes["test.step"] == span.attributes[semconv.STEP]
    # children of detail steps name the finished span as their parent
    ids = {s.context.span_id for s in fast_spans}
    loader = finished(fast_exporter, semconv.SPAN_DATALOADER)
    assert loader and all(s.parent.span_id in ids for s in loader)
    # and carry their step's number, as the step span does
    step_of = {s.context.span_id: s.attributes[semconv.STEP] for s in fast_spans}
    assert all(s.attributes[semconv.STEP] == step_of[s.parent.span_id] for s in loader)


@pytest.mark.parametrize("with_start_processor", [False, True])
def test_the_sampler_still_decides(rank_env, with_start_processor):  # noqa: F811
    provider = TracerProvider(sampler=ALWAYS_OFF)
    if with_start_processor:
        provider.add_span_processor(StartCounting())
    _, spans, _ = run(provider)
    assert spans == []


def test_a_non_sdk_tracer_keeps_the_sdk_path():
    class NotTheSdk:
        span_processor = None

    assert FinishedSpans.for_tracer(NotTheSdk()) is None


def run_batched(steps=5, schedule_delay_millis=60_000, exporter=None):
    """Like run(), with a batch processor: ordinary steps are deferred to the finisher."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = exporter or InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "t"}))
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_millis))
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    runtime = flare_instrumentation.active_runtime()
    runtime.add_step_listener(Listener())
    return provider, exporter, instrumentor, runtime


def test_deferred_step_spans_match_and_leave_on_the_providers_flush(rank_env):  # noqa: F811
    _, reference, _ = run(TracerProvider(resource=Resource({"service.name": "t"})), steps=5)
    provider, exporter, instrumentor, runtime = run_batched()
    try:
        assert runtime._finished.asynchronous()
        train(5)
        assert len(runtime.finisher.deferred) + len(finished(exporter, semconv.SPAN_STEP)) <= 5
        provider.force_flush()  # the user's own flush: deferred spans first
        spans = finished(exporter, semconv.SPAN_STEP)
    finally:
        instrumentor.uninstrument()
    assert [s.attributes[semconv.STEP] for s in spans] == [0, 1, 2, 3, 4]
    assert [comparable(s) for s in spans] == [comparable(s) for s in reference]
    for span in spans:
        assert span.attributes["test.step"] == span.attributes[semconv.STEP]
    # detail steps (0, 2, 4 with FLARE_DETAIL_EVERY=2) are built at once, the others by
    # the finisher: their children still name them as parent
    ids = {s.context.span_id for s in spans}
    assert all(s.parent.span_id in ids for s in finished(exporter, semconv.SPAN_DATALOADER))


def test_deferred_step_spans_leave_without_any_flush(rank_env):  # noqa: F811
    import time

    provider, exporter, instrumentor, _ = run_batched(schedule_delay_millis=50)
    try:
        train(4)
        deadline = time.monotonic() + 5
        while len(finished(exporter, semconv.SPAN_STEP)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s.attributes[semconv.STEP] for s in finished(exporter, semconv.SPAN_STEP)
                ] == [0, 1, 2, 3]
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


class ThreadRecordingExporter(InMemorySpanExporter):
    def __init__(self):
        super().__init__()
        self.threads = []

    def export(self, spans):
        import threading

        self.threads.append(threading.current_thread().name)
        return super().export(spans)


def test_the_finisher_exports_its_step_spans_once_per_batch_delay(rank_env):  # noqa: F811
    """The finisher wakes once per batch delay (not less than 2 s), hands the deferred
    step spans over and exports them at once, on its own thread: they leave within
    one period, the batch processor's worker then finds nothing to send. Work handed
    to run_later wakes it at once."""
    import threading
    import time

    provider, exporter, instrumentor, runtime = run_batched(
        schedule_delay_millis=3000, exporter=ThreadRecordingExporter())
    try:
        assert runtime._finished.batch_delay_s() == 3.0
        train(4)
        started = time.monotonic()
        while len(finished(exporter, semconv.SPAN_STEP)) < 4 and time.monotonic() - started < 10:
            time.sleep(0.02)
        elapsed = time.monotonic() - started
        assert [s.attributes[semconv.STEP] for s in finished(exporter, semconv.SPAN_STEP)
                ] == [0, 1, 2, 3]
        assert elapsed < 3.0 + 1.0  # one period (the 3 s delay), not a period plus the delay
        assert "flare-step-finisher" in exporter.threads
        ran = threading.Event()
        started = time.monotonic()
        runtime.run_later(ran.set)
        assert ran.wait(0.5) and time.monotonic() - started < 0.5  # not a period later
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


def test_the_batch_worker_sleeps_while_the_finisher_flushes_and_wakes_when_steps_stop(
        rank_env):  # noqa: F811
    """While steps flow, the finisher's flush sends everything each period, and the batch
    processor's own worker is held to a long schedule (no request of its own from a cold
    thread). A period without steps gives the schedule back, and a span another thread
    emits then (a heartbeat during a stall) leaves on the worker's own delay."""
    import time

    provider, exporter, instrumentor, runtime = run_batched(
        schedule_delay_millis=2000, exporter=ThreadRecordingExporter())
    inner = provider._active_span_processor._span_processors[-1]._batch_processor
    try:
        train(3)
        deadline = time.monotonic() + 5
        while len(finished(exporter, semconv.SPAN_STEP)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert inner._schedule_delay == 12 * 2.0  # held: the finisher flushed it
        assert set(exporter.threads) == {"flare-step-finisher"}
        deadline = time.monotonic() + 5  # the next period has no steps: released
        while inner._schedule_delay != 2.0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert inner._schedule_delay == 2.0
        runtime.tracer.start_span("flare.heartbeat").end()
        started = time.monotonic()
        while not finished(exporter, "flare.heartbeat") and time.monotonic() - started < 5:
            time.sleep(0.02)
        assert finished(exporter, "flare.heartbeat")
        assert time.monotonic() - started < 2.0 + 0.5  # the worker's own 2 s, not 24 s
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    assert inner._schedule_delay == 2.0


def test_uninstrument_hands_over_what_is_deferred(rank_env):  # noqa: F811
    provider, exporter, instrumentor, runtime = run_batched()
    train(3)
    instrumentor.uninstrument()
    assert not runtime.finisher.deferred
    provider.force_flush()
    assert [s.attributes[semconv.STEP] for s in finished(exporter, semconv.SPAN_STEP)
            ] == [0, 1, 2]


def test_a_step_span_that_cannot_be_built_costs_only_itself(rank_env, caplog):  # noqa: F811
    provider, exporter, instrumentor, runtime = run_batched()
    original = runtime.finisher.emit

    def emit(record, pending, children):
        if record[0] == 1:
            raise ValueError("boom")
        original(record, pending, children)

    runtime.finisher.emit = emit
    try:
        train(5)
        instrumentor.uninstrument()  # drains
    finally:
        runtime.finisher.emit = original
    provider.force_flush()
    steps = [s.attributes[semconv.STEP] for s in finished(exporter, semconv.SPAN_STEP)]
    assert steps == [0, 2, 3, 4]
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 1


def test_an_explicit_provider_shutdown_still_exports_deferred_steps(rank_env,  # noqa: F811
                                                                     monkeypatch):
    # no detail step: its flight-recorder read would wake the finisher, which would
    # then hand the deferred steps over before the shutdown this test is about
    monkeypatch.setenv("FLARE_DETAIL_EVERY", "0")
    provider, exporter, instrumentor, runtime = run_batched()
    try:
        train(4)
        assert len(runtime.finisher.deferred) == 4  # every step waits for the finisher's period
        provider.shutdown()  # the user's own shutdown, mid-process
        steps = [s.attributes[semconv.STEP] for s in finished(exporter, semconv.SPAN_STEP)]
    finally:
        instrumentor.uninstrument()
    assert steps == [0, 1, 2, 3]


class OrderListener:
    """Records the hook order; makes step 3's span early, as a hang report would."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.calls = []

    def on_step_start(self, step, detail):
        self.calls.append(("start", step, detail))
        if step == 3:
            assert self.runtime.step_span is not None  # a real SDK span from now on

    def on_step_end(self, step, detail, span):
        self.calls.append(("end", step, detail))
        span.set_attribute("test.order", step)


def test_the_optimizer_boundary_keeps_listener_order_and_one_span_per_step(rank_env):  # noqa: F811
    provider, exporter, instrumentor, runtime = run_batched()
    listener = OrderListener(runtime)
    runtime.add_step_listener(listener)
    try:
        train(6)
        provider.force_flush()
        spans = finished(exporter, semconv.SPAN_STEP)
    finally:
        instrumentor.uninstrument()
    # FLARE_DETAIL_EVERY=2: even steps are detail steps; the last step stays open
    expected = []
    for step in range(6):
        expected += [("start", step, step % 2 == 0), ("end", step, step % 2 == 0)]
    assert listener.calls[:12] == expected
    assert [s.attributes[semconv.STEP] for s in spans] == [0, 1, 2, 3, 4, 5]
    assert [s.attributes["test.order"] for s in spans] == [0, 1, 2, 3, 4, 5]
    # every step starts where the previous one ended (one clock reading at the boundary)
    assert all(a.end_time == b.start_time for a, b in itertools.pairwise(spans))


class DetailOnly(OrderListener):
    ordinary_steps = ()


class EndsOnly(OrderListener):
    ordinary_steps = ("on_step_end",)


@pytest.mark.parametrize("batched", [True, False])
def test_listeners_skip_the_hooks_they_do_not_need_on_ordinary_steps(rank_env, batched):  # noqa: F811
    if batched:
        provider, exporter, instrumentor, runtime = run_batched()
    else:
        provider = TracerProvider(resource=Resource({"service.name": "t"}))
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        instrumentor = TorchTrainingInstrumentor()
        instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
        runtime = flare_instrumentation.active_runtime()
    detail_only, ends_only = DetailOnly(runtime), EndsOnly(runtime)
    detail_only.calls, ends_only.calls = [], []
    runtime.add_step_listener(detail_only)
    runtime.add_step_listener(ends_only)
    try:
        train(4)  # FLARE_DETAIL_EVERY=2: steps 0 and 2 are detail steps
        provider.force_flush()
    finally:
        instrumentor.uninstrument()
    assert detail_only.calls == [("start", 0, True), ("end", 0, True), ("start", 2, True),
                                 ("end", 2, True), ("start", 4, True)]
    assert ends_only.calls == [("start", 0, True), ("end", 0, True), ("end", 1, False),
                               ("start", 2, True), ("end", 2, True), ("end", 3, False),
                               ("start", 4, True)]
    spans = finished(exporter, semconv.SPAN_STEP)
    assert [s.attributes.get("test.order") for s in spans] == [0, 1, 2, 3]


def test_deferred_step_spans_without_step_end_listeners_match(rank_env):  # noqa: F811
    """With no listener wanting ordinary steps' ends (the CPU default), no stand-in is
    made at the boundary: the finisher fixes the span id; the spans are the same. Detail
    steps are deferred as well, their children with them."""

    reference_provider = TracerProvider(resource=Resource({"service.name": "t"}))
    _, reference, _ = run(reference_provider, steps=5)
    provider, exporter = make_provider(batch_delay_ms=60_000)
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    try:
        runtime = flare_instrumentation.active_runtime()
        assert not runtime.listeners.on_end_ordinary
        appended = []

        class Recording(collections.deque):
            def append(self, item):
                appended.append(item)
                super().append(item)

        runtime.finisher.deferred = Recording()
        train(5)
        # ordinary steps (1, 3) without a stand-in or children; detail steps (0, 2, 4)
        # deferred too, with the stand-in their step-end listeners saw
        assert [(record[0], pending is None, bool(children))
                for record, pending, children in appended] == [
            (0, False, True), (1, True, False), (2, False, True), (3, True, False),
            (4, False, True)]
        provider.force_flush()
        spans = finished(exporter, semconv.SPAN_STEP)
    finally:
        instrumentor.uninstrument()
    strip = {"test.list", "test.none", "test.step"}  # what run()'s listener adds
    want = [comparable(s) for s in reference]
    for item in want:
        item["attributes"] = {k: v for k, v in item["attributes"].items() if k not in strip}
    assert [comparable(s) for s in spans] == want
    assert len({s.context.span_id for s in spans}) == 5


def test_the_default_samplers_verdict_is_taken_without_asking_it_again():
    """Below a sampled remote parent the SDK's default sampler keeps every span with the
    parent's trace state; after its first answer Flare writes that verdict itself. The
    spans must equal those of a sampler that behaves the same but is always asked."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    class AskedEveryTime(ParentBased):
        calls = 0

        def should_sample(self, *args, **kwargs):
            AskedEveryTime.calls += 1
            return super().should_sample(*args, **kwargs)

    spans = {}
    for label, sampler in (("default", ParentBased(ALWAYS_ON)),
                           ("asked", AskedEveryTime(ALWAYS_ON))):
        exporter = InMemorySpanExporter()
        provider = TracerProvider(sampler=sampler, resource=Resource({"service.name": "t"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        emitter = FinishedSpans.for_tracer(provider.get_tracer("t"))
        parents = [SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(1),
                               trace_state=TraceState([("k", "v")])),
                   SpanContext(7, 9, is_remote=True, trace_flags=TraceFlags(1)),
                   SpanContext(7, 10, is_remote=True, trace_flags=TraceFlags(0))]
        for round_ in range(2):
            for number, parent in enumerate(parents):
                emitter.emit("s", parent, 100 + 10 * round_ + number, {"a": number}, 1, 2)
        spans[label] = [(s.context, s.parent, dict(s.attributes)) for s in
                        exporter.get_finished_spans()]
    assert spans["default"] == spans["asked"]
    assert [ctx.trace_state.get("k") for ctx, _, _ in spans["default"]] == ["v", None] * 2
    assert AskedEveryTime.calls == 6


def test_a_stuck_export_bounds_the_deferred_steps_and_training_goes_on(rank_env, caplog,  # noqa: F811
                                                                       monkeypatch):
    """The finisher exports on its own thread: were an export never to return, the
    step records waiting for it stay bounded (the oldest dropped and counted, one
    warning), and the training thread never waits."""
    import logging
    import threading
    import time

    from flare.instrumentation import step_finisher

    monkeypatch.setattr(step_finisher, "DEFERRED_MAX", 8)
    monkeypatch.setattr(step_finisher, "DEFERRED_WAKE", 4)
    # no detail steps: each hands the deferred ones over on the training thread
    monkeypatch.setenv("FLARE_DETAIL_EVERY", "0")
    release = threading.Event()

    class StuckExporter(InMemorySpanExporter):
        def export(self, spans):
            release.wait(30)
            return super().export(spans)

    provider, _, instrumentor, runtime = run_batched(schedule_delay_millis=50,
                                                     exporter=StuckExporter())
    try:
        # 4 waiting steps wake the finisher before its period is over: it hands them
        # over, then blocks in the export; later steps pile up, at most 8
        started = time.monotonic()
        train(60)  # one optimizer: the step clock
        assert time.monotonic() - started < 20
        assert len(runtime.finisher.deferred) == 8
        assert runtime.finisher.dropped > 0
        with caplog.at_level(logging.WARNING, logger="flare.instrumentation.step_finisher"):
            release.set()
            instrumentor.uninstrument()
    finally:
        release.set()
        provider.shutdown()
    warnings = [r for r in caplog.records if "were dropped while the span export" in r.getMessage()]
    assert len(warnings) == 1


def test_spans_for_flares_exporter_are_handed_over_written(rank_env):  # noqa: F811
    """With every processor exporting through Flare's writer, the finisher hands its
    spans over already written (EncodedSpan) and the collector receives the request
    the SDK would send; a processor added later (one that reads the span objects) gets
    ReadableSpans from the next span on."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from otlp_sink import OtlpSink

    from flare.instrumentation.otlp_encoding import EncodedSpan
    from flare.instrumentation.otlp_exporter import FlareOTLPSpanExporter

    class Recording(SpanExporter):
        def __init__(self):
            self.batches = []

        def export(self, spans):
            self.batches.append(list(spans))
            return 0

    handed: list = []
    with OtlpSink() as sink:
        exporter = FlareOTLPSpanExporter(endpoint=sink.endpoint, insecure=True)
        original = exporter.export
        exporter.export = lambda spans: handed.extend(spans) or original(spans)
        provider = TracerProvider(resource=Resource({"service.name": "written"}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        instrumentor = TorchTrainingInstrumentor()
        instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
        try:
            train(4)
            provider.force_flush()
            later = Recording()
            provider.add_span_processor(SimpleSpanProcessor(later))
            train(2)
            provider.force_flush()
        finally:
            instrumentor.uninstrument()
            provider.shutdown()
        received = [request for _, request, _ in sink.trace_requests]
    steps = [s for s in handed if s.name == semconv.SPAN_STEP]
    assert len(steps) >= 6
    assert all(type(s) is EncodedSpan for s in steps[:4])  # written at once
    assert all(type(s) is not EncodedSpan for s in steps[5:])  # the added processor
    assert later.batches and all(type(s) is not EncodedSpan
                                 for batch in later.batches for s in batch)
    sdk_spans = [s for s in handed if type(s) is not EncodedSpan]
    assert received  # what reached the collector parses as the SDK's encoding would
    assert sum(len(r.resource_spans[0].scope_spans[0].spans) for r in received) == len(handed)
    assert encode_spans(sdk_spans).resource_spans[0].scope_spans[0].spans[-1] in [
        span for r in received for span in r.resource_spans[0].scope_spans[0].spans]


def test_the_boundary_takes_step_totals_the_finisher_made(rank_env):  # noqa: F811
    """The usual step boundary takes the next step's totals from those the finisher
    made when it last drained (about as many as it drained), and the figures of those
    steps are complete."""

    rank_env.setenv("FLARE_DETAIL_EVERY", "0")
    provider, exporter = make_provider(batch_delay_ms=60_000)
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
    runtime = flare_instrumentation.active_runtime()
    try:
        train(4)
        provider.force_flush()  # drains: the finisher's part, here on this thread
        spare = list(runtime.finisher.spare_totals)
        assert len(spare) >= 3 and all(t.seq_start is None and not t.pending for t in spare)
        train(3)  # three boundaries: the last three made, newest first
        assert runtime.finisher.spare_totals == spare[:-3]
        assert runtime.totals is spare[-3]
        provider.force_flush()
    finally:
        instrumentor.uninstrument()
    spans = finished(exporter, semconv.SPAN_STEP)
    assert len(spans) == 7
    # one fetch a step (the one after a loader's last batch, which ends its loop, too)
    assert [s.attributes[semconv.STEP_DATALOADER_COUNT] for s in spans] == [1, 1, 1, 1, 2, 1, 1]
    assert all(s.attributes[semconv.STEP_BACKWARD_MS] > 0 for s in spans)
