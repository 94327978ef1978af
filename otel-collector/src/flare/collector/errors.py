"""Errors the collector turns into one clear line (at start) or a protocol status."""

from __future__ import annotations


class ConfigError(Exception):
    """The configuration cannot run; the message is one sentence naming the culprit."""


class MalformedPayload(Exception):
    """A request body that is not a valid OTLP message (HTTP 400, gRPC INVALID_ARGUMENT)."""


class PayloadTooLarge(Exception):
    """A request body over the configured cap (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""


class Refused(Exception):
    """Backpressure: the request was not accepted and the client should retry later.

    `overloaded` distinguishes a full memory/queue budget (HTTP 429, gRPC
    RESOURCE_EXHAUSTED with RetryInfo) from a collector that cannot persist right now
    (full write-ahead log, shutting down: HTTP 503, gRPC UNAVAILABLE). Both carry a
    retry delay so the client backs off instead of hammering.
    """

    def __init__(self, reason: str, retry_after_s: float, overloaded: bool, code: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code  # short label for counters: memory_limit, queue_full, wal, shutdown
        self.retry_after_s = retry_after_s
        self.overloaded = overloaded


class StartError(Exception):
    """A component could not start (port taken, unreadable certificate); one sentence."""
