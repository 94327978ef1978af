"""OTLP/JSON <-> protobuf messages, with the id encoding the OTLP spec prescribes.

OTLP/JSON is the proto3 JSON mapping with two exceptions: trace and span ids are hex
strings (proto3 JSON would use base64 for `bytes`), and enums are integers. The
protobuf library's `json_format` alone therefore misreads every id, so ids are
re-encoded between hex and base64 around it. Unknown fields are ignored, as the spec
requires of receivers.
"""

from __future__ import annotations

import base64
import json
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from flare.collector.errors import MalformedPayload

M = TypeVar("M", bound=Message)

# Field names as they appear in OTLP/JSON (lowerCamelCase); proto3 JSON parsers also
# accept the original snake_case names, so both are handled.
_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")

_DATA_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "exponential_histogram", "summary")


def _hex_to_b64(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise MalformedPayload(f"{key} must be a hex string, got {type(value).__name__}")
    if value == "":
        return ""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise MalformedPayload(f"{key} {value[:40]!r} is not hex") from None
    return base64.b64encode(raw).decode("ascii")


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _convert_ids(obj: dict[str, Any], convert) -> None:
    for key in _ID_KEYS:
        if key in obj:
            obj[key] = convert(obj[key], key)


def _walk_spans(doc: dict[str, Any], convert) -> None:
    for rs in _list(doc, "resourceSpans", "resource_spans"):
        for ss in _list(rs, "scopeSpans", "scope_spans"):
            for span in _list(ss, "spans"):
                _convert_ids(span, convert)
                for link in _list(span, "links"):
                    _convert_ids(link, convert)


def _walk_metrics(doc: dict[str, Any], convert) -> None:
    for rm in _list(doc, "resourceMetrics", "resource_metrics"):
        for sm in _list(rm, "scopeMetrics", "scope_metrics"):
            for metric in _list(sm, "metrics"):
                for kind in _DATA_KINDS:
                    data = metric.get(kind)
                    if not isinstance(data, dict):
                        continue
                    for point in _list(data, "dataPoints", "data_points"):
                        for exemplar in _list(point, "exemplars"):
                            _convert_ids(exemplar, convert)


def _list(obj: Any, *keys: str) -> list[Any]:
    if not isinstance(obj, dict):
        raise MalformedPayload(f"expected a JSON object, got {type(obj).__name__}")
    for key in keys:
        value = obj.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise MalformedPayload(f"{key} must be an array of JSON objects")
        return value
    return []


def parse(body: bytes, message_type: type[M]) -> M:
    """Parse an OTLP/JSON request body into `message_type`; MalformedPayload if bad."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedPayload(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MalformedPayload("body must be a JSON object")
    walk = _walk_metrics if "Metrics" in message_type.__name__ else _walk_spans
    walk(doc, _hex_to_b64)
    message = message_type()
    try:
        json_format.ParseDict(doc, message, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise MalformedPayload(f"not an OTLP {message_type.__name__}: {_first_line(exc)}") from None
    return message


def dumps(message: Message) -> bytes:
    """Serialise a message as OTLP/JSON (hex ids, integer enums, camelCase keys)."""
    doc = json_format.MessageToDict(message, use_integers_for_enums=True)
    name = type(message).__name__
    if "Metrics" in name:
        _walk_metrics(doc, lambda v, _k: _b64_to_hex(v))
    elif "Trace" in name:
        _walk_spans(doc, lambda v, _k: _b64_to_hex(v))
    return json.dumps(doc, separators=(",", ":")).encode()


def _first_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]

