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
    # FLARE_E2E_KEEP=DIR keeps the store there, to read a failed scenario's spans again.
    kept = os.environ.get("FLARE_E2E_KEEP")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix="flare-e2e-", dir=kept)) / "store.duckdb"
        return
    with tempfile.TemporaryDirectory(prefix="flare-e2e-") as directory:
        yield Path(directory) / "store.duckdb"


def pytest_generate_tests(metafunc):
    if "host" in metafunc.fixturenames:  # marked: the tiers select the host variants by it
        metafunc.parametrize("host", [pytest.param(h, marks=pytest.mark.host_variant)
                                      for h in metafunc.config.flare_hosts], indirect=True)


@pytest.fixture(autouse=True)
def _no_job_left_running():
    """A test that fails while its `flare run` runs must not leave the job (and its hold on
    the module's store) to the tests after it."""
    import harness

    yield
    while harness.RUNNING:
        harness.RUNNING.pop().stop()


@pytest.fixture(scope="session", autouse=True)
def _verdict_folder(pytestconfig):
    import harness

    folder = pytestconfig.getoption("verdicts")
    harness.VERDICTS_DIR = Path(folder) if folder else None
    if harness.VERDICTS_DIR is not None:
        harness.VERDICTS_DIR.mkdir(parents=True, exist_ok=True)


@pytest.fixture
def host(request):
    """The host a diagnosis scenario runs on: quiet, or loaded with one busy process per
    core beside the job (its own, harness.busy_host, or the session's: --busy-host).
    Both variants assert the same answer, and the loaded one is compared with the quiet
    one as it finishes (harness.agree)."""
    import harness

    if request.param == "loaded" and not request.config.getoption("busy_host"):
        with harness.busy_host():
            yield "loaded"
    else:
        if request.param == "quiet" and request.config.getoption("busy_host"):
            pytest.skip("the quiet variant does not run beside the session's busy processes")
        yield request.param
