"""Hand a finished `train.step` span straight to the SDK's span processors.

Creating a span through `Tracer.start_span` costs the training thread most of its
per-step overhead: the SDK validates and copies every attribute, builds a mutable
`Span`, runs each processor's `on_start` and, at `end()`, freezes it into a
`ReadableSpan`. Measured inside a 4-rank gloo job (thread CPU time, 300 steps):
~170 µs of the ~400 µs Flare spent at a step boundary. The step span is created when
the step is already over, with attributes Flare built itself (plain str, bool, int,
float and lists of one of them), so none of that work buys anything: this module
builds the `ReadableSpan` the SDK would have built and calls the processors' `on_end`.

It is used only when that is indistinguishable from the SDK path:
- the tracer is the OpenTelemetry SDK's, enabled, and its processors are the SDK's
  batch/simple ones (or subclasses that keep their no-op `on_start`/`_on_ending`):
  a processor that does work in `on_start` (e.g. one copying baggage into attributes)
  would miss the span, so with one of those `FinishedSpans.for_tracer` returns None and
  the runtime keeps the SDK path;
- the sampler still decides (`should_sample`, same arguments as the SDK), and its
  attributes and trace state are applied;
- the span id comes from the provider's id generator;
- attributes set by listeners (`set_attribute` on the pending span) go through the
  SDK's own attribute cleaning, as they would on a real span.
"""

from __future__ import annotations

import logging
import threading

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from flare.instrumentation.otlp_encoding import EncodedSpan, Unsupported, encode_finished
from flare.wire import sdk_adapter as sdk

_log = logging.getLogger(__name__)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


# While the finisher flushes the batch processors every period, their workers wake on
# their own only every this many periods (or when a batch is full).
_HELD_FACTOR = 12

def _noop_processor_hooks():
    """The `on_start` / `_on_ending` implementations known to do nothing."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    starts = {SpanProcessor.on_start, BatchSpanProcessor.on_start, SimpleSpanProcessor.on_start}
    endings = {sdk.on_ending(cls) for cls in (SpanProcessor, BatchSpanProcessor, SimpleSpanProcessor)}
    return starts, endings - {None}


_FIRST_CONTEXT_LOCK = threading.Lock()


class PendingStepSpan(NonRecordingSpan):
    """The step span while its listeners run: a context to parent children with, and
    `set_attribute(s)` that land in the attributes the span will be emitted with. The
    context is computed on first use (most steps never need it)."""

    def __init__(self, context_factory, attributes: dict):
        # NonRecordingSpan.__init__ only stores the context: done here, without the call
        # (this runs on the training thread at every step boundary)
        self._context = None
        self._context_factory = context_factory
        self.pending_attributes = attributes

    def get_span_context(self) -> SpanContext:
        context = self._context
        if context is None:
            # The finisher and a listener's own thread (a kernel window's conversion)
            # may both ask first: two ids made at once gave the window's kernels a
            # parent the step span never had. Rare, so one lock for all is enough.
            with _FIRST_CONTEXT_LOCK:
                context = self._context
                if context is None:
                    context = self._context = self._context_factory()
        return context

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value) -> None:
        self.set_attributes({key: value})

    def set_attributes(self, attributes) -> None:
        # The SDK's own cleaning (types, sequences to tuples), as on a real span.
        self.pending_attributes.update(
            BoundedAttributes(attributes=attributes, immutable=False).items())


class DrainOnFlush:
    """Put first among the provider's processors when step spans are deferred: its
    `force_flush` and `shutdown` hand the deferred step spans over, so the processors
    after it (the batch processor) flush or shut down with them. Does nothing per span.
    Where it could only be appended, it flushes the processors before it again."""

    def __init__(self, drain):
        self._drain = drain
        self._provider_processors = None

    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:
        pass

    def on_end(self, span) -> None:
        pass

    def shutdown(self) -> None:
        self._drain()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if not self._drain():
            return True
        done = True
        for processor in self._provider_processors() if self._provider_processors else ():
            if processor is self:
                break  # the ones after it flush next, with the drained spans
            done = processor.force_flush(timeout_millis) and done
        return done


def _writes_otlp(processor) -> bool:
    """A batch processor whose exporter writes its requests with otlp_encoding (and so
    takes EncodedSpan): Flare's OTLP exporters, where their writer matches the SDK."""
    return getattr(sdk.span_exporter(processor), "writes_otlp_encoding", False) is True


