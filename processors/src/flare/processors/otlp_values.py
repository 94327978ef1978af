"""Reading and writing OTLP attribute values without the overhead of a full decode."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

_SCALAR_KINDS = frozenset(("string_value", "int_value", "double_value", "bool_value"))


def plain(value: AnyValue, for_json: bool = False) -> Any:
    """An `AnyValue` as a Python value: arrays as tuples, maps as dicts, bytes as bytes;
    `for_json`, as JSON carries it (the store's columns): arrays as lists, bytes as
    base64 text. The reference for the C readers' AnyValue reader (csrc/otlp_read/anyvalue.c), both shapes."""
    kind = value.WhichOneof("value")
    if kind in _SCALAR_KINDS:
        return getattr(value, kind)
    if kind == "array_value":
        items = [plain(v, for_json) for v in value.array_value.values]
        return items if for_json else tuple(items)
    if kind == "kvlist_value":
        return {kv.key: plain(kv.value, for_json) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii") if for_json else value.bytes_value
    return None


def pick(attributes: Any, wanted: frozenset[str]) -> dict[str, Any]:
    """Only the `wanted` keys of an attribute list, decoded."""
    out = {}
    for kv in attributes:
        key = kv.key
        if key in wanted:
            out[key] = plain(kv.value)
    return out


def as_int(value: Any) -> int | None:
    """An attribute that should be an integer, tolerating senders that typed it badly."""
    if value is None or type(value) is int:
        return value
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def as_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def any_value(value: Any) -> AnyValue:
    """The AnyValue Flare's attribute writer (otlp_encoding.write_attributes) writes for
    the kinds it knows (None an empty AnyValue, bytes as bytes); anything else as its str()."""
    if value is None:
        return AnyValue()
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=str(value))


def key_values(attributes: dict[str, Any]) -> list[KeyValue]:
    """KeyValues for the non-None entries of `attributes` (OTel drops None values)."""
    return [KeyValue(key=k, value=any_value(v)) for k, v in attributes.items() if v is not None]


def derived_span_id(*parts: object) -> bytes:
    """A stable span id for a span the collector derives: re-emitting it (WAL replay,
    a restarted collector) yields the same id, so backends and the store can dedupe."""
    text = "\x00".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return digest if any(digest) else b"\x00" * 7 + b"\x01"
