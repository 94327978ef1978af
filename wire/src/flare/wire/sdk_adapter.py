"""Every use Flare makes of OpenTelemetry's non-public names, in one place, behind one
version gate.

Where the SDK has no public API for what the always-on path needs, Flare reaches into
it — and only here: the tracer's span processors (`finished_span.py`: step spans handed
to them as built, the batch processors' schedules held, a flush hook put first), the
provider's resource (`torch_training._adopt_flare_resource`), the exporters behind the
processors and metric readers (`flush_deadline.py`), the OTLP exporters' encoder
(`otlp_encoding`) and HTTP transport (`otlp_http`). Each accessor below answers with the
public fallback (None, an empty tuple, False) when the name is missing, and the callers
ask `internals_ok()` first: outside the SDK versions the compatibility check runs
(`tests/compat/check_versions.py`: the declared floor and the newest release) the public
path is taken instead:

- step spans made with `Tracer.start_span` / `end` (measured ~170 µs per step span in
  situ, against ~35 µs handed over as built: `docs/benchmark-history.md`);
- spans encoded by the SDK's OTLP encoder (58.7–65.9 µs per `train.step` span, against
  12.8–13.2 µs with Flare's writer);
- Flare's resource attributes on every span instead of the resource (when the `flare`
  resource detector is not configured);
- no export deadline on a flush at exit, and the batch processors on their own schedule.

One warning line says so, once per process. Torch outside `instruments` (`torch>=2.1`)
is said the same way by the resource detector, since the auto-instrumentation then skips
the instrumentor without a word.

The OTLP exporters' private parts are reached here too: the HTTP exporter's transport
argument, client, size limit and export metrics (`otlp_http`, which writes the request
itself and then does what the SDK's export does), and the gRPC exporter's request hook,
channel and stub (`otlp_grpc`). Callers take them only where
`otlp_encoding.writer_matches_sdk()` (which asks `internals_ok()`) holds, else the SDK
exporter runs as it is. The beta OpAMP client's package is itself named
`opentelemetry._opamp` (`opamp()` below).
"""

from __future__ import annotations

import functools
import logging
import re

_log = logging.getLogger(__name__)

# The SDK minor versions the compatibility check runs (1.28 floor, 1.45 newest).
TESTED = ((1, 28), (1, 45))
TORCH_FLOOR = (2, 1)


def major_minor(text: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def sdk_version() -> tuple[int, int] | None:
    try:
        from opentelemetry.sdk.version import __version__
    except ImportError:
        return None
    return major_minor(__version__)


@functools.cache
def internals_ok() -> bool:
    """Whether this SDK is one Flare's uses of its internals were tested with; outside,
    one warning and the public API everywhere."""
    version = sdk_version()
    if version is not None and TESTED[0] <= version <= TESTED[1]:
        return True
    shown = "unknown" if version is None else f"{version[0]}.{version[1]}"
    _log.warning("flare: opentelemetry-sdk %s is outside the versions Flare is tested with "
                 "(%d.%d to %d.%d); it uses the SDK's public API only (slower step spans "
                 "and encoding, same data)", shown, *TESTED[0], *TESTED[1])
    return False


@functools.cache
def torch_supported() -> bool:
    """False, with one warning, when the installed torch is older than the instrumentor's
    `instruments` requirement (the auto-instrumentation then skips it silently)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return True
    try:
        installed = major_minor(version("torch"))
    except PackageNotFoundError:
        return True  # no torch: nothing to instrument, nothing to say
    if installed is None or installed >= TORCH_FLOOR:
        return True
    _log.warning("flare: torch %d.%d is older than %d.%d, which Flare needs: the ranks are "
                 "not instrumented and send no steps", *installed, *TORCH_FLOOR)
    return False


# ---------------------------------------------------------------- tracer and provider


def span_processors(multi) -> tuple | None:
    """The processors of an SDK provider's multi span processor (a tuple the SDK
    replaces whenever one is added), or None."""
    return getattr(multi, "_span_processors", None)


def provider_span_processors(tracer_provider) -> tuple:
    """The span processors of a TracerProvider, () if unknown."""
    return span_processors(getattr(tracer_provider, "_active_span_processor", None)) or ()


def prepend_span_processor(provider, multi, processor) -> bool:
    """Put `processor` first among the provider's (under the multi processor's lock, as
    the SDK's add_span_processor updates the tuple), else append it publicly; False if
    neither can be done."""
    lock = getattr(multi, "_lock", None)
    if lock is not None and isinstance(span_processors(multi), tuple):
        with lock:
            multi._span_processors = (processor, *multi._span_processors)
        return True
    if getattr(provider, "add_span_processor", None) is not None:
        provider.add_span_processor(processor)
        return True
    return False


def on_ending(processor_class):
    """A span processor class's `_on_ending` hook, or None (an SDK without it)."""
    return getattr(processor_class, "_on_ending", None)


