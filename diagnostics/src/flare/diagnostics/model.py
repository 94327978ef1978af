"""The diagnostics data model: what detectors read and what they return.

Detectors are pure functions `detect(job: JobData, config: DiagnosisConfig) ->
list[Anomaly]`: columnar spans in, anomalies out, no I/O. Backends (the embedded
store, Jaeger, Tempo, a Kineto import) fill a `JobData`; reports render `Anomaly`s.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from flare.diagnostics.columns import Table
from flare.wire import semconv

KINDS = semconv.ANOMALY_KINDS
CAUSES = semconv.CAUSES


@dataclasses.dataclass
class Anomaly:
    """One labelled anomaly; `to_json()` is the ARCHITECTURE §5 contract."""

    kind: str
    ranks: list[int]
    cause: str
    first_step: int | None
    last_step: int | None
    impact: float  # share of job time lost, 0..1
    confidence: float  # 0..1
    summary: str
    callsite: str | None = None
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    trace_ids: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown anomaly kind {self.kind!r}")
        if self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}")

    @property
    def key(self) -> str:
        """Stable identity: the same problem found twice (e.g. by --follow) has one key."""
        raw = f"{self.kind}|{','.join(map(str, sorted(self.ranks)))}|{self.cause}|{self.first_step}"
        return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ranks": sorted(int(r) for r in self.ranks),
            "cause": self.cause,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "impact": round(float(self.impact), 4),
            "confidence": round(float(self.confidence), 4),
            "callsite": self.callsite,
            "summary": self.summary,
            "evidence": json.loads(json.dumps(self.evidence, default=_jsonable)),
            "trace_ids": list(self.trace_ids),
        }


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


@dataclasses.dataclass(frozen=True, slots=True)
class SpanQuery:
    """What `JobData.spans` is asked, as one value: span names (a name ending in `*` is
    a prefix), typed attribute columns to add, a step range, ranks, a subset of the
    span columns, the first `limit` spans by start time, an OTLP status (2 = error).
    Sequences are kept as tuples, so a query is hashable (a cache keys on it) and
    `dataclasses.replace` narrows it (a wrapper capping the last step)."""

    names: tuple[str, ...]
    attributes: tuple[str, ...] = ()
    first_step: int | None = None
    last_step: int | None = None
    ranks: tuple[int, ...] | None = None
    columns: tuple[str, ...] | None = None
    limit: int | None = None
    status_code: int | None = None

    def __post_init__(self) -> None:
        for name in ("names", "attributes", "ranks", "columns"):
            value = getattr(self, name)
            if value is not None and type(value) is not tuple:
                object.__setattr__(self, name, tuple(value))


class SpanReader(abc.ABC):
    """`spans(...)` as JobData spells it, for a backend that answers a SpanQuery
    (`query`): the arguments are written once, in SpanQuery."""

    def spans(self, *args, **kwargs) -> Table:
        return self.query(SpanQuery(*args, **kwargs))

    @abc.abstractmethod
    def query(self, q: SpanQuery) -> Table:
        """The spans `q` asks for."""


class JobData(Protocol):
    """Columnar access to one job's spans, whatever backend holds them.

    Every table returned follows the store's span schema
    (`flare.exporters.store.SPAN_SCHEMA`) plus, where asked, typed attribute
    columns named after the attribute key (e.g. "flare.step.collective_wait_ms").
    Implementations push filters (names, steps, ranks) down to the backend.
    """

    job: str
    backend: str  # e.g. "store:/path/to/store.duckdb", "jaeger+http://host:16686"

    def spans(self, *args, **kwargs) -> Table:
        """The spans a `SpanQuery(*args, **kwargs)` asks for (SpanReader gives it from
        `query`)."""
        ...

    def query(self, q: SpanQuery) -> Table: ...

    def world_size(self) -> int | None: ...

    # Added for diagnosis at scale: aggregation the backend pushes down (SQL for the
    # store; Arrow for adapters built on backends.arrow.ArrowJobData). Span names in
    # `names` may end in '*' to mean a prefix (e.g. "collective.*").

    def step_summary(
        self,
        attributes: Sequence[str] = (),
        step_bucket: int = 1,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> Table:
        """Per (rank, bucket of `step_bucket` steps): rank, step, steps, start_ns,
        end_ns, duration_ms and the mean of each attribute (float32; bit masks are ORed),
        over train.step spans."""
        ...

    def steps_range(self) -> tuple[int, int] | None: ...

    def ranks(self) -> list[int]: ...

    def rank_activity(self, names: Sequence[str]) -> Table:
        """Per rank: spans, first_start_ns, last_end_ns, last_step over spans named `names`."""
        ...

    def count(self, names: Sequence[str]) -> int: ...

    # Added: the job's `flare.source` resource value ("kineto" for an import), None for a
    # live job. Optional for backends: detectors call it through `job_source(job)`.
    def source(self) -> str | None: ...


def job_source(job: JobData) -> str | None:
    """Where the job's spans came from; None (a live job) for backends that cannot say."""
    source = getattr(job, "source", None)
    return source() if callable(source) else None


