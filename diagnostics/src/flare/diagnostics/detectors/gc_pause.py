"""GC pause (cause `gc`): ranks whose Python garbage collection takes a visible
share of each step, persistently (gc.callbacks time reported per step)."""

from __future__ import annotations

from flare.diagnostics import frame as frames
from flare.diagnostics.detectors import straggler
from flare.diagnostics.detectors._share import share_anomalies
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData


def detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]:
    frame = frames.load(job, config)
    if frame is None:
        return []
    book = straggler.ledger(job, frame, config)[0] if len(frame.ranks) >= 2 else None
    return share_anomalies(frame, config, book, component="gc", kind="gc_pause", cause="gc",
                           what="pauses in garbage collection")
