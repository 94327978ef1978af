"""What the correlator keeps per open window, and what it concludes when one closes.

A step window holds one `RankStep` per rank of one (job, step); a collective window
holds one `RankArrival` per rank of one (job, process group, sequence). Closing a
window turns it into the attributes of a `train.step.ranks` or `collective.ranks`
span. Everything here is plain data and arithmetic: no protobuf, no clocks.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from flare.wire import semconv as sc

# Rough resident cost of the Python objects behind one entry; the byte budget only
# needs the right order of magnitude to stop unbounded growth.
STEP_ENTRY_BYTES = 400
PG_ENTRY_BYTES = 120
ARRIVAL_ENTRY_BYTES = 300


@dataclass(slots=True)
class RankStep:
    """One rank's `train.step` span, reduced to what cross-rank analysis needs."""

    span_id: bytes
    trace_id: bytes
    start_ns: int
    end_ns: int
    collective_wait_ms: float | None
    pg_names: tuple[str, ...] = ()
    pg_wait_ms: tuple[float, ...] = ()
    pg_last_seq: tuple[int, ...] = ()

    def cost(self) -> int:
        return STEP_ENTRY_BYTES + PG_ENTRY_BYTES * len(self.pg_names)


@dataclass(slots=True)
class RankArrival:
    """One rank's `collective.<op>` span: when it entered the collective."""

    span_id: bytes
    trace_id: bytes
    start_ns: int
    end_ns: int


@dataclass
class Window:
    key: object
    first_arrival_ns: int
    cost: int = 0


@dataclass
class StepWindow(Window):
    ranks: dict[int, RankStep] = field(default_factory=dict)


@dataclass
class CollectiveWindow(Window):
    op: str = ""
    step: int | None = None
    group_size: int | None = None
    group_ranks: tuple[int, ...] = ()
    source: str = "spans"  # "spans": collective spans; "hang": watchdog hang reports
    ranks: dict[int, RankArrival] = field(default_factory=dict)


_PG_WAIT_MS, _PG_LAST_SEQ = operator.attrgetter("pg_wait_ms"), operator.attrgetter("pg_last_seq")


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


def culprit(ranks: dict[int, RankStep]) -> tuple[int, str, float | None, float | None]:
    """(culprit rank, basis, its collective wait, median wait) of a step.

    The culprit is the rank everyone else waited for. Collectives equalise step
    durations (DDP's all-reduce makes the fast ranks wait inside backward), so the
    longest step does not single it out; the rank that waited *least* in collectives
    arrived last. Ties go to the later-finishing rank. Without wait summaries, the
    slowest step is the best remaining guess.
    """
    waits = [s.collective_wait_ms for s in ranks.values()]
    if None in waits:
        with_wait = [(r, s) for r, s in ranks.items() if s.collective_wait_ms is not None]
        waits = [s.collective_wait_ms for _, s in with_wait]
    else:
        with_wait = None  # every rank has one: built below only on a tie or a NaN
    if waits:
        lowest = min(waits)
        total = sum(waits)
        if total == total and waits.count(lowest) == 1 and with_wait is None:
            # No NaN (their order would matter) and one least wait: that rank, without
            # the (wait, -end, rank) key built for every rank.
            rank = next(r for r, s in ranks.items() if s.collective_wait_ms == lowest)
            culprit_wait = lowest
        else:
            if with_wait is None:
                with_wait = list(ranks.items())
            rank, step = min(with_wait, key=lambda rs: (rs[1].collective_wait_ms, -rs[1].end_ns, rs[0]))
            culprit_wait = step.collective_wait_ms
        ordered = sorted(waits)  # statistics.median, without its overhead
        half = len(ordered) // 2
        median = ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
        return rank, "collective_wait", culprit_wait, round(median, 3)
    rank = max(ranks, key=lambda r: (ranks[r].end_ns - ranks[r].start_ns, r))
    return rank, "duration", None, None


@dataclass
class PgSummary:
    """One process group's view of a step, from the ranks' per-PG summaries."""

    name: str
    last_seq: int
    arrival_skew_ms: float
    last_arrival: int
    reporting: list[int]
    missing: list[int]


