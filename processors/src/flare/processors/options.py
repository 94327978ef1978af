"""Option values as an `otelcol` YAML file writes them ("200ms", "64MiB", 8192).

Components are built as `Cls(**options)` from the collector configuration, so each
constructor checks its own values and raises `ValueError` with one sentence naming
the option; the collector turns that into its start-up error.
"""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)?\s*$")
_DURATION_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_BYTES = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def duration_s(value: object, option: str) -> float:
    """Seconds from a number (seconds) or a string with a unit ("500ms", "2s")."""
    if isinstance(value, bool):
        raise ValueError(f"{option}: expected a duration like 500ms or 2s, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"{option}: expected a duration like 500ms or 2s, got {value!r}")
        seconds = float(match.group(1)) * _DURATION_S[match.group(2) or "s"]
    if seconds < 0:
        raise ValueError(f"{option}: a duration cannot be negative, got {value!r}")
    return seconds


def size_bytes(value: object, option: str) -> int:
    """Bytes from a number or a string with a unit ("64MiB", "1GB")."""
    if isinstance(value, bool):
        raise ValueError(f"{option}: expected a size like 64MiB, got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ValueError(f"{option}: expected a size like 64MiB, got {value!r}")
        size = float(match.group(1)) * _SIZE_BYTES[(match.group(2) or "b").lower()]
    if size < 0:
        raise ValueError(f"{option}: a size cannot be negative, got {value!r}")
    return int(size)


def count(value: object, option: str, minimum: int = 0) -> int:
    """A whole number of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{option}: expected a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{option}: expected a whole number, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{option}: must be at least {minimum}, got {number}")
    return number



def mib_bytes(value: object, option: str) -> int:
    """Bytes from a number of MiB (an `*_mib` option), or a size string with its unit."""
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"\d+(?:\.\d+)?", text):
            return size_bytes(value, option)
        value = float(text)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{option}: expected a number of MiB or a size like 64MiB, got {value!r}")
    return int(value * (1 << 20))
