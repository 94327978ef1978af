"""OTLP attribute values written as protobuf bytes: Flare's one attribute writer.

`write_attributes(mapping, tag) -> bytes` writes the repeated KeyValue field `tag`
(0x4A: Span.attributes) of each item of `mapping` exactly as the OpenTelemetry SDK's
encoder does. The ranks' span exporter (`flare.instrumentation.otlp_encoding`) and the
collector's correlator (`flare.processors.correlation_output`) both write with it. It is
in C (`_otlp_write.c`, ~5x faster) where that module was built at install, else the
Python reference here (`py_attributes`), which the C is tested against value for value.
Stdlib only.
"""

from __future__ import annotations

import struct

_pack_double = struct.Struct("<d").pack
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class Unsupported(Exception):
    """A value this writer does not encode: the span goes through the SDK encoder."""


SMALL = [bytes((i,)) for i in range(0x80)]


def varint(value: int) -> bytes:
    if value < 0x80:
        return SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + varint(len(payload)) + payload


KEYS: dict[str, bytes] = {}  # attribute key -> its KeyValue.key field, ready to write


def key_field(key: str) -> bytes:
    field = KEYS.get(key)
    if field is None:
        if type(key) is not str:
            raise Unsupported
        data = key.encode()
        field = length_delimited(b"\x0a", data) if data else b""
        if len(KEYS) < 4096:  # attribute keys are few; never grow without bound
            KEYS[key] = field
    return field


def any_value(value) -> bytes:
    """The serialized AnyValue of one attribute value (the SDK's `_encode_value`)."""
    kind = type(value)
    if kind is float:
        return b"\x21" + _pack_double(value)
    if kind is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise Unsupported
        return b"\x18" + varint(value if value >= 0 else value + (1 << 64))
    if kind is str:
        return length_delimited(b"\x0a", value.encode())
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is tuple or kind is list:
        return length_delimited(b"\x2a", b"".join([length_delimited(b"\x0a", any_value(item)) for item in value]))
    if value is None:
        return b""
    if kind is bytes:
        return length_delimited(b"\x3a", value)
    raise Unsupported  # subclasses, mappings, anything else: the SDK decides


def py_attributes(attributes, tag: int) -> bytes:
    """Repeated KeyValue fields; the usual value kinds are written inline. The reference
    for `_otlp_write.attributes` (C), which is used when it is built."""
    if not attributes:
        return b""
    tag = SMALL[tag]
    parts = []
    append = parts.append
    for key, value in attributes.items():
        field = KEYS.get(key) or key_field(key)
        kind = type(value)
        if kind is float:  # AnyValue{double_value}: 9 bytes
            field += b"\x12\x09\x21" + _pack_double(value)
        elif kind is int and 0 <= value < 0x80:
            field += b"\x12\x02\x18" + SMALL[value]
        elif kind is bool:
            field += b"\x12\x02\x10\x01" if value else b"\x12\x02\x10\x00"
        else:
            field += length_delimited(b"\x12", any_value(value))
        size = len(field)
        append(tag + (SMALL[size] if size < 0x80 else varint(size)) + field)
    return b"".join(parts)


# Flare's one OTLP attribute writer, `write_attributes(mapping, tag) -> bytes`: the
# repeated KeyValue field `tag` (0x4A: Span.attributes) of each item of `mapping`, as the
# SDK encodes it; Unsupported (or UnicodeEncodeError) for what only the SDK's encoder
# writes. The collector's correlator writes its spans' attributes with it too. In C
# (~5x faster) where `_otlp_write` was built at install, else the reference above.
try:
    from flare.wire import _otlp_write
except ImportError:
    _otlp_write = None
    write_attributes = py_attributes
else:
    _otlp_write.init(Unsupported)
    write_attributes = _otlp_write.attributes
