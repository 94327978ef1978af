"""Dataloader stall (cause `input`): ranks that wait on their input pipeline.

A rank stalls when fetching batches takes a visible share of its step *and* much
longer than its own usual fetch (or than its peers'), persistently. When every rank
stalls together there is no straggler to blame: this label is the diagnosis.
"""

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
    return share_anomalies(frame, config, book, component="dataloader", kind="dataloader_stall",
                           cause="input", what="waits for its data loader")
