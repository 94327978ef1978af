"""OTLP trace requests written as protobuf bytes directly, for Flare's span exporter.

The OpenTelemetry SDK's OTLP encoder builds a protobuf object for every attribute key,
value and span, then serializes the tree: measured here ~65 µs per `train.step` span
(19 attributes), every step of every rank, on the exporter thread. That is most of the
CPU Flare adds to a rank after the hooks themselves. This module writes the same
`ExportTraceServiceRequest` straight to bytes (~10x less work per span).

Exactness over speed: a span is written here only when every part of it is a kind this
writer knows (plain str/bool/int/float/bytes/None attribute values and homogeneous
sequences of them, no events, no links); any other span is encoded by the SDK's own
span encoder and its bytes spliced in, so a request always carries exactly what
`encode_spans` would put in it (the tests parse both and compare). Spans are grouped
by resource and instrumentation scope as the SDK groups them: by equality, in order of
first appearance. `SdkEncodingCheck` verifies at start-up that the installed SDK
encodes a probe set exactly as this module does, so a future SDK that changes its
encoding makes Flare's exporter fall back to the SDK encoder instead of diverging.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Sequence

from flare.wire.otlp_values import Unsupported, write_attributes
from flare.wire.otlp_values import length_delimited as _field
from flare.wire.otlp_values import varint as _varint

_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags masks

_log = logging.getLogger(__name__)


_KINDS: dict | None = None


def _kind_field(kind) -> bytes:
    global _KINDS
    if _KINDS is None:
        from opentelemetry.trace import SpanKind

        # SDK SpanKind -> OTLP Span.SpanKind (INTERNAL = 1 ... CONSUMER = 5)
        _KINDS = {member: b"\x30" + _varint(member.value + 1) for member in SpanKind}
    field = _KINDS.get(kind)
    if field is None:
        raise Unsupported
    return field


def _identity_fields(context) -> list[bytes]:
    """Span.trace_id, span_id and trace_state of a span's context (fields 1-3)."""
    out = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
           b"\x12\x08", context.span_id.to_bytes(8, "big")]
    trace_state = context.trace_state
    if trace_state:
        out.append(_field(b"\x1a", ",".join(
            [f"{key}={value}" for key, value in trace_state.items()]).encode()))
    return out


def encode_span(span) -> bytes:
    """The serialized OTLP `Span` of one finished SDK span (raises Unsupported)."""
    if span.events or span.links:
        raise Unsupported
    context = span.get_span_context()
    parent = span.parent
    out = _identity_fields(context)
    if parent is not None:
        out.append(b"\x22\x08")
        out.append(parent.span_id.to_bytes(8, "big"))
    name = span.name
    if name:
        out.append(_field(b"\x2a", name.encode()))
    out.append(_kind_field(span.kind))
    if span.start_time:
        out.append(b"\x39" + _pack_fixed64(span.start_time))
    if span.end_time:
        out.append(b"\x41" + _pack_fixed64(span.end_time))
    attributes = span.attributes
    if attributes:
        out.append(write_attributes(attributes, 0x4A))
    for tag, count in ((b"\x50", span.dropped_attributes), (b"\x60", span.dropped_events),
                       (b"\x70", span.dropped_links)):
        if count:
            out.append(tag + _varint(count))
    status = span.status
    if status is not None:
        code = status.status_code.value
        message = status.description
        body = (_field(b"\x12", message.encode()) if message else b"") + (
            b"\x18" + _varint(code) if code else b"")
        out.append(_field(b"\x7a", body))
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    out.append(b"\x85\x01" + _pack_fixed32(flags))
    return b"".join(out)


_INTERNAL = b"\x30\x01"  # Span.kind: SPAN_KIND_INTERNAL (the SDK's INTERNAL + 1)
_UNSET_STATUS = b"\x7a\x00"  # Span.status: an empty Status (code UNSET, no message)
_NAMES: dict[str, bytes] = {}  # span name -> its name and kind fields