def pg_summaries(
    ranks: dict[int, RankStep], known_members: dict[str, set[int]]
) -> list[PgSummary]:
    """Per PG: who reached its last collective of the step, who did not, and the skew.

    Within one PG the rank that waited least arrived last, so the wait spread is the
    arrival skew. A member is missing when it did not report the step, or reported a
    lower last sequence number than its peers (it never reached the latest one).
    """
    shared = _shared_pg_names(ranks)
    if shared is not None:
        return _uniform_pg_summaries(ranks, shared, known_members)
    return _general_pg_summaries(ranks, known_members)


def _general_pg_summaries(
    ranks: dict[int, RankStep], known_members: dict[str, set[int]]
) -> list[PgSummary]:
    """`pg_summaries` for any mix of PGs per rank (the reference of the uniform case)."""
    per_pg: dict[str, list[tuple[int, float, int]]] = {}
    for rank, step in ranks.items():
        for name, wait, seq in zip(step.pg_names, step.pg_wait_ms, step.pg_last_seq, strict=True):
            per_pg.setdefault(name, []).append((rank, wait, seq))
    out = []
    for name, rows in per_pg.items():
        last_seq = max(seq for _, _, seq in rows)
        reached = [(rank, wait) for rank, wait, seq in rows if seq == last_seq]
        behind = [rank for rank, _, seq in rows if seq < last_seq]
        members = known_members.get(name, set())
        absent = members.difference(rank for rank, _, _ in rows)
        waits = [wait for _, wait in reached]
        last_rank = min(reached, key=lambda rw: (rw[1], rw[0]))[0]
        out.append(
            PgSummary(
                name=name,
                last_seq=last_seq,
                arrival_skew_ms=round(max(waits) - min(waits), 3),
                last_arrival=last_rank,
                reporting=sorted(rank for rank, _ in reached),
                missing=sorted(absent.union(behind)),
            )
        )
    return out


def _shared_pg_names(ranks: dict[int, RankStep]) -> tuple[str, ...] | None:
    """The PG names every rank of the step reported, when they all report the same
    distinct names (the usual case: one job, one set of groups); else None."""
    first = None
    for step in ranks.values():
        names = step.pg_names
        if first is None:
            first = names
        elif names is not first and names != first:
            return None
    if not first or len(set(first)) != len(first):
        return None
    return first


def _uniform_pg_summaries(
    ranks: dict[int, RankStep], names: tuple[str, ...], known_members: dict[str, set[int]]
) -> list[PgSummary]:
    """`pg_summaries` when every rank reported the same PGs: one column per PG
    instead of one tuple per (rank, PG); the same result, a few times faster on the
    correlator's hottest path (it runs for every step of every job)."""
    rank_ids = list(ranks)
    steps = ranks.values()
    wait_columns = zip(*map(_PG_WAIT_MS, steps), strict=True)
    seq_columns = zip(*map(_PG_LAST_SEQ, steps), strict=True)
    sorted_ranks = sorted(rank_ids)
    out = []
    for name, waits, seqs in zip(names, wait_columns, seq_columns, strict=True):
        last_seq = max(seqs)
        if min(seqs) == last_seq:  # everyone reached the PG's last collective
            reached_waits = waits
            reached_ranks = rank_ids
            reporting = sorted_ranks[:]
            behind: list[int] = []
        else:
            reached = [(w, r) for r, w, q in zip(rank_ids, waits, seqs, strict=True) if q == last_seq]
            reached_waits = [w for w, _ in reached]
            reached_ranks = [r for _, r in reached]
            reporting = sorted(reached_ranks)
            behind = [r for r, q in zip(rank_ids, seqs, strict=True) if q < last_seq]
        members = known_members.get(name)
        # (The usual case, every member reported: no set built.)
        absent = members.difference(rank_ids) if members and not ranks.keys() >= members else ()
        lowest = min(reached_waits)
        total = sum(reached_waits)
        if total == total and reached_waits.count(lowest) == 1:
            # One least wait and no NaN: the rank that arrived last, without a
            # (wait, rank) tuple per rank.
            last_arrival = reached_ranks[reached_waits.index(lowest)]
        else:
            last_arrival = min(zip(reached_waits, reached_ranks, strict=True))[1]
        out.append(
            PgSummary(
                name=name,
                last_seq=last_seq,
                arrival_skew_ms=round(max(reached_waits) - lowest, 3),
                last_arrival=last_arrival,
                reporting=reporting,
                missing=sorted(absent.union(behind)) if absent else sorted(behind),
            )
        )
    return out


