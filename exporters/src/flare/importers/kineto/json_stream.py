"""A Kineto trace's JSON, streamed: the top-level keys Flare reads, and `traceEvents`
one event at a time, in time linear in the text and memory bounded by `Limits`.

The parser walks the top-level JSON object itself and decodes the trace events a chunk
holds with the C decoder of `json`, a value spanning chunks with a scan that never
rereads text, keeping only the few fields Flare needs. Gzip or plain.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flare.importers.kineto.limits import Limits, TraceError, format_size

# Text read and decoded per step of the parse: the events of one chunk exist as dicts
# at once (256 KB: ~1k events, ~5 MB less peak than 1 MB chunks, same speed).
_CHUNK = 1 << 18
_WS_RE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_BOUNDARY = re.compile(r"\}[ \t\n\r]*,[ \t\n\r]*(?=\{)")  # `}, {` between two elements
# What the scan of a value spanning chunks steps over in one regex call: text outside
# strings up to the next quote or bracket; a string's text up to its quote or next escape;
# a number or literal.
_OUTSIDE = re.compile(r'[^"{}\[\]]*')
_IN_STRING = re.compile(r'[^"\\]*')
_SCALAR = re.compile(r'[^"{}\[\],:\s]*')
_DECODER = json.JSONDecoder()
# The top-level keys the import reads; the others are parsed and dropped.
_META_KEYS = frozenset({"schemaVersion", "distributedInfo", "deviceProperties", "baseTimeNanoseconds"})



_SKIP = object()  # a value left out: it holds a string longer than Limits.max_string


class StreamingTrace:
    """Top-level keys of a trace object, with `traceEvents` yielded one event at a time.

    Time linear in the text and memory bounded by `Limits`: each chunk is decoded in
    one call (or one per element) by the C decoder of `json`; a value that a chunk holds
    only part of is read to its end by `_long_value`, which looks at each character once
    and never rescans or regrows a buffer.
    """

    def __init__(self, text: io.TextIOBase, name: str, limits: Limits | None = None) -> None:
        self._text = text
        self._name = name
        self._limits = limits or Limits()
        # A chunk no longer than max_string: a string a chunk holds whole is within the cap.
        self._chunk = max(1, min(_CHUNK, self._limits.max_string))
        self._buf = ""
        self._pos = 0
        self._base = 0  # characters of the file before `_buf` (offsets in errors are the file's)
        self._eof = False
        self._seen = False  # anything but whitespace
        self.meta: dict[str, Any] = {}
        self.skipped: dict[str, int] = {}  # events left out, by reason

    def _fill(self) -> bool:
        """Read the next chunk; called once `_buf` is consumed (so nothing is copied)."""
        if self._eof:
            return False
        chunk = self._text.read(self._chunk)
        if not chunk:
            self._eof = True
            return False
        self._base += self._pos
        self._buf = self._buf[self._pos:] + chunk
        self._pos = 0
        return True

    def _peek(self) -> str:
        while True:
            pos = _WS_RE.match(self._buf, self._pos).end()
            self._pos = pos
            if pos < len(self._buf):
                self._seen = True
                return self._buf[pos]
            if not self._fill():
                if not self._seen:
                    raise TraceError(f"{self._name}: not a Kineto trace (empty or only whitespace)")
                raise TraceError(f"{self._name}: truncated (ends inside the JSON)")

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            found = self._buf[self._pos:self._pos + 20]
            # !a: a binary file's bytes stay escapes on the terminal
            raise TraceError(f"{self._name}: not a Kineto trace (expected {char!r}, found {found!a})")
        self._pos += 1

    def _corrupt(self, at: int, what: str) -> TraceError:
        return TraceError(f"{self._name}: corrupt JSON at offset {at}: {what}")

    def _undecodable(self, exc: Exception, at: int) -> TraceError:
        """RecursionError or a ValueError other than a syntax error, at offset `at`."""
        if isinstance(exc, RecursionError):
            return TraceError(f"{self._name}: JSON nested too deep at offset {at} "
                              f"(deeper than Python's decoder reads)")
        return self._corrupt(at, "a number too long to read")  # int's 4300-digit limit

    def _value(self) -> Any:
        """The JSON value at the next non-blank character (a top-level key or value)."""
        self._peek()
        buf, pos = self._buf, self._pos
        try:
            value, end = _DECODER.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if len(buf) - exc.pos > 64 and not exc.msg.startswith("Unterminated"):
                raise self._corrupt(self._base + exc.pos, exc.msg) from None
            return self._long_value()  # the value goes on in the next chunk
        except (RecursionError, ValueError) as exc:
            raise self._undecodable(exc, self._base + pos) from None
        if end >= len(buf) and not self._eof:
            return self._long_value()  # a number may go on in the next chunk
        self._pos = end
        return value

    def _long_value(self) -> Any:
        """The JSON value at `_pos`, read across as many chunks as it spans, or _SKIP.

        One regex call steps over a run of text between quotes and brackets (or a
        string's characters up to its closing quote or an escape); a loop step handles
        each quote, bracket and escape. The text is kept as pieces, joined and decoded
        once at the end; a string past max_string stops the keeping (the value is
        _SKIP), a value past max_event outside such strings stops the file.
        """
        max_string, max_event = self._limits.max_string, self._limits.max_event
        buf, pos = self._buf, self._pos
        start = self._base + pos  # the value's offset in the file
        pieces: list[str] | None = []
        scalar = buf[pos] not in '{["'
        depth = 0
        in_string = False
        string_from = 0  # offset of the current string's opening quote
        long_chars = 0  # characters of the strings past max_string that have ended
        i = pos
        while True:
            base, size = self._base, len(buf)
            end = -1
            if scalar:
                i = _SCALAR.match(buf, i).end()
                if i < size:
                    end = i
            else:
                while i < size:
                    if in_string:
                        i = _IN_STRING.match(buf, i).end()
                        if i >= size:
                            break
                        if buf[i] == "\\":
                            i += 2  # may land past the chunk: the escaped character is next
                            continue
                        i += 1
                        in_string = False
                        length = base + i - string_from
                        if length - 2 > max_string:
                            long_chars += length
                            pieces = None
                        if depth == 0:
                            end = i
                            break
                        continue
                    i = _OUTSIDE.match(buf, i).end()
                    if i >= size:
                        break
                    char = buf[i]
                    i += 1
                    if char == '"':
                        in_string = True
                        string_from = base + i - 1
                    elif char == "{" or char == "[":
                        depth += 1
                    else:
                        depth -= 1
                        if depth <= 0:
                            end = i
                            break
            stop = end if end >= 0 else size
            scanned = base + stop - start
            current = 0  # characters of a string (or number) past max_string still going on
            if scalar:
                if scanned > max_string:
                    current = scanned
                    pieces = None
            elif in_string and base + size - string_from - 1 > max_string:
                current = base + size - string_from
                pieces = None
            if pieces is not None:
                pieces.append(buf[pos:stop])
            if scanned - long_chars - current > max_event:
                raise TraceError(f"{self._name}: a trace event or value of more than "
                                 f"{format_size(max_event)} at offset {start} "
                                 f"(16 × the string limit, --max-string)")
            if end >= 0:
                break
            chunk = self._text.read(self._chunk)
            if not chunk:
                self._eof = True
                raise TraceError(f"{self._name}: truncated (ends inside the JSON)")
            self._base = base + size
            i -= size  # past 0 where an escape's second character opens this chunk
            buf, pos = chunk, 0
        self._buf, self._pos = buf, end
        if pieces is None:
            return _SKIP
        text = "".join(pieces)
        del pieces
        try:
            value, used = _DECODER.raw_decode(text)
        except json.JSONDecodeError as exc:
            raise self._corrupt(start + exc.pos, exc.msg) from None
        except (RecursionError, ValueError) as exc:
            raise self._undecodable(exc, start) from None
        if used != len(text):
            raise self._corrupt(start + used, "unexpected text after a value")
        return value

    def _skip_event(self) -> None:
        reason = f"with a string over {format_size(self._limits.max_string)} (--max-string)"
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _array_items(self) -> Iterator[dict[str, Any]]:
        """The elements of the array being read (the hot loop).

        Each chunk's whole elements are decoded in one `json.loads` call: the elements up
        to the chunk's last `}` that a `,` and a `{` follow. Should that guess be wrong
        (the `}` inside a string or a nested object), the text does not parse as a list
        and the chunk goes element by element with the C scanner instead, which also
        says where a corrupt element is; a list it does parse is exactly the elements
        the scanner would have read. One call per chunk instead of one per element:
        ~40 % less time on a GPU trace's ~100k small events. The element the chunk ends
        inside is read on by `_long_value`.
        """
        scan = _DECODER.scan_once
        while True:
            buf = self._buf
            size = len(buf)
            pos = _WS_RE.match(buf, self._pos).end()
            boundary = _last_boundary(buf, pos, size)
            if boundary is not None:
                try:
                    batch = json.loads("[" + buf[pos:boundary[0]] + "]")
                except (ValueError, RecursionError):
                    batch = None  # the element-by-element scan below reads the chunk
                if batch is not None:
                    for value in batch:
                        if type(value) is dict:
                            yield value
                    del batch
                    pos = boundary[1]
            while pos < size:
                try:
                    value, end = scan(buf, pos)
                except StopIteration as stop:
                    # The scanner reports where it failed, possibly deep inside the event.
                    failed_at = stop.value if isinstance(stop.value, int) else pos
                    if size - failed_at > 64:
                        raise TraceError(f"{self._name}: corrupt JSON in traceEvents at "
                                         f"offset {self._base + failed_at}") from None
                    break  # a literal cut by the chunk boundary
                except json.JSONDecodeError as exc:
                    if size - exc.pos > 64 and not exc.msg.startswith("Unterminated"):
                        raise self._corrupt(self._base + exc.pos, exc.msg) from None
                    break  # an element cut by the chunk boundary
                except (RecursionError, ValueError) as exc:
                    raise self._undecodable(exc, self._base + pos) from None
                separator = _SEPARATOR.match(buf, end)
                if separator is None:
                    if _WS_RE.match(buf, end).end() < size:
                        raise TraceError(f"{self._name}: corrupt JSON in traceEvents at "
                                         f"offset {self._base + end}")
                    break  # the separator is in the next chunk
                if type(value) is dict:
                    yield value
                pos = separator.end()
                if separator.group(1) == "]":
                    self._pos = pos
                    return
            self._pos = pos
            if pos < size:  # an element the chunk holds the start of
                value = self._long_value()
                if value is _SKIP:
                    self._skip_event()
                elif type(value) is dict:
                    yield value
                char = self._peek()
                at = self._base + self._pos
                self._pos += 1
                if char == "]":
                    return
                if char != ",":
                    raise self._corrupt(at, f"expected ',' or ']' after an element, found {char!a}")
            elif not self._fill():
                raise TraceError(f"{self._name}: truncated (ends inside traceEvents)")

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield every trace event; the top-level keys Flare reads land in `meta` as
        they are passed.

        The legacy profiler (torch < 1.8) wrote the Chrome trace "array format": the
        top level is the event list itself.
        """
        if self._peek() == "[":
            self._pos += 1
            if self._peek() == "]":
                return
            yield from self._array_items()
            return
        self._expect("{")
        if self._peek() == "}":
            return
        while True:
            key = self._value()
            self._expect(":")
            if key == "traceEvents":
                self._expect("[")
                if self._peek() == "]":
                    self._pos += 1
                else:
                    yield from self._array_items()
            else:
                value = self._value()  # _SKIP for a string past the cap: left out
                if type(key) is str and key in _META_KEYS and value is not _SKIP:
                    self.meta[key] = value
            char = self._peek()
            at = self._base + self._pos
            self._pos += 1
            if char == "}":
                return
            if char != ",":
                raise TraceError(f"{self._name}: corrupt JSON at offset {at}: expected ',' or "
                                 f"'}}' after a top-level value, found {char!r}")


def _last_boundary(buf: str, pos: int, size: int) -> tuple[int, int] | None:
    """(end of the last element, start of the next) that `buf[pos:size]` shows whole,
    judged by the text alone (`json.loads` then checks), or None."""
    cut = size
    for _ in range(64):
        cut = buf.rfind("}", pos, cut)
        if cut < 0:
            return None
        match = _BOUNDARY.match(buf, cut)
        if match is not None:
            return cut + 1, match.end()
    return None


class _Capped(io.RawIOBase):
    """The bytes of a file (decompressed, for gzip), refused past `limit`."""

    def __init__(self, stream: io.BufferedIOBase, limit: int, name: str, gzipped: bool) -> None:
        super().__init__()
        self._stream, self._limit, self._name, self._gzipped = stream, limit, name, gzipped
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self._stream.readinto(buffer)
        self.total += count
        if self.total > self._limit:
            what = "decompresses to" if self._gzipped else "holds"
            raise TraceError(f"{self._name}: {what} more than {format_size(self._limit)} "
                             f"(the per-file limit, --max-file-size)")
        return count

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            super().close()


def open_text(path: Path, limits: Limits) -> io.TextIOBase:
    with open(path, "rb") as raw:
        magic = raw.read(2)
    gzipped = magic == b"\x1f\x8b"
    # Closed with the text stream (by `_Capped.close`).
    stream = gzip.open(path, "rb") if gzipped else open(path, "rb", buffering=0)  # noqa: SIM115
    capped = _Capped(stream, limits.max_bytes, str(path), gzipped)
    return io.TextIOWrapper(io.BufferedReader(capped, 1 << 16), encoding="utf-8", errors="replace")
