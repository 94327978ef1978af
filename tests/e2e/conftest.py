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
