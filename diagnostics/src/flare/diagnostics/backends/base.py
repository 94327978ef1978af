"""What every backend is: the `Backend` protocol and the one error a user can act on.
Its own module, so each backend imports it without importing the package that opens
them (`open_backend` imports the backends)."""

from __future__ import annotations

from typing import Protocol

from flare.diagnostics.model import JobData


class BackendError(Exception):
    """A backend problem a user can act on; the message is one sentence."""


class Backend(Protocol):
    name: str  # e.g. "store:/path/to/store.duckdb"

    def jobs(self) -> list[str]: ...

    def job_data(self, job: str) -> JobData: ...

    def close(self) -> None: ...
