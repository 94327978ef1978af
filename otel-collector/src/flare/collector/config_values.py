"""Configuration values as an otelcol file writes them: sizes, durations, endpoints.

Each parser takes the value and where it was found, and raises ConfigError with one
sentence naming that place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from flare.collector.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclass
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size like 64MiB, got {value!r}")
    if isinstance(value, int) and value >= 0:
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"{where}: expected a size like 64MiB, got {value!r}")
    unit = (match.group(2) or "b").lower()
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration like 500ms or 2s, got {value!r}")
    if isinstance(value, (int, float)) and value >= 0:
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ConfigError(f"{where}: expected a duration like 500ms or 2s, got {value!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def parse_endpoint(value: Any, where: str, default_port: int) -> Endpoint:
    if value is None or value == "":
        return Endpoint("127.0.0.1", default_port)
    text = str(value).strip()
    if "://" in text:
        raise ConfigError(f"{where}: endpoint {text!r} must be host:port, without a scheme")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise ConfigError(f"{where}: write an IPv6 endpoint as [address]:port, got {text!r}")
    else:
        host, port_text = text, ""
    host = host or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    if port_text == "":
        port = default_port
    else:
        try:
            port = int(port_text)
        except ValueError:
            raise ConfigError(f"{where}: port {port_text!r} in {text!r} is not a number")
    if not 0 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} is out of range 0-65535")
    return Endpoint(host, port)
