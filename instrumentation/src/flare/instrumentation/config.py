"""Flare's own settings, read once from `FLARE_*` environment variables.

Everything else (endpoints, exporters, sampling) is standard `OTEL_*` configuration
handled by the OpenTelemetry SDK.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from flare.instrumentation import semconv

_log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 10.0
# At interpreter exit the SDK flushes what is queued; against an unreachable collector
# its retries held a finished rank for 30-45 s. After this many seconds Flare stops the
# exporters (a healthy collector takes the last spans well within it).
DEFAULT_EXIT_FLUSH_TIMEOUT_S = 5.0
# The hang limit when FLARE_HANG_TIMEOUT_S is unset: the larger of this floor and
# HANG_STEP_MULTIPLE times the median of the recent step durations.
HANG_TIMEOUT_FLOOR_S = 60.0
HANG_STEP_MULTIPLE = 10.0
# Off-detail steps still emit a child span for any single operation at least this slow,
# so a 2 s dataloader stall is visible as a span without waiting for a detail step.
SLOW_CHILD_MS = 100.0
# Entries kept by the flight recorder when Flare turns it on. A dump (detail steps and
# hang reports only) costs ~7 µs per entry (PyTorch builds and pickles every one), on
# Flare's finisher thread; 256 covers several steps of DDP, and a detail step with more
# collectives than that between its start and the dump is counted as truncated.
FLIGHT_RECORDER_BUFFER = 256


def _number(name: str, default: float | None, minimum: float,
            integer: bool = False) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        _log.warning("flare: ignoring %s=%r (not a number)", name, raw)
        return default
    if integer and not value.is_integer():  # 2.5 steps: said, not silently cut to 2
        _log.warning("flare: ignoring %s=%r (not a whole number)", name, raw)
        return default
    if value < minimum:
        _log.warning("flare: ignoring %s=%r (must be >= %s)", name, raw, minimum)
        return default
    return value


@dataclass(frozen=True)
class FlareConfig:
    detail_every: int = semconv.DEFAULT_DETAIL_EVERY  # 0 turns periodic detail off
    hang_timeout_s: float | None = None  # None: adaptive (see HANG_TIMEOUT_FLOOR_S)
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # 0 turns the heartbeat off
    exit_flush_timeout_s: float = DEFAULT_EXIT_FLUSH_TIMEOUT_S  # 0: the SDK's own limits
    detail_flag_file: str | None = None
    traced_functions: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> FlareConfig:
        detail = _number(semconv.ENV_DETAIL_EVERY, semconv.DEFAULT_DETAIL_EVERY, 0, integer=True)
        traced = os.environ.get(semconv.ENV_TRACED_FUNCTIONS, "")
        return cls(
            detail_every=int(detail),
            hang_timeout_s=_number(semconv.ENV_HANG_TIMEOUT_S, None, 0.1),
            heartbeat_s=_number(semconv.ENV_HEARTBEAT_S, DEFAULT_HEARTBEAT_S, 0),
            exit_flush_timeout_s=_number(semconv.ENV_EXIT_FLUSH_TIMEOUT_S,
                                         DEFAULT_EXIT_FLUSH_TIMEOUT_S, 0),
            detail_flag_file=os.environ.get(semconv.ENV_DETAIL_FLAG_FILE) or None,
            traced_functions=tuple(e.strip() for e in traced.split(",") if e.strip()),
        )
