"""What each backward did to the process groups, for the step summary: which groups'
sequence numbers it advanced (DDP's gradient all-reduces, issued from C++), their
gradient bytes, and the exposed gradient-sync wait at the end of backward. Noted per
backward on the training thread; the comparison runs when the step's span is built."""

from __future__ import annotations


def _issued_from_cpp(totals, name: str) -> bool:
    """Whether some of the group's collectives this step were issued from C++ (DDP's
    reducer), which no wrapper timed. Only then is the tail of backward their wait: FSDP's
    reduce-scatters are Python calls whose waits the wrappers already counted (charging
    the tail again counted FSDP2's gradient waits twice, more than the step itself)."""
    started, ended = totals.seq_start, totals.seq_end
    pg = totals.pg.get(name)
    if not started or ended is None or pg is None:
        return True  # cannot tell: as before
    return pg.python_count < ended.get(name, 0) - started.get(name, 0)


def add_backward(totals, graph_done: int, end: int, seqs_before: dict | None,
                 after: dict | None, gradient_bytes: dict) -> None:
    """A backward's pending record, added to the step's `totals` when its span is built
    (queued by `BackwardRecords.record_backward`, or inline by StepHooks)."""
    if after is None:  # one group: the step's own reads
        seqs_before, after = totals.seq_start, totals.seq_end
        if not seqs_before or after is None:  # a read failed: nothing to compare
            return
    # (Loops, not comprehensions: this runs on the finisher for every step, on data
    # the training has long evicted, where each extra frame and object counts.)
    busiest, most = None, 0
    for name, seq in seqs_before.items():
        advance = after.get(name, seq) - seq
        if advance <= 0:
            continue
        if advance > most:  # the first of the groups that advanced most
            busiest, most = name, advance
        nbytes = gradient_bytes.get(name, 0)
        if nbytes:
            group = totals.pg_totals(name)
            group.bytes += nbytes
            group.cpp_accounted = True  # DDP's reducer: its wait is the tail below
    if graph_done and busiest is not None and _issued_from_cpp(totals, busiest):
        totals.pg_totals(busiest).wait_ns += max(0, end - graph_done)


class BackwardRecords:
    """The backward records of a CollectiveTracker: its runtime, process groups and DDP
    gradients, and the groups' sequence numbers last read on the training thread."""

    def __init__(self, runtime, groups, ddp_gradients):
        self.runtime = runtime
        self.groups = groups  # ProcessGroups
        self.ddp_gradients = ddp_gradients  # DdpGradients
        # Several groups: the snapshot read after the step's last backward, and its step
        self._seqs_seen: tuple[object, dict[str, int]] | None = None

    def record_backward(self, totals, start: int, graph_done: int, end: int,
                        seqs_before: dict[str, int] | None) -> None:
        """A backward of the step `totals` ended. Every group whose sequence advanced
        during it ran the gradient collectives of the DDP wrappers on it: add their
        gradient bytes. The tail of backward after the gradients were computed
        (`graph_done`, 0 when unknown) is the wait for those collectives; charge it to
        the group whose sequence advanced most. Only what the comparison needs is noted
        now; it is made when the step's span is built."""
        if graph_done and self.runtime.step_detail:
            if totals.backward_windows is None:
                totals.backward_windows = []
            totals.backward_windows.append((start, graph_done, end))
        groups = self.groups.sequenced_groups()
        if not groups:
            return
        if groups == 1:
            # Nothing to choose between: whether the group advanced is read from the
            # step's start and end (the runtime's reads, which the step pays anyway),
            # sparing the training thread a native read per backward.
            after = None
        else:
            after = self.groups.sequence_snapshot()
            self._seqs_seen = (totals, after)
        totals.pending.append((add_backward, (graph_done, end, seqs_before, after,
                                              self.ddp_gradients.syncing())))

    def sequences_before_backward(self, totals) -> dict[str, int] | None:
        """What a backward compares its end with, to know which groups it advanced:
        with one group, None, meaning the step's start (the runtime's read, in
        `totals`); with several, the groups' sequence numbers as last read on the
        training thread (at this step's start or the end of its previous backward).
        Either spares a native read before every backward (~15-25 µs cold, the step's
        largest single cost). Collectives of the forward in between then count as the
        backward's, which only matters for the DDP gradient bytes, and those are added
        only while DDP synchronises (`DdpGradients.syncing`)."""
        if self.groups.sequenced_groups() < 2:
            return None
        seen = self._seqs_seen
        if seen is not None and seen[0] is totals:
            return seen[1]
        return totals.seq_start
