import os
import sys
import tempfile
from pathlib import Path

import pytest

# The shared helpers (harness.py) sit beside the tests; importlib mode does not put this
# folder on sys.path by itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def store():
    # A directory of our own: pytest prunes old basetemps, and on a shared machine
    # another session's pytest can prune this one's while the scenarios still run.
    with tempfile.TemporaryDirectory(prefix="flare-e2e-") as directory:
        yield Path(directory) / "store.duckdb"


@pytest.fixture(params=["quiet", "loaded"])
def host(request):
    """The host a diagnosis scenario runs on: quiet, or loaded with one busy process per
    core beside the job (harness.busy_host). Both variants assert the same answer, and
    the loaded one is compared with the quiet one as it finishes (harness.agree)."""
    import harness

    if request.param == "loaded":
        with harness.busy_host():
            yield "loaded"
    else:
        yield "quiet"


def pytest_terminal_summary(terminalreporter):
    """The quiet-versus-loaded agreement table of the scenarios that ran."""
    import harness

    if not harness.VERDICTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("diagnosis on a quiet and a loaded host")
    agreeing = both = 0
    for scenario, by_host in sorted(harness.VERDICTS.items()):
        quiet, loaded = by_host.get("quiet"), by_host.get("loaded")
        if quiet is not None and loaded is not None:
            both += 1
            same = not quiet.differences(loaded)
            agreeing += same
        mark = "" if quiet is None or loaded is None else ("same" if same else "DIFFERS")
        write(f"{scenario}: quiet: {quiet.text() if quiet else '-'} | loaded: "
              f"{loaded.text() if loaded else '-'} {mark}".rstrip())
    write(f"{agreeing} of {both} scenarios give the same answer loaded as quiet")
