"""`flare collector` and `flare import-kineto` delegate to their components; errors stay one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FLARE = str(Path(sys.executable).parent / "flare")
KINETO = Path("/work/shared/data/kineto/nccl2ranks_rank0.json.gz")


def _flare(*args, cwd=None, timeout=120):
    return subprocess.run([FLARE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_collector_with_a_missing_config_is_one_line(tmp_path):
    result = _flare("collector", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_import_kineto_then_diagnose(tmp_path):
    if not KINETO.exists():
        pytest.skip("shared Kineto traces are not on this machine")
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(KINETO, traces)
    store = tmp_path / "k.duckdb"
    result = _flare("import-kineto", str(traces), "--store", str(store), "--job", "kineto")
    assert result.returncode == 0, result.stderr
    assert "imported 1 trace file(s)" in result.stdout
    report = _flare("diagnose", "--store", str(store), "--format", "json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["job"] == "kineto"


def test_import_kineto_of_nothing_is_one_line(tmp_path):
    result = _flare("import-kineto", str(tmp_path / "missing"), "--store", str(tmp_path / "s.duckdb"))
    assert result.returncode == 1
    assert result.stderr.startswith("flare: error:") and "Traceback" not in result.stderr


def test_import_kineto_with_a_truncated_file_keeps_the_good_one_and_fails(tmp_path):
    import gzip

    if not KINETO.exists():
        pytest.skip("shared Kineto traces are not on this machine")
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(KINETO, traces / "rank0.json.gz")
    (traces / "rank1.json.gz").write_bytes(gzip.compress(gzip.decompress(KINETO.read_bytes())[:50_000])[:-20])
    store = tmp_path / "k.duckdb"
    result = _flare("import-kineto", str(traces), "--store", str(store), "--job", "partial")
    assert result.returncode == 1
    assert "imported 1 trace file(s)" in result.stdout
    assert [line for line in result.stderr.splitlines()] == [
        line for line in result.stderr.splitlines() if line.startswith("flare: skipped")]
    assert "rank1.json.gz" in result.stderr and "Traceback" not in result.stderr
    report = _flare("diagnose", "--store", str(store), "--format", "json")
    assert report.returncode == 0 and json.loads(report.stdout)["job"] == "partial"


def test_the_print_config_command_the_collector_help_shows_works():
    """Seen: the help said "`flare collector --print-config NAME` shows it", which fails
    (--print-config is a flag; the name goes to --config)."""
    import re

    shown = re.search(r"`(flare collector [^`]*)` shows it",
                      " ".join(_flare("collector", "--help").stdout.split()))
    assert shown, "the help names no command that shows a shipped configuration"
    result = _flare(*shown.group(1).replace("NAME", "embedded").split()[1:])
    assert result.returncode == 0, result.stderr
    assert "receivers:" in result.stdout


def test_the_docs_command_list_has_every_command_and_shipped_config():
    """Seen: docs/diagnostics.md's command list left out `flare job-token`, and its
    `collector --config` choices left out `secure`."""
    import argparse
    import re

    from flare.collector import shipped
    from flare.diagnostics.cli import _parser

    docs = (Path(__file__).parents[2] / "docs" / "diagnostics.md").read_text()
    listing = docs.split("## Commands", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^flare ([a-z-]+)", listing, re.MULTILINE))
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert listed == set(commands.choices)
    choices = re.search(r"^flare collector --config (\S+)", listing, re.MULTILINE).group(1).split("|")
    assert choices == ["FILE", *shipped.NAMES]