def step_attributes(
    window: StepWindow,
    step: int,
    expected: int | None,
    closed_by: str,
    pgs: list[PgSummary],
    max_pg_detail: int,
    hanging: dict[int, str],
) -> dict[str, object]:
    """The attributes of the `train.step.ranks` span of a closed step window."""
    ranks = window.ranks
    ends = [s.end_ns for s in ranks.values()]
    durations = [s.end_ns - s.start_ns for s in ranks.values()]
    slowest = max(zip(durations, ranks, strict=True))[1]  # the longest step; ties to the highest rank
    culprit_rank, basis, culprit_wait, median_wait = culprit(ranks)
    missing = sorted(set(range(expected)) - ranks.keys()) if expected else []
    # Largest skew first; PGs with missing ranks always make the cut.
    shown = sorted(pgs, key=lambda p: (not p.missing, -p.arrival_skew_ms, p.name))[:max_pg_detail]
    attrs: dict[str, object] = {
        sc.STEP: step,
        sc.RANKS_COUNT: len(ranks),
        sc.RANKS_EXPECTED: expected,
        sc.RANKS_MISSING: missing,
        sc.RANKS_SPREAD_MS: _ms(max(durations) - min(durations)),
        sc.RANKS_END_SPREAD_MS: _ms(max(ends) - min(ends)),
        sc.RANKS_SLOWEST: slowest,
        sc.RANKS_CULPRIT: culprit_rank,
        sc.RANKS_CULPRIT_BASIS: basis,
        sc.RANKS_CULPRIT_WAIT_MS: culprit_wait,
        sc.RANKS_MEDIAN_WAIT_MS: median_wait,
        sc.RANKS_CLOSED_BY: closed_by,
        sc.RANKS_PG_COUNT: len(pgs),
    }
    if shown:
        attrs[sc.RANKS_PG_NAMES] = [p.name for p in shown]
        attrs[sc.RANKS_PG_ARRIVAL_SKEW_MS] = [p.arrival_skew_ms for p in shown]
        attrs[sc.RANKS_PG_LAST_ARRIVAL] = [p.last_arrival for p in shown]
        attrs[sc.RANKS_PG_LAST_SEQ] = [p.last_seq for p in shown]
        attrs[sc.RANKS_PG_MISSING_COUNT] = [len(p.missing) for p in shown]
    if hanging:
        attrs[sc.RANKS_HANGING] = sorted(hanging)
        attrs[sc.RANKS_HANG_OPERATIONS] = [hanging[r] for r in sorted(hanging)]
    return attrs


def collective_attributes(
    window: CollectiveWindow, pg: str, seq: int, closed_by: str,
    known_members: set[int],
) -> dict[str, object]:
    """The attributes of the `collective.ranks` span of a closed (pg, seq) window."""
    ranks = window.ranks
    starts = {r: a.start_ns for r, a in ranks.items()}
    members = set(window.group_ranks) or known_members
    return {
        sc.COLL_PG: pg,
        sc.COLL_SEQ: seq,
        sc.COLL_OP: window.op or None,
        sc.STEP: window.step,
        sc.COLL_GROUP_SIZE: window.group_size,
        sc.RANKS_COUNT: len(ranks),
        sc.RANKS_EXPECTED: window.group_size or (len(members) or None),
        sc.RANKS_MISSING: sorted(members - ranks.keys()),
        sc.RANKS_ARRIVAL_SKEW_MS: _ms(max(starts.values()) - min(starts.values())),
        sc.RANKS_LAST_ARRIVAL: max(starts, key=lambda r: (starts[r], r)),
        sc.RANKS_CLOSED_BY: closed_by,
        sc.COLL_SOURCE: window.source,
    }


def summary_collective_attributes(pg: PgSummary, step: int, closed_by: str) -> dict[str, object]:
    """`collective.ranks` attributes for a PG whose members did not all reach its last
    collective of the step, as seen from the per-PG step summaries."""
    return {
        sc.COLL_PG: pg.name,
        sc.COLL_SEQ: pg.last_seq,
        sc.STEP: step,
        sc.RANKS_COUNT: len(pg.reporting),
        sc.RANKS_EXPECTED: len(pg.reporting) + len(pg.missing),
        sc.RANKS_MISSING: pg.missing,
        sc.RANKS_ARRIVAL_SKEW_MS: pg.arrival_skew_ms,
        sc.RANKS_LAST_ARRIVAL: pg.last_arrival,
        sc.RANKS_CLOSED_BY: closed_by,
        sc.COLL_SOURCE: "step_summary",
    }
