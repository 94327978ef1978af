"""Options of the test tiers (README, .ci/run).

A plain `pytest` from the repository root (no paths, no -m, -k, --lf or --ff) is the
fast tier: everything but the tests marked e2e, which start real torchrun jobs and
collectors (`pytest -n 2`: about 3 minutes). Naming paths, a marker or keyword
expression, or asking for the last failures runs what they select, e2e included;
`tests/run-all` runs every test, in three sessions.

The e2e diagnosis scenarios run on a quiet host and on a loaded one (tests/e2e). By
default both variants run in the one session, the loaded one beside its own busy
processes. CI (tests/run-all) runs them as two tiers, one scenario at a time: the quiet
variants, then the loaded ones, each beside one busy process per core of its own and
compared with its quiet variant's verdict kept on disk (--verdicts). --busy-host keeps
one set of busy processes for the whole session instead (with -n 2, a heavier load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HOSTS = ("quiet", "loaded")


def pytest_addoption(parser):
    group = parser.getgroup("flare", "Flare's test tiers")
    group.addoption("--hosts", default="quiet,loaded",
                    help="the host variants of the e2e diagnosis scenarios to run: quiet, "
                         "loaded or both, comma-separated (default both)")
    group.addoption("--busy-host", action="store_true",
                    help="keep one busy process per core running for the whole session; the "
                         "loaded variants (and every xdist worker) share them")
    group.addoption("--verdicts", default=None, metavar="DIR",
                    help="keep each scenario's verdict in DIR, so a later session's loaded "
                         "variants are compared with an earlier session's quiet ones")


def pytest_configure(config):
    hosts = [h.strip() for h in config.getoption("hosts").split(",") if h.strip()]
    unknown = sorted(set(hosts) - set(HOSTS))
    if unknown or not hosts:
        raise SystemExit(f"--hosts takes quiet, loaded or both, not {','.join(unknown) or 'nothing'}")
    config.flare_hosts = hosts
    config.flare_hogs = []
    if config.getoption("busy_host") and not hasattr(config, "workerinput"):  # the controller's
        config.flare_hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                             for _ in range(os.cpu_count() or 1)]


def pytest_collection_modifyitems(config, items):
    """A plain `pytest` leaves the e2e tests out (the fast tier). Otherwise the e2e tests
    first (their order among themselves kept): each runs a real job for tens of seconds,
    and handed out last one of them would run alone at the end while the other workers
    sit idle."""
    option = config.option
    plain = not (option.markexpr or option.keyword or getattr(option, "lf", False)
                 or getattr(option, "failedfirst", False))
    if config.args_source == config.ArgsSource.TESTPATHS and plain:
        e2e = [item for item in items if item.get_closest_marker("e2e") is not None]
        if e2e:
            config.hook.pytest_deselected(items=e2e)
            items[:] = [item for item in items if item.get_closest_marker("e2e") is None]
        return
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


def pytest_unconfigure(config):
    for hog in getattr(config, "flare_hogs", []):
        hog.kill()
        hog.wait(timeout=10)


def pytest_terminal_summary(terminalreporter, config):
    """The quiet-versus-loaded agreement table of the scenarios that ran (from the
    verdict folder when there is one: xdist workers keep theirs there)."""
    folder = config.getoption("verdicts")
    table: dict[str, dict[str, dict]] = {}
    if folder and Path(folder).is_dir():
        for path in sorted(Path(folder).glob("*.json")):
            verdict = json.loads(path.read_text())
            table.setdefault(verdict["scenario"], {})[verdict["host"]] = verdict
    else:
        harness = sys.modules.get("harness")
        for scenario, by_host in (getattr(harness, "VERDICTS", None) or {}).items():
            table[scenario] = {host: v.to_json(scenario, host) for host, v in by_host.items()}
    if not table:
        return
    terminalreporter.section("diagnosis on a quiet and a loaded host")
    agreeing = both = 0
    for scenario, by_host in sorted(table.items()):
        quiet, loaded = by_host.get("quiet"), by_host.get("loaded")
        mark = ""
        if quiet is not None and loaded is not None:
            both += 1
            same = not loaded.get("differences")
            agreeing += same
            mark = " same" if same else f" DIFFERS ({'; '.join(loaded['differences'])})"
        terminalreporter.write_line(
            f"{scenario}: quiet: {quiet['text'] if quiet else '-'} | loaded: "
            f"{loaded['text'] if loaded else '-'}{mark}")
    terminalreporter.write_line(f"{agreeing} of {both} scenarios give the same answer loaded as quiet")
