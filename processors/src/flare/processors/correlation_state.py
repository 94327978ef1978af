"""What the rank correlator remembers per job: each rank's health, the job's open and
recently closed windows, and the process groups its ranks reported. Plain records, no
logic beyond the bitmaps that remember which ranks a closed window held."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from flare.processors.correlation_windows import CollectiveWindow, StepWindow


@dataclass
class RankHealth:
    last_heard_ns: int  # collector clock, when its latest data arrived
    last_span_end_ns: int = 0  # sender clock, latest end of a span the correlator read
    last_step: int | None = None
    hang: str | None = None  # where the watchdog says it is stuck
    hang_since_ns: int = 0
    hang_collective: tuple[str, int] | None = None  # (pg, seq) it is stuck in, if one


@dataclass
class JobState:
    job: str
    service: str
    world_size: int | None = None
    last_arrival_ns: int = 0
    steps: dict[int, StepWindow] = field(default_factory=dict)
    collectives: dict[tuple[str, int], CollectiveWindow] = field(default_factory=dict)
    # key -> (closed at, bitmap of the ranks it held)
    closed_steps: OrderedDict[int, tuple[int, bytearray]] = field(default_factory=OrderedDict)
    closed_collectives: OrderedDict[tuple[str, int], tuple[int, bytearray]] = field(
        default_factory=OrderedDict
    )
    ranks: dict[int, RankHealth] = field(default_factory=dict)
    pg_members: dict[str, set[int]] = field(default_factory=dict)
    pg_member_count: int = 0
    rank_pg_names: dict[int, tuple[str, ...]] = field(default_factory=dict)  # last learned
    # One tuple per distinct PG-name list the ranks reported (at most
    # correlation_ingest._PG_NAME_LISTS_LIMIT).
    pg_names_seen: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)


def bitmap(ranks: Iterable[int]) -> bytearray:
    ranks = list(ranks)
    bits = bytearray((max(ranks, default=0) >> 3) + 1)
    for rank in ranks:
        if rank >= 0:
            bits[rank >> 3] |= 1 << (rank & 7)
    return bits


def in_bitmap(bits: bytearray, rank: int) -> bool:
    return rank >= 0 and (rank >> 3) < len(bits) and bool(bits[rank >> 3] & (1 << (rank & 7)))
