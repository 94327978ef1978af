"""What one trace file may cost, and what an import reports: the limits a broken or
hostile file is refused by, and the per-file and per-import results."""

from __future__ import annotations

import dataclasses
import re

_KIB, _MIB, _GIB = 1 << 10, 1 << 20, 1 << 30


class TraceError(Exception):
    """A trace file that cannot be read; the message names the file and the problem."""


def format_size(size: int) -> str:
    for unit, name in ((_GIB, "GiB"), (_MIB, "MiB"), (_KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def parse_size(text: str) -> int:
    """`2G`, `2GiB`, `512M`, `64k` (binary units) or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([kKmMgG])(?:i?B)?|B)?\s*", text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 2G, 512M, 65536)")
    number, unit = int(match.group(1)), (match.group(2) or "").lower()
    return number * {"": 1, "k": _KIB, "m": _MIB, "g": _GIB}[unit]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one trace file may cost, so that a broken or hostile file is refused in
    bounded time and memory instead of stalling or exhausting the import.

    max_bytes: JSON bytes read from one file (decompressed, for gzip); past it the file is
        skipped.
    max_string: characters of one JSON string or number as written; an event holding a
        longer one is skipped and counted, a top-level value holding one is ignored.
        The text of one event (or top-level value) is capped at 16 × max_string
        characters, its over-long strings not counted; past it the file is skipped.

    What a file keeps for its spans (kernels, launches, steps, operators, at an
    estimated ~0.2-0.8 KB each until stored) is capped at 2 × max_bytes (`max_memory`):
    past it the file is skipped. Real traces keep ~0.5-1.1 × their JSON size; a trace
    of nothing but minimal kernel events would otherwise take ~20 ×.
    """

    max_bytes: int = 2 * _GIB
    max_string: int = _MIB

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError("max_bytes (--max-file-size) must be positive")
        if self.max_string < _KIB:
            raise ValueError("max_string (--max-string) must be at least 1 KiB")

    @property
    def max_event(self) -> int:
        return 16 * self.max_string

    @property
    def max_memory(self) -> int:
        return 2 * self.max_bytes


@dataclasses.dataclass
class FileResult:
    path: str
    rank: int | None = None
    spans: int = 0
    kernels: int = 0
    steps: int = 0
    error: str | None = None
    # Events left out of an imported file, by reason: "with a non-finite or out-of-range time".
    skipped_events: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def warning(self) -> str | None:
        """One line on the events skipped, or None."""
        if not self.skipped_events:
            return None
        total = sum(self.skipped_events.values())
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(
            self.skipped_events.items(), key=lambda item: -item[1]))
        return f"{total} event(s) of {self.path}: {reasons}"


@dataclasses.dataclass
class ImportResult:
    job: str
    store_path: str
    files: list[FileResult]

    @property
    def files_imported(self) -> int:
        return sum(1 for f in self.files if f.error is None)

    @property
    def spans(self) -> int:
        return sum(f.spans for f in self.files)

    @property
    def errors(self) -> list[str]:
        return [f.error for f in self.files if f.error is not None]

    @property
    def warnings(self) -> list[str]:
        return [f.warning for f in self.files if f.error is None and f.warning]
