"""The per-rank gauges of the Grafana dashboard: one definition for both scrape targets.

The collector serves them from its store (`query_api.RankGauges`, SQL over DuckDB) and
`flare diagnose --follow` from its window (`flare.diagnostics.follow_metrics.rank_gauges`),
so a deployment that keeps its spans in Tempo or Jaeger still gets the dashboard. Each
source only fetches its rows; `samples()` turns them into the gauges, so the names, the
labels and the arithmetic are the same whichever target Prometheus scrapes:

    flare_rank_step_seconds{flare_job,rank}   mean step time of the rank over the job's
                                              last `RECENT_STEPS` complete steps
    flare_rank_wait_seconds{flare_job,rank}   its mean collective wait over those steps
                                              (only a rank that reported one)
    flare_rank_culprit_ratio{flare_job,rank}  its share of the job's last `CULPRIT_STEPS`
                                              steps in which it was the culprit (least
                                              collective wait, ties to the later
                                              finisher: the correlator's rule)
    flare_anomalies{flare_job,kind,rank}      the anomalies written back, by kind and rank
                                              (`rank="none"`: an anomaly naming no rank)

The rows are partial totals, so a source may aggregate where that is cheap (the store
sums in SQL, one row per job and rank) or hand one row per step (the follow window):
`samples()` adds up whatever it gets per job and rank before it divides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

STEP_SECONDS = "flare_rank_step_seconds"
WAIT_SECONDS = "flare_rank_wait_seconds"
CULPRIT_RATIO = "flare_rank_culprit_ratio"
ANOMALIES = "flare_anomalies"
NAMES = (STEP_SECONDS, WAIT_SECONDS, CULPRIT_RATIO, ANOMALIES)

# `flare_job`, not `job`: Prometheus's default `honor_labels: false` would rename a
# target's own `job` label to `exported_job`, and the dashboard's queries would miss it.
JOB_LABEL = "flare_job"
RANK_LABEL = "rank"
KIND_LABEL = "kind"
NO_RANK = "none"  # the rank label of an anomaly that names no rank

RECENT_STEPS = 10  # complete steps behind the step-time and wait gauges
CULPRIT_STEPS = 100  # steps behind the culprit ratio

Sample = tuple[str, dict[str, str], float]


class RankSteps(NamedTuple):
    """Totals of one rank's `train.step` spans among its job's last complete steps."""

    job: str
    rank: int
    steps: int  # how many steps these totals cover
    step_ms: float  # their total duration
    waits: int = 0  # how many of them carried a collective wait
    wait_ms: float = 0.0  # the total of those waits


class StepCulprits(NamedTuple):
    """How many of a job's last steps named `rank` the culprit (None: none named)."""

    job: str
    rank: int | None
    steps: int = 1


class AnomalyCount(NamedTuple):
    """Written-back anomalies of one job and kind naming `ranks` (none: no rank)."""

    job: str
    kind: str
    ranks: Sequence[object] = ()
    count: int = 1


def samples(
    steps: Iterable[RankSteps] = (),
    culprits: Iterable[StepCulprits] = (),
    anomalies: Iterable[AnomalyCount] = (),
) -> list[Sample]:
    """The dashboard's gauges from a source's rows, as `[(name, labels, value)]`.

    `steps` covers the job's last `RECENT_STEPS` complete steps and `culprits` its last
    `CULPRIT_STEPS` steps, each as the source windows them; rows for the same job and
    rank (or job, kind and rank) are added up. Ordered by name, job and rank.
    """
    return _step_samples(steps) + _culprit_samples(culprits) + _anomaly_samples(anomalies)


def _labels(job: str, rank: object) -> dict[str, str]:
    return {JOB_LABEL: str(job), RANK_LABEL: str(rank)}


def _step_samples(rows: Iterable[RankSteps]) -> list[Sample]:
    totals: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        total = totals.setdefault((str(row.job), int(row.rank)), [0, 0.0, 0, 0.0])
        total[0] += row.steps
        total[1] += row.step_ms
        total[2] += row.waits
        total[3] += row.wait_ms
    step_s: list[Sample] = []
    wait_s: list[Sample] = []
    for (job, rank), (steps, step_ms, waits, wait_ms) in sorted(totals.items()):
        if not steps:
            continue
        labels = _labels(job, rank)
        step_s.append((STEP_SECONDS, labels, step_ms / steps / 1e3))
        if waits:
            wait_s.append((WAIT_SECONDS, labels, wait_ms / waits / 1e3))
    return step_s + wait_s


def _culprit_samples(rows: Iterable[StepCulprits]) -> list[Sample]:
    named: dict[tuple[str, int], int] = {}
    steps: dict[str, int] = {}  # per job, steps with or without a culprit
    for row in rows:
        job = str(row.job)
        steps[job] = steps.get(job, 0) + row.steps
        if row.rank is not None:
            key = (job, int(row.rank))
            named[key] = named.get(key, 0) + row.steps
    return [(CULPRIT_RATIO, _labels(job, rank), count / steps[job])
            for (job, rank), count in sorted(named.items()) if count and steps[job]]


def _anomaly_samples(rows: Iterable[AnomalyCount]) -> list[Sample]:
    counts: dict[tuple[str, str, str], int] = {}
    for row in rows:
        for rank in row.ranks or (NO_RANK,):
            key = (str(row.job), str(row.kind), str(rank))
            counts[key] = counts.get(key, 0) + row.count
    return [(ANOMALIES, {JOB_LABEL: job, KIND_LABEL: kind, RANK_LABEL: rank}, float(count))
            for (job, kind, rank), count in sorted(counts.items())]