def rank_resources(job: JobData, names: Sequence[str]) -> list[tuple[int, str | None]]:
    """The distinct (rank, resource JSON) pairs of spans named `names`, in order of
    first appearance; a backend may answer it itself (`rank_resources`), else it is
    read from the spans."""
    method = getattr(job, "rank_resources", None)
    table = method(names) if callable(method) else job.spans(names, columns=["rank", "resource"])
    seen: dict[tuple[int, str | None], None] = {}
    for rank, resource in zip(table.column("rank").to_pylist(), table.column("resource").to_pylist(),
                              strict=True):
        if rank is not None:
            seen.setdefault((int(rank), resource), None)
    return list(seen)


def is_imported(job: JobData) -> bool:
    """A trace import: no heartbeats, no running processes, one file per rank at most."""
    return job_source(job) == semconv.JOB_SOURCE_KINETO


@dataclasses.dataclass
class DiagnosisConfig:
    """Thresholds shared by detectors; defaults are documented in docs/diagnostics.md."""

    # A rank is a straggler when the others wait for it at least this share of a step.
    straggler_min_impact: float = 0.05
    # Added: the job was stopped by its user (Ctrl-C under `flare run`): failures that are
    # only consequences (signals, KeyboardInterrupt, closed connections) are that stop, and
    # the step each rank was in is cut short or stretched by it (frame.warm_mask). Set by
    # `flare run`, and read back from the job's `flare.run.stop` span (pipeline.diagnose).
    stopped_by_user: bool = False
    # Added: a pass over a job still running (`flare run`'s live alerts, `flare diagnose
    # --follow`), whose last steps may be the start of something lasting: a straggler
    # is then not held to `min_persist_s` (detectors/straggler.py `_a_hiccup`).
    live: bool = False
    # Labels must persist this many steps (ByteRobust-style persistence) to be reported.
    min_persist_steps: int = 5
    # Added: ...and a slowdown (fail-slow, collective-slow) this many seconds of the job's
    # time as well, and a straggler's runs together outside live passes (`live`). A
    # host's hiccups — a checkpoint's write-back, another process
    # starting, an evaluation's first batches — last a fraction of a second, which is
    # five steps and more of a job with 15-ms steps (healthy jobs labelled over their
    # last 6-25 steps, 0.12-0.38 s; injected faults lasted 1.6 s and more).
    min_persist_s: float = 1.0
    # Added: a straggler must be the culprit of this many steps (5 labelled 1-s CPU-starvation
    # bursts on a shared host as stragglers).
    straggler_min_steps: int = 10
    # Added: a lasting straggler over under half the run must cost this share of it: a
    # short episode early in a long job (a loaded host starving one rank's DataLoader worker for 14
    # steps of 1,000: 0.2 % of the run) is a blip, alerted live while the run was short,
    # withdrawn with its figures in the final report.
    straggler_min_run_share: float = 0.01
    # Relative shift for a change point to count as fail-slow (Greyhound: >= 10%).
    fail_slow_min_shift: float = 0.10
    # Added: a change point must also stand this many noise units (MAD) above the noise.
    fail_slow_min_score: float = 4.0
    # Added: ...and put this share of steps on their own side of the two levels' midpoint
    # (measured: 0.81–0.96 for injected faults, 0.67–0.70 for load bursts on a shared host).
    change_min_consistency: float = 0.78
    # Added: a straggler's own step time (without waiting) must be this much slower than its
    # peers', as a ratio peers/culprit (NVIDIA resiliency flags < 0.75; the noise rule below
    # does most of the filtering, so this only asks for a visible 10%).
    straggler_max_relative_score: float = 0.9
    # Added: ...and exceed them by this many units of the job's own rank-to-rank noise
    # (MAD of each rank's time around its step's median), so a noisy machine where
    # ranks take turns being slow does not produce stragglers.
    straggler_min_noise_units: float = 4.0
    # Added: steps at the start of a job that are warm-up, not steady state.
    warmup_steps: int = 3
    # Added: longer jobs are bucketed so rank × step matrices stay this wide at most...
    max_step_columns: int = 1200
    # ...and hold this many cells at most (ranks × columns): an hour of 6,144 ranks is
    # read in buckets of 15 steps, 244 columns, rather than 1,200 columns of 3 (7.4 M
    # cells, ~3 GiB of matrices and step table). Up to 1,250 ranks the column cap rules.
    max_frame_cells: int = 1_500_000
    # Added: a component names the cause only if it explains this share of the excess.
    cause_min_share: float = 0.5
    # Added: a rank is silent when unheard-of for this many heartbeat intervals.
    silent_heartbeats: float = 3.0
    baseline: JobData | None = None


Detector = Callable[[JobData, DiagnosisConfig], list[Anomaly]]
