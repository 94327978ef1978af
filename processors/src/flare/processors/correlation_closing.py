"""When the rank correlator's windows close, and what closing one does.

A window closes when every expected rank reported (found while ingesting,
`correlation_ingest`), when its grace period ran out (`WindowCloser.due`, from
`tick`), when the state is over its byte budget (`over_budget`, oldest first), or at
shutdown (`all_open`). `emit` then turns each closed window into its spans
(`correlation_output`), remembers which ranks it held, and counts it. Runs once per
window, under the processor's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flare.processors import correlation_output as output
from flare.processors.correlation_config import CorrelationConfig
from flare.processors.correlation_ingest import RankIngest
from flare.processors.correlation_state import JobState, bitmap
from flare.processors.correlation_windows import CollectiveWindow, StepWindow, Window

_CLOSED_MEMORY_PER_JOB = 4096  # closed windows remembered per job, besides the time bound


def _absent_hang_elsewhere(job: JobState, win: CollectiveWindow) -> bool:
    """Whether every member a hang-reported collective still waits for is itself
    reported hung, somewhere else (its own step, another collective): none of them can
    arrive before its own hang ends, so the answer to "which rank did not join?" is
    known now and the window need not wait out its hang grace period."""
    members = set(win.group_ranks) or job.pg_members.get(str(win.key[0]), set())
    absent = members - win.ranks.keys()
    return bool(absent) and all(
        (health := job.ranks.get(rank)) is not None and health.hang
        and health.hang_collective != win.key for rank in absent)


class WindowCloser:
    """Closes the windows of `state` by `config`'s bounds, and emits them."""

    __slots__ = ("_clock", "config", "state")

    def __init__(self, state: RankIngest, config: CorrelationConfig, clock: Callable[[], int]) -> None:
        self.state = state
        self.config = config
        self._clock = clock

    def due(self, now_ns: int) -> list[tuple[JobState, Window, str]]:
        """Take out the windows whose grace period ran out; forget what fell out of
        `window` (closed windows, silent jobs)."""
        state, config = self.state, self.config
        closing: list[tuple[JobState, Window, str]] = []
        for job_id, job in list(state.jobs.items()):
            for step, win in list(job.steps.items()):
                if now_ns - win.first_arrival_ns >= config.grace_ns:
                    closing.append((job, job.steps.pop(step), "grace"))
            for key, win in list(job.collectives.items()):
                grace = config.hang_grace_ns if win.source == "hang" else config.grace_ns
                if now_ns - win.first_arrival_ns >= grace:
                    closing.append((job, job.collectives.pop(key), "grace"))
                elif win.source == "hang" and _absent_hang_elsewhere(job, win):
                    closing.append((job, job.collectives.pop(key), "hung_elsewhere"))
            self.forget_closed(job, now_ns)
            if now_ns - job.last_arrival_ns >= config.window_ns and not job.steps and not job.collectives:
                del state.jobs[job_id]
                state.counters["jobs_evicted"] += 1
        return closing

    def all_open(self) -> list[tuple[JobState, Window, str]]:
        """Take out every open window (shutdown)."""
        closing: list[tuple[JobState, Window, str]] = []
        for job in self.state.jobs.values():
            closing.extend((job, win, "shutdown") for win in job.steps.values())
            closing.extend((job, win, "shutdown") for win in job.collectives.values())
            job.steps.clear()
            job.collectives.clear()
        return closing

    # ------------------------------------------------------------ bounds
    def over_budget(self) -> list[tuple[JobState, Window, str]]:
        """Close the oldest open windows until the state is back under 90% of budget."""
        open_windows = sorted(
            (
                (win.first_arrival_ns, id(win), job, win)
                for job in self.state.jobs.values()
                for win in (*job.steps.values(), *job.collectives.values())
            ),
            key=lambda item: item[:2],
        )
        target = int(self.config.max_state_bytes * 0.9)
        closing = []
        state = self.state.state_bytes
        for _, _, job, win in open_windows:
            if state <= target:
                break
            if isinstance(win, StepWindow):
                job.steps.pop(win.key)
            else:
                job.collectives.pop(win.key)
            state -= win.cost
            self.state.counters["windows_evicted"] += 1
            closing.append((job, win, "budget"))
        return closing

    def forget_closed(self, job: JobState, now: int) -> None:
        for memory in (job.closed_steps, job.closed_collectives):
            while memory and (
                len(memory) > _CLOSED_MEMORY_PER_JOB
                or now - next(iter(memory.values()))[0] >= self.config.window_ns
            ):
                memory.popitem(last=False)

    # ------------------------------------------------------------ output
    def _expected(self, job: JobState) -> int | None:
        return self.config.expected_ranks or job.world_size

    def emit(self, closing: list[tuple[JobState, Window, str]], into: Any) -> None:
        """Close `closing` and add its spans to `into` (a request's `resource_spans`),
        one `ResourceSpans` per job."""
        if not closing:
            return
        now = self._clock()
        by_job: dict[str, Any] = {}  # job id -> its scope's spans container
        for job, win, closed_by in closing:
            self.state.state_bytes -= win.cost
            spans = by_job.get(job.job)
            if spans is None:
                spans = by_job[job.job] = output.job_scope_spans(job, into)
            counters = self.state.counters
            if isinstance(win, StepWindow):
                job.closed_steps[win.key] = (now, bitmap(win.ranks))
                counters["steps_emitted"] += 1
                counters[f"steps_{closed_by}"] += 1
                counters["collectives_emitted"] += output.step_spans(
                    job, win, closed_by, self._expected(job), self.config.max_pg_detail, spans)
            else:
                job.closed_collectives[win.key] = (now, bitmap(win.ranks))
                counters["collectives_emitted"] += 1
                if closed_by == "budget":
                    counters["collectives_budget"] += 1
                output.collective_span(job, win, closed_by, spans)
            self.forget_closed(job, now)
