"""Flare's own settings, read once from `FLARE_*` environment variables.

Everything else (endpoints, exporters, sampling) is standard `OTEL_*` configuration
handled by the OpenTelemetry SDK.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from flare.wire import semconv

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
# Entries kept by the flight recorder when TORCH_FR_BUFFER_SIZE is unset (PyTorch's own
# default is 2,000 entries). A dump (detail steps and hang reports only) costs ~7 µs per
# entry warm and about three times that in the running job (PyTorch builds and pickles
# every entry, the oldest as much as the newest), on Flare's finisher thread: 256
# entries cost the 80 ms benchmark job ~38 µs per rank-step, 128 ~19. Flare reads only
# the detail step's own C++-issued collectives from it (DDP's bucket all-reduces: 128
# buckets of DDP's default 25 MB hold 3.2 GB of gradients; FSDP's and Megatron's
# collectives are Python-issued and need no dump) and, for a hang, the newest ones. A
# detail step with more C++-issued collectives than that is counted as truncated and
# logged once, naming the variable to raise.
FLIGHT_RECORDER_BUFFER = 128


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