def encode_finished(name: str, context, parent, attributes, start_ns: int,
                    end_ns: int) -> bytes:
    """`encode_span`'s bytes for the span `finished_span.FinishedSpans` hands over: a
    `ReadableSpan(name, context, parent, attributes=attributes, kind=INTERNAL,
    start_time, end_time)` (status UNSET, no events, links or dropped attributes;
    `parent` is set). Written from the values themselves, without the span object
    (raises Unsupported, UnicodeEncodeError or OverflowError as `encode_span` does)."""
    out = _identity_fields(context)
    out.append(b"\x22\x08")
    out.append(parent.span_id.to_bytes(8, "big"))
    named = _NAMES.get(name)
    if named is None:
        if type(name) is not str:
            raise Unsupported
        named = (_field(b"\x2a", name.encode()) if name else b"") + _INTERNAL
        if len(_NAMES) < 1024:  # span names are few
            _NAMES[name] = named
    out.append(named)
    if start_ns:
        out.append(b"\x39" + _pack_fixed64(start_ns))
    if end_ns:
        out.append(b"\x41" + _pack_fixed64(end_ns))
    if attributes:
        out.append(write_attributes(attributes, 0x4A))
    out.append(_UNSET_STATUS)
    out.append(_REMOTE_FLAGS if parent.is_remote else _LOCAL_FLAGS)
    return b"".join(out)


_REMOTE_FLAGS = b"\x85\x01" + _pack_fixed32(_HAS_IS_REMOTE | _IS_REMOTE)
_LOCAL_FLAGS = b"\x85\x01" + _pack_fixed32(_HAS_IS_REMOTE)


class EncodedSpan:
    """A finished span handed to the batch processors already written as its OTLP
    `Span` message (`otlp`, from `encode_finished`), with the fields the batch
    processor and `encode_request` read. Only for processors whose exporters write
    their requests with this module (`FinishedSpans` checks): building a `ReadableSpan`
    and reading it back a few seconds later, after the training has evicted it from
    the caches, cost the finisher more than writing the bytes at once."""

    __slots__ = ("attributes", "context", "end_time", "instrumentation_scope", "name",
                 "otlp", "parent", "resource", "start_time")

    def __init__(self, name, context, parent, resource, instrumentation_scope, attributes,
                 start_time, end_time, otlp):
        self.name = name
        self.context = context
        self.parent = parent
        self.resource = resource
        self.instrumentation_scope = instrumentation_scope
        self.attributes = attributes
        self.start_time = start_time
        self.end_time = end_time
        self.otlp = otlp

    def get_span_context(self):
        return self.context


class _Groups:
    """Spans grouped by resource, then scope, by equality in order of first appearance
    (what the SDK's dict of dicts does), looking each object up by identity first."""

    def __init__(self):
        self.resources: list[tuple[object, list[tuple[object, list[bytes]]]]] = []
        self._resource_by_id: dict[int, list] = {}
        self._scope_by_id: dict[tuple[int, int], list[bytes]] = {}

    def spans_of(self, resource, scope) -> list[bytes]:
        found = self._scope_by_id.get((id(resource), id(scope)))
        if found is not None:
            return found
        scopes = self._resource_by_id.get(id(resource))
        if scopes is None:
            scopes = next((s for r, s in self.resources if r == resource), None)
            if scopes is None:
                scopes = []
                self.resources.append((resource, scopes))
            self._resource_by_id[id(resource)] = scopes
        spans = next((b for s, b in scopes if s == scope), None)
        if spans is None:
            spans = []
            scopes.append((scope, spans))
        self._scope_by_id[(id(resource), id(scope))] = spans
        return spans


class _EncodedOnce:
    """The SDK's encoding of a resource or an instrumentation scope, kept per object:
    a rank's spans share one of each for the life of the process, and the resource
    (a dozen attributes through the SDK's protobuf objects) costs ~25 µs per request
    to encode again. Both are immutable once built; the cache holds the objects
    themselves, so an id is never reused while its entry lives."""

    def __init__(self, limit: int = 64):
        self._entries: dict[int, tuple[object, bytes]] = {}
        self._limit = limit

    def get(self, value, encode) -> bytes:
        entry = self._entries.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
        encoded = encode(value).SerializeToString()
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[id(value)] = (value, encoded)
        return encoded


_resources = _EncodedOnce()
_scopes = _EncodedOnce()


