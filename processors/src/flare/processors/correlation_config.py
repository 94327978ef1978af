"""The rank correlator's options (`processors.rank_correlation` in the collector's
configuration), checked and converted once: durations to nanoseconds, sizes to bytes."""

from __future__ import annotations

from dataclasses import dataclass

from flare.processors import options


@dataclass(frozen=True, slots=True)
class CorrelationConfig:
    grace_ns: int
    hang_grace_ns: int
    window_ns: int
    max_state_bytes: int
    max_pg_detail: int
    expected_ranks: int | None

    @classmethod
    def parse(
        cls,
        grace_period: object,
        hang_grace_period: object,
        window: object,
        max_state_mib: float,
        max_pg_detail: int,
        expected_ranks: int | None,
    ) -> CorrelationConfig:
        """The options as given, checked in this order; ValueError names the bad one."""
        grace_ns = int(options.duration_s(grace_period, "rank_correlation.grace_period") * 1e9)
        # Hang reports trickle in over the watchdogs' poll and export intervals, and
        # nothing is lost by waiting: the job is stuck.
        hang_grace_ns = int(
            options.duration_s(hang_grace_period, "rank_correlation.hang_grace_period") * 1e9
        )
        window_ns = int(options.duration_s(window, "rank_correlation.window") * 1e9)
        if window_ns < max(grace_ns, hang_grace_ns):
            raise ValueError("rank_correlation.window must be at least grace_period and hang_grace_period")
        max_state_bytes = options.mib_bytes(max_state_mib, "rank_correlation.max_state_mib")
        if max_state_bytes <= 0:
            raise ValueError("rank_correlation.max_state_mib must be positive")
        return cls(
            grace_ns=grace_ns,
            hang_grace_ns=hang_grace_ns,
            window_ns=window_ns,
            max_state_bytes=max_state_bytes,
            max_pg_detail=options.count(max_pg_detail, "rank_correlation.max_pg_detail"),
            expected_ranks=(
                None if expected_ranks is None
                else options.count(expected_ranks, "rank_correlation.expected_ranks", minimum=1)
            ),
        )
