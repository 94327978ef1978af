"""The dead-letter directory: acknowledged requests the store could not take.

An OK reply promises that a request reaches the store. A batch the store refuses
(after the retries of pipeline.ExportGate) or a write-ahead log record that no longer
parses is not dropped: it is written here, in the write-ahead log's directory
(`<wal>/dead-letter/`), as the OTLP protobuf request it was, one file per batch:

    <first lsn, 20 digits>-<traces|metrics>.pb    the ExportTrace/MetricsServiceRequest
    <first lsn, 20 digits>-<traces|metrics>.txt   why, and the lsns it held

so it can be inspected (`protoc --decode`) or sent again once the cause is fixed
(`curl -H 'Content-Type: application/x-protobuf' --data-binary @FILE
http://COLLECTOR:4318/v1/traces`). Both are on disk (fsync) before the log position
moves past the batch. The collector counts them (`dead_letter_requests`,
`dead_letter_spans`, `dead_letter_metric_points` on /metrics) and logs one line each.
"""

from __future__ import annotations

import os
from pathlib import Path


class DeadLetter:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def write(self, traces: bool, payload: bytes, lsns: list[int], reason: str) -> Path:
        """Store one request durably; returns its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        signal = "traces" if traces else "metrics"
        stem = f"{min(lsns) if lsns else 0:020d}-{signal}"
        path = self.directory / f"{stem}.pb"
        serial = 1
        while path.exists():  # the same lsn again (a later start): keep both
            path = self.directory / f"{stem}.{serial}.pb"
            serial += 1
        note = f"{reason}\nlsns: {' '.join(map(str, sorted(lsns))) or 'none'}\n"
        _write_durably(path.with_suffix(".txt"), note.encode())
        _write_durably(path, payload)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return path


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