def tracer_enabled(tracer) -> bool:
    """Whether an SDK tracer emits spans (False once its provider is disabled)."""
    enabled = getattr(tracer, "_is_enabled", None)
    return enabled is None or bool(enabled())


def instrumentation_scope(tracer):
    """The scope an SDK tracer gives its spans."""
    return getattr(tracer, "_instrumentation_scope", None)


def keeps_sampled_remote(sampler) -> bool:
    """Whether `sampler` is the SDK's ParentBased with ALWAYS_ON for sampled remote
    parents (the default sampler, `parentbased_always_on`)."""
    try:
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
    except ImportError:
        return False
    return type(sampler) is ParentBased and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON


def provider_resource(provider):
    """An SDK TracerProvider's resource (which its tracers take when created), or None."""
    return getattr(provider, "_resource", None)


def set_provider_resource(provider, resource) -> None:
    """Give the provider `resource` (there is no public setter); tracers made before
    keep the old one."""
    provider._resource = resource


# ---------------------------------------------------------------- batch processors


def _batch_worker(processor):
    """The worker behind a BatchSpanProcessor (SDK >= 1.33), or None."""
    return getattr(processor, "_batch_processor", None)


def span_exporter(processor):
    """The exporter a span processor hands its spans to, or None."""
    exporter = getattr(processor, "span_exporter", None)
    if exporter is None:
        exporter = getattr(_batch_worker(processor), "_exporter", None)
    return exporter


def batch_schedule_s(processor) -> float | None:
    """A batch processor's schedule delay in seconds, or None if it cannot be read."""
    delay = getattr(_batch_worker(processor), "_schedule_delay", None)
    if delay is None:  # older SDKs keep it on the processor, in milliseconds
        millis = getattr(processor, "schedule_delay_millis", None)
        delay = millis / 1e3 if isinstance(millis, (int, float)) else None
    return delay


def hold_batch_schedule(processor, delay_s: float, at_most_s: float):
    """Set a batch processor's worker to wake every `delay_s` when its own delay is at
    most `at_most_s`; returns (worker, its delay) to give back, else None."""
    worker = _batch_worker(processor)
    delay = getattr(worker, "_schedule_delay", None)
    if worker is None or not isinstance(delay, (int, float)) or not 0 < delay <= at_most_s:
        return None
    worker._schedule_delay = delay_s
    return worker, delay


def release_batch_schedule(worker, delay_s: float) -> None:
    """Give a held worker its delay back, and restart its wait in progress (the long one)."""
    worker._schedule_delay = delay_s
    awaken = getattr(worker, "_worker_awaken", None)
    if awaken is not None:
        awaken.set()


# ---------------------------------------------------------------- metrics and logs


# Where the SDK's batch workers log an export that raised ("Exception while exporting ...").
EXPORT_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export",
                  "opentelemetry.sdk.metrics._internal.export")


def metric_exporters(meter_provider) -> list:
    """The exporters behind an SDK MeterProvider's metric readers, [] if unknown."""
    config = getattr(meter_provider, "_sdk_config", None)
    readers = getattr(config, "metric_readers", ()) or ()
    return [r._exporter for r in readers if getattr(r, "_exporter", None) is not None]


# ---------------------------------------------------------------- OTLP exporters


@functools.cache
def sdk_span_encoders():
    """The SDK's own OTLP encoders: (resource, instrumentation scope, span), each
    object → protobuf message. Its internal ones on a tested SDK; elsewhere the same
    three read out of the public `encode_spans` of one span (`public_span_encoders`)."""
    if internals_ok():
        try:
            from opentelemetry.exporter.otlp.proto.common._internal import (
                _encode_instrumentation_scope,
                _encode_resource,
            )
            from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import (
                _encode_span,
            )
        except ImportError:
            pass
        else:
            return _encode_resource, _encode_instrumentation_scope, _encode_span
    return public_span_encoders()