def encode_request(spans: Sequence, fast: bool = True) -> bytes:
    """The serialized `ExportTraceServiceRequest` for `spans`, equal to the SDK's
    `encode_spans(spans)` once parsed. `fast=False` encodes every span with the SDK,
    except those handed over already written (`EncodedSpan`), taken as they are."""
    from flare.wire.sdk_adapter import sdk_span_encoders

    encode_resource, encode_scope, sdk_encode_span = sdk_span_encoders()

    groups = _Groups()
    for span in spans:
        encoded = None
        if type(span) is EncodedSpan:
            encoded = span.otlp
        elif fast:
            try:
                encoded = encode_span(span)
            except (Unsupported, UnicodeEncodeError, AttributeError, TypeError, OverflowError):
                encoded = None
        if encoded is None:
            encoded = sdk_encode_span(span).SerializeToString()
        groups.spans_of(span.resource, span.instrumentation_scope or None).append(encoded)
    out = []
    for resource, scopes in groups.resources:
        body = [_field(b"\x0a", _resources.get(resource, encode_resource))]
        for scope, encoded_spans in scopes:
            scope_body = [_field(b"\x0a", _scopes.get(scope, encode_scope))]
            scope_body.extend([_field(b"\x12", encoded) for encoded in encoded_spans])
            if scope is not None and scope.schema_url:
                scope_body.append(_field(b"\x1a", scope.schema_url.encode()))
            body.append(_field(b"\x12", b"".join(scope_body)))
        if resource.schema_url:
            body.append(_field(b"\x1a", resource.schema_url.encode()))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


def probe_spans() -> list:
    """Spans covering what encode_span writes itself (every attribute kind, remote and
    local parents, statuses, trace state, two resources and scopes)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState
    from opentelemetry.trace.status import Status, StatusCode

    resources = (Resource({"service.name": "probe", "flare.rank": 3}, "https://schema/1"),
                 Resource({"service.name": "probe", "flare.rank": 4}))
    scopes = (InstrumentationScope("flare.probe", "1.0", "https://schema/s"), None)
    attributes = {"f": 1.25, "neg": -7, "big": _INT64_MAX, "s": "ß-x", "t": True, "no": False,
                  "zero": 0, "empty": "", "fl": (0.5, -2.0), "il": (1, -2, 3), "sl": ("a", ""),
                  "bl": (True, False), "nl": (), "b": b"\x00\x01"}
    spans = []
    for i, (kind, status) in enumerate((
            (SpanKind.INTERNAL, Status(StatusCode.UNSET)),
            (SpanKind.SERVER, Status(StatusCode.ERROR, "it failed")),
            (SpanKind.CLIENT, Status(StatusCode.OK)),
            (SpanKind.CONSUMER, Status(StatusCode.ERROR)))):
        trace_state = TraceState([("k", "v"), ("x", "y")]) if i == 1 else TraceState()
        context = SpanContext(0x0123456789ABCDEF0123456789ABCDEF + i, 0x1122334455667788 + i,
                              is_remote=False, trace_flags=TraceFlags(1), trace_state=trace_state)
        parent = (None if i == 3 else SpanContext(context.trace_id, 0xAB + i, is_remote=i == 0,
                                                  trace_flags=TraceFlags(1)))
        spans.append(ReadableSpan(
            f"probe.{i}" if i != 2 else "", context=context, parent=parent,
            resource=resources[i % 2], attributes=dict(attributes) if i != 2 else {},
            kind=kind, start_time=1_700_000_000_000_000_000 + i,
            end_time=1_700_000_000_500_000_000 + i if i != 3 else None,
            instrumentation_scope=scopes[i // 2 % 2], status=status))
    return spans


def matches_sdk(spans: Sequence) -> bool:
    """Whether this module's request for `spans` parses to what the SDK builds."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    return ExportTraceServiceRequest.FromString(encode_request(spans)) == encode_spans(spans)


@functools.lru_cache(maxsize=1)
def writer_matches_sdk() -> bool:
    """Whether the installed SDK encodes the probe spans byte for byte as this writer
    does (checked once per process); both exporters use the SDK's encoder if not."""
    from flare.wire.sdk_adapter import internals_ok

    if not internals_ok():  # the probe reads the SDK's internal encoder
        return False
    try:
        same = matches_sdk(probe_spans())
    except Exception as error:  # an SDK whose internals moved: use it as it is
        _log.info("flare: the OTLP writer cannot check itself against this SDK (%r); "
                  "spans are encoded by the SDK", error)
        return False
    if not same:
        _log.info("flare: this SDK encodes spans differently from Flare's OTLP writer; "
                  "spans are encoded by the SDK")
    return same