def _keeps_sampled_remote(sampler):
    """`sampler` when it is the SDK's ParentBased with ALWAYS_ON for sampled remote
    parents (the default sampler, `parentbased_always_on`), else None."""
    return sampler if sdk.keeps_sampled_remote(sampler) else None


class FinishedSpans:
    """Emits finished spans of one SDK tracer without the SDK's per-span machinery."""

    def __init__(self, tracer):
        from opentelemetry.sdk.trace import ReadableSpan

        self._readable = ReadableSpan
        self._tracer = tracer
        self._processor = tracer.span_processor
        self._scope = sdk.instrumentation_scope(tracer)
        self._checked: tuple | None = None
        self._held: dict = {}  # batch processor -> its own schedule delay, while held
        self._asynchronous = False
        # Every processor hands its spans to an exporter that writes its requests with
        # otlp_encoding (Flare's `flare_otlp`): spans are handed over as EncodedSpan.
        self._pre_encode = False
        self._starts, self._endings = _noop_processor_hooks()
        # the tracer's sampler once it is known to keep every child of a sampled remote
        # parent unchanged (checked after the first span it sampled)
        self._keeps_sampled_remote = None

    @classmethod
    def for_tracer(cls, tracer) -> FinishedSpans | None:
        try:
            from opentelemetry.sdk.trace import Tracer as SdkTracer
        except ImportError:
            return None
        if type(tracer) is not SdkTracer:
            return None
        if not sdk.internals_ok():  # an SDK Flare was not tested with: Tracer.start_span
            return None
        emitter = cls(tracer)
        return emitter if emitter.usable() else None

    def usable(self) -> bool:
        """True while the SDK path would do nothing more than this one (re-checked
        cheaply per span: processors can be added to a provider at any time)."""
        processors = sdk.span_processors(self._processor)
        if processors is None:
            return False
        if processors is self._checked:
            return True
        for processor in processors:
            if isinstance(processor, DrainOnFlush):
                continue
            kind = type(processor)
            if (kind.on_start not in self._starts
                    or sdk.on_ending(kind) not in self._endings | {None}):
                _log.debug("flare: span processor %r has its own on_start; step spans "
                           "take the SDK path", processor)
                return False
        if not sdk.tracer_enabled(self._tracer):
            return False
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._asynchronous = bool(processors) and all(
            isinstance(p, (BatchSpanProcessor, DrainOnFlush)) for p in processors)
        self._pre_encode = self._asynchronous and all(
            isinstance(p, DrainOnFlush) or _writes_otlp(p) for p in processors)
        self._checked = processors
        return True

    def _batch_processors(self) -> list:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        return [p for p in sdk.span_processors(self._processor) or ()
                if isinstance(p, BatchSpanProcessor)]

    def unchanged(self) -> bool:
        """Whether the provider's processors are the ones `usable()` last checked."""
        return sdk.span_processors(self._processor) is self._checked

    def batch_delay_s(self) -> float | None:
        """The shortest schedule delay of the provider's batch processors, in seconds
        (None if there is none or it cannot be read)."""
        import os

        delays = []
        for processor in self._batch_processors():
            delay = sdk.batch_schedule_s(processor)
            if delay is None:
                try:
                    delay = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")) / 1e3
                except ValueError:
                    delay = 5.0
            delays.append(delay)
        return min(delays) if delays else None

    def flush_batches(self, period_s: float | None = None) -> None:
        """Export what the batch processors hold now, on the calling thread (the
        finisher's, right after it handed them the step spans): the spans leave within
        one finisher period instead of a period plus the processors' own delay.

        With `period_s` (the caller flushes that often), each processor's own worker
        is told to wake only every `_HELD_FACTOR` periods: woken on its schedule as
        well, it found what other threads had emitted since the last flush (a
        heartbeat, a detail step's children) and sent it in a request of its own, from
        a cold thread: 17 µs of CPU per rank-step on the 80 ms benchmark job. It still
        wakes at once when its queue reaches a batch; `release_batch_schedules` gives
        the schedule back."""
        if not self.asynchronous():
            self.release_batch_schedules()
            return
        for processor in self._batch_processors():
            processor.force_flush()
            if period_s:
                self._hold_schedule(processor, period_s)

    def _hold_schedule(self, processor, period_s: float) -> None:
        # (a worker already held waits longer than period_s: not held twice)
        held = sdk.hold_batch_schedule(processor, _HELD_FACTOR * period_s, period_s)
        if held is not None:
            worker, delay = held
            self._held[worker] = delay

    def release_batch_schedules(self) -> None:
        """The batch processors' own schedules, as they were before `flush_batches`."""
        if not self._held:
            return
        held, self._held = self._held, {}
        for worker, delay in held.items():
            sdk.release_batch_schedule(worker, delay)

    def asynchronous(self) -> bool:
        """Usable, and every processor exports in batches from its own thread: handing
        a span over a fraction of a second later changes nothing an exporter sees."""
        return self.usable() and self._asynchronous

    def add_drain_on_flush(self, provider, drain) -> None:
        """Make the provider's own force_flush drain deferred spans first (one hook
        per provider, re-pointed when the instrumentation is installed again)."""
        hook = getattr(provider, "_flare_drain_on_flush", None)
        if hook is not None:
            hook._drain = drain
            return
        hook = DrainOnFlush(drain)
        processor = self._processor
        hook._provider_processors = lambda: sdk.span_processors(processor) or ()
        if not sdk.prepend_span_processor(provider, processor, hook):
            return
        provider._flare_drain_on_flush = hook
        self._checked = None  # the processor tuple changed

    def new_span_id(self) -> int:
        return self._tracer.id_generator.generate_span_id()

    def emit(self, name: str, parent: SpanContext, span_id: int, attributes: dict,
             start_ns: int, end_ns: int) -> None:
        """Sample and hand one finished INTERNAL span (a child of `parent`) to the
        processors."""
        tracer = self._tracer
        sampler = tracer.sampler
        if (sampler is self._keeps_sampled_remote and parent.is_remote
                and parent.trace_flags.sampled):
            # the SDK's default sampler (parent-based, always-on below a sampled parent)
            # keeps it, with the parent's trace state, and adds nothing: its verdict,
            # without building a parent context to ask
            context = SpanContext(parent.trace_id, span_id, is_remote=False,
                                  trace_flags=_SAMPLED, trace_state=parent.trace_state)
        else:
            parent_context = trace.set_span_in_context(NonRecordingSpan(parent))
            result = sampler.should_sample(parent_context, parent.trace_id, name,
                                           SpanKind.INTERNAL, attributes, ())
            if not result.decision.is_recording():
                return
            if result.attributes:
                attributes.update(result.attributes)
            context = SpanContext(parent.trace_id, span_id, is_remote=False,
                                  trace_flags=_SAMPLED if result.decision.is_sampled()
                                  else _NOT_SAMPLED,
                                  trace_state=result.trace_state)
            self._keeps_sampled_remote = _keeps_sampled_remote(sampler)
        processor = self._processor
        # usable() re-checks the processors only when they changed, and then decides
        # _pre_encode again: hence the second look at it
        if self._pre_encode and self.usable() and self._pre_encode:
            try:
                otlp = encode_finished(name, context, parent, attributes, start_ns, end_ns)
            except (Unsupported, UnicodeEncodeError, OverflowError):
                otlp = None  # the exporter's own path decides, as for any span
            if otlp is not None:
                processor.on_end(EncodedSpan(name, context, parent, tracer.resource,
                                             self._scope, attributes,
                                             start_ns, end_ns, otlp))
                return
        span = self._readable(name, context=context, parent=parent,
                              resource=tracer.resource, attributes=attributes,
                              kind=SpanKind.INTERNAL, start_time=start_ns, end_time=end_ns,
                              instrumentation_scope=self._scope)
        processor.on_end(span)
