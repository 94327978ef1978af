"""What every `flare` command shares: the default store, the one-line user error,
and writing a report where it was asked for (`cli` and `run` both use them; neither
imports the other for them)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flare.diagnostics.model import DiagnosisConfig

DEFAULT_STORE = os.path.join(".flare", "store.duckdb")


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


def emit(diagnosis, job_data, config: DiagnosisConfig, fmt: str, output: str | None) -> None:
    if fmt == "json":
        text = json.dumps(diagnosis.to_json(), indent=2) + "\n"
    elif fmt == "html":
        from flare.diagnostics import report_html

        text = report_html.render(diagnosis, diagnosis.job_data or job_data, config)
    else:
        from flare.diagnostics import report_text

        colour = output is None and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        text = report_text.render(diagnosis, colour=colour)
    if output:
        try:
            with open(output, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:
            raise UserError(f"cannot write {output}: {exc.strerror}") from None
        if fmt != "text":
            print(f"flare: wrote {fmt} report to {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
