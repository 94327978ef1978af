"""The declared version floors are the tested ones.

`check_versions.py` installs `FLOORS` and runs a real job on them; this keeps that
table and the six pyproject.toml files saying the same thing, and (in CI, where the
package index is reachable) runs the floor arm itself. The newest arm is the dev
set-up CI runs everything else on (requirements-dev.txt takes the newest releases).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

sys.path.insert(0, str(Path(__file__).parent))
import check_versions

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, str]:
    """Lowest version each package's requirement allows, over the six packages."""
    floors: dict[str, str] = {}
    for package in check_versions.PACKAGES:
        project = tomllib.loads((ROOT / package / "pyproject.toml").read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements.extend(extra)
        for requirement in requirements:
            match = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
            if match:
                floors[match.group(1).lower()] = match.group(2)
    return floors


def test_the_floor_table_is_what_the_packages_declare():
    declared = _declared()
    for name, version in check_versions.FLOORS.items():
        assert name in declared, f"{name} is tested at a floor but not declared"
        assert re.sub(r"\.0$", "", version) .startswith(re.sub(r"\.0$", "", declared[name])), \
            (name, version, declared[name])
    untested = {n for n in declared if n.startswith(("opentelemetry", "protobuf", "grpcio", "duckdb",
                                                      "pyarrow", "numpy", "pyyaml", "googleapis"))
                and n not in check_versions.FLOORS}
    assert not untested, f"declared but never installed at their floor: {untested}"


@pytest.mark.e2e
def test_a_job_at_the_declared_floors_is_diagnosed(tmp_path):
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            str(tmp_path / "probe"), "pyyaml==6.0"], capture_output=True, text=True,
                           timeout=120, check=False)
    if probe.returncode != 0:
        pytest.skip(f"the package index cannot be reached here: {probe.stderr.strip()[-200:]}")
    done = subprocess.run([sys.executable, str(Path(check_versions.__file__)), "floor",
                           "--root", str(tmp_path), "--json", str(tmp_path / "results.json")],
                          capture_output=True, text=True, timeout=1500, check=False)
    print(done.stdout)
    log = (tmp_path / "floor.log")
    assert done.returncode == 0, done.stdout + (log.read_text()[-4000:] if log.exists() else "")