def public_span_encoders():
    """(resource, scope, span) encoders over the SDK's public `encode_spans`: each
    encodes a request of one span and takes its part (a stand-in span carries a
    resource or a scope alone). A request per call: slower, the same messages."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    context = SpanContext(trace_id=1, span_id=1, is_remote=False)

    def part(span):
        return encode_spans([span]).resource_spans[0]

    def encode_resource(resource):
        return part(ReadableSpan(name="", context=context, resource=resource)).resource

    def encode_scope(scope):
        return part(ReadableSpan(name="", context=context, resource=Resource({}),
                                 instrumentation_scope=scope)).scope_spans[0].scope

    def encode_span(span):
        return part(span).scope_spans[0].spans[0]

    return encode_resource, encode_scope, encode_span


def http_transport_classes():
    """The OTLP/HTTP exporter's pluggable transport (BaseHTTPResult, BaseHTTPTransport),
    opentelemetry-exporter-otlp >= 1.4x; (None, None) on an SDK without it."""
    try:
        from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport
    except ImportError:
        return None, None
    return BaseHTTPResult, BaseHTTPTransport


def accepts_transport(exporter_class) -> bool:
    """Whether an OTLP/HTTP exporter class takes a `_transport` argument."""
    import inspect

    try:
        return "_transport" in inspect.signature(exporter_class.__init__).parameters
    except (TypeError, ValueError):
        return False


def offer_transport(kwargs: dict, make) -> None:
    """Give an OTLP/HTTP exporter's constructor the transport `make()` builds, through its
    private `_transport` argument, unless the caller gave one (callers ask
    `accepts_transport` first)."""
    if "_transport" not in kwargs:
        kwargs["_transport"] = make()


def http_export_parts(exporter) -> tuple | None:
    """What the SDK's OTLP/HTTP span exporter uses after encoding a request: (its client,
    whose `export(bytes)` sends with retries; its request size limit; its export metrics,
    `export_operation(n)`), or None where the exporter is of another shape or the SDK
    is outside the tested versions (the exporter then exports as the SDK does)."""
    if not internals_ok():
        return None
    client = getattr(exporter, "_client", None)
    metrics = getattr(exporter, "_metrics", None)
    if (client is None or not hasattr(exporter, "_max_request_size")
            or not hasattr(metrics, "export_operation")):
        return None
    return client, exporter._max_request_size, metrics


def exporter_shut_down(exporter) -> bool:
    """Whether an SDK OTLP exporter's `shutdown()` has run."""
    return bool(getattr(exporter, "_shutdown", False))


def route_grpc_encoding(exporter_class, method_name: str) -> None:
    """Make the SDK OTLP/gRPC exporter's request hook (`_translate_data`, which its export
    calls with the spans) the method `method_name` of `exporter_class`, a subclass;
    outside the tested SDK versions the SDK's own hook stays (the public path)."""
    if internals_ok():
        exporter_class._translate_data = getattr(exporter_class, method_name)


def send_grpc_bytes(exporter, stub_class) -> bool:
    """Have an SDK OTLP/gRPC exporter send requests through `stub_class(channel)` (also
    what its reconnection builds its client from); False, nothing changed, where the
    exporter keeps its channel and stub under other names, or the SDK is outside the
    tested versions."""
    if not internals_ok():
        return False
    channel = getattr(exporter, "_channel", None)
    if channel is None or not hasattr(exporter, "_stub") or not hasattr(exporter, "_client"):
        return False
    exporter._stub = stub_class
    exporter._client = stub_class(channel)
    return True


# ---------------------------------------------------------------- OpAMP


def opamp():
    """The beta OpAMP client (`opentelemetry-opamp-client`, whose package is named
    `opentelemetry._opamp`): its client, messages, HTTP transport base and exception."""
    import types

    from opentelemetry._opamp import OpAMPClient, messages
    from opentelemetry._opamp.transport.base import HttpTransport
    from opentelemetry._opamp.transport.exceptions import OpAMPException

    return types.SimpleNamespace(OpAMPClient=OpAMPClient, messages=messages,
                                 HttpTransport=HttpTransport, OpAMPException=OpAMPException)


def opamp_protocol():
    """The OpAMP protocol's messages (`opamp_pb2`), as the OpAMP client ships them."""
    from opentelemetry._opamp.proto import opamp_pb2

    return opamp_pb2
