"""Which of the follow service's labels are new: each anomaly is written back once,
through re-detection on later polls with a slightly different onset, write failures
(an anomaly is remembered as sent only after the write succeeded) and restarts
(anomaly spans already in the backend are read back at start).
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa

from flare.diagnostics import writeback
from flare.diagnostics.backends import Backend, BackendError
from flare.diagnostics.columns import Table
from flare.diagnostics.incremental import as_arrow
from flare.diagnostics.model import Anomaly, JobData
from flare.wire import semconv as sc

# Two labels of one kind, rank set and cause whose onsets lie this close are one anomaly
# seen twice (a change point's onset moves a little as more steps arrive).
SAME_ONSET_STEPS = 25


@dataclasses.dataclass
class Labeller:
    """Decides which anomalies are new; remembers only what was written."""

    sent: dict[str, Anomaly] = dataclasses.field(default_factory=dict)
    sent_signatures: list[tuple[str, tuple[int, ...], str, int | None]] = dataclasses.field(
        default_factory=list
    )

    @staticmethod
    def signature(anomaly: Anomaly) -> tuple[str, tuple[int, ...], str, int | None]:
        return anomaly.kind, tuple(sorted(anomaly.ranks)), anomaly.cause, anomaly.first_step

    def is_new(self, anomaly: Anomaly) -> bool:
        if anomaly.key in self.sent:
            return False
        kind, ranks, cause, first = self.signature(anomaly)
        for s_kind, s_ranks, s_cause, s_first in self.sent_signatures:
            if (s_kind, s_ranks, s_cause) != (kind, ranks, cause):
                continue
            if first is None or s_first is None or abs(first - s_first) <= SAME_ONSET_STEPS:
                return False
        return True

    def remember(self, anomaly: Anomaly) -> None:
        self.sent[anomaly.key] = anomaly
        self.sent_signatures.append(self.signature(anomaly))

    def remember_written(self, table: Table) -> None:
        """Seed from `flare.anomaly` spans already in the backend (a restarted service)."""
        for text in table.column("attributes").to_pylist() if table.num_rows else []:
            try:
                attrs = json.loads(text or "{}")
                self.sent_signatures.append((
                    str(attrs[sc.ANOMALY_KIND]),
                    tuple(sorted(int(r) for r in attrs.get(sc.ANOMALY_RANKS) or [])),
                    str(attrs.get(sc.ANOMALY_CAUSE)),
                    attrs.get(sc.ANOMALY_FIRST_STEP),
                ))
            except (ValueError, KeyError, TypeError):
                continue

    def read_back(self, backend: Backend, job: str | None, inner: JobData) -> None:
        """Seed from the labels already written back for `job` (a restarted service)."""
        try:
            self.remember_written(inner.spans([sc.SPAN_ANOMALY]))
            if getattr(backend, "path", None) is None:
                # On Jaeger and Tempo a job is a service, and written-back labels are
                # the diagnostics service's spans, each naming its job.
                written = as_arrow(backend.job_data(writeback.SERVICE).spans(
                    [sc.SPAN_ANOMALY]))
                if written.num_rows:
                    mine = [json.loads(text or "{}").get(sc.JOB_ID) == job
                            for text in written.column("resource").to_pylist()]
                    self.remember_written(written.filter(pa.array(mine)))
        except BackendError:
            pass  # best effort: without it a restart may repeat a label, never lose one
