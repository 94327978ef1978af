"""Declare what is tested, test what is declared: Flare at its dependencies' declared
floors and at their newest releases, end to end.

    .venv/bin/python tests/compat/check_versions.py                # floor and newest
    .venv/bin/python tests/compat/check_versions.py floor --tests  # + the unit subset
    .venv/bin/python tests/compat/check_versions.py floor --torch 2.5.1   # another torch

For each arm a fresh virtual environment (under --root, default /tmp/flare-compat):
the arm's dependency versions (`FLOORS`: exactly the lowest that the six packages'
pyproject.toml files declare; `newest`: whatever the index has now), then the six
Flare packages built from this tree (not editable: the tree's own builds stay as they
are), then `pip check` (the declared ranges hold those versions), then a real job:
`flare run` of a 4-rank torchrun DDP job with rank 2 slowed from step 20 — the
instrumentation in every rank, OTLP/HTTP to the embedded collector, the DuckDB store,
the diagnosis — which must name rank 2, cause compute. `--tests` also runs the unit
tests of the instrumentation, the collector's receiver and the store backends there.

torch: the dev set-up's CPU build (2.13.0, from local disk) unless --torch names
another; other versions come from the index as CUDA builds of several GB (opt-in, not
in CI). A floor that fails here is raised in pyproject.toml, never left declared.
Exit status 1 when an arm fails; one table of versions and results at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("wire", "instrumentation", "processors", "exporters", "otel-collector", "diagnostics")
# The declared floors (pyproject.toml of the six packages); test_declared_floors.py
# checks that this table and the declarations agree.
FLOORS = {
    "opentelemetry-api": "1.28.0",
    "opentelemetry-sdk": "1.28.0",
    "opentelemetry-proto": "1.28.0",
    "opentelemetry-exporter-otlp-proto-grpc": "1.28.0",
    "opentelemetry-exporter-otlp-proto-http": "1.28.0",
    "opentelemetry-instrumentation": "0.49b0",
    "opentelemetry-distro": "0.49b0",
    "opentelemetry-opamp-client": "0.5b0",
    "protobuf": "5.26.0",
    "grpcio": "1.63.2",
    "googleapis-common-protos": "1.63.1",
    "duckdb": "1.2.0",
    "pyarrow": "14.0.0",
    "numpy": "1.24.4",
    "pyyaml": "6.0",
    "urllib3": "1.26.0",
}
SHOWN = ("torch", "opentelemetry-sdk", "opentelemetry-instrumentation", "opentelemetry-proto",
         "protobuf", "grpcio", "duckdb", "pyarrow", "numpy")
UNIT_TESTS = ("tests/instrumentation/test_instrumentor.py", "tests/collector/test_receivers.py",
              "tests/diagnostics/test_backends.py")


def _run(command: list[str], log, timeout_s: float, **kwargs) -> int:
    log.write(f"$ {' '.join(map(str, command))}\n")
    log.flush()
    try:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              check=False, **kwargs).returncode
    except subprocess.TimeoutExpired:
        log.write(f"timed out after {timeout_s:.0f} s\n")
        return 124


def arm(name: str, root: Path, torch_version: str, unit_tests: bool) -> dict:
    venv = root / name
    log_path = root / f"{name}.log"
    result = {"arm": name, "log": str(log_path)}
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        python = venv / "bin" / "python"
        # --no-compile: byte-compiling all of torch at install is most of the arm's CPU;
        # what the job imports is compiled as it is first imported
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--no-compile"]
        pins = ([f"{p}=={v}" for p, v in FLOORS.items()] if name == "floor"
                else ["--upgrade", *FLOORS])
        extra = ["pytest>=8", "pytest-timeout>=2.3", "pytest-rerunfailures>=14"] if unit_tests else []
        steps = [
            ("venv", [sys.executable, "-m", "venv", str(venv)], 120),
            ("dependencies", [*pip, *pins, f"torch=={torch_version}", "setuptools>=77", *extra], 1800),
            ("flare packages", [*pip, "--no-deps", "--no-build-isolation",
                                *(str(ROOT / p) for p in PACKAGES)], 600),
            ("pip check", [str(python), "-m", "pip", "check"], 120),
            ("shipped configs", [str(venv / "bin" / "flare"), "collector", "--config", "tempo",
                                 "--print-config"], 60),
        ]
        for step, command, timeout_s in steps:
            if _run(command, log, timeout_s) != 0:
                result.update(status="FAIL", failed=step)
                return result
        listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"],
                                capture_output=True, text=True, check=False).stdout
        versions = {p["name"].lower(): p["version"] for p in json.loads(listed or "[]")}
        result["versions"] = {p: versions.get(p, "-") for p in SHOWN}
        result.update(_job(venv, root / f"{name}-job", log))
        if result["status"] == "PASS" and unit_tests:
            code = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-m", "not e2e", *UNIT_TESTS], log, 900, cwd=ROOT)
            result["unit_tests"] = "PASS" if code == 0 else "FAIL"
            if code != 0:
                result.update(status="FAIL", failed="unit tests")
    result["seconds"] = round(time.monotonic() - started)
    return result


def _job(venv: Path, folder: Path, log) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    bin_dir = venv / "bin"
    report = folder / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLARE_", "PYTHON"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    code = _run([str(bin_dir / "flare"), "run", "--store", str(folder / "store.duckdb"),
                 "--job", "compat", "--format", "json", "-o", str(report), "--",
                 str(bin_dir / "torchrun"), "--nproc_per_node", "4", str(ROOT / "examples" / "train_ddp.py"),
                 "--steps", "60", "--hidden", "256", "--fault", "compute", "--fault-rank", "2",
                 "--fault-from", "20"], log, 600, cwd=folder, env=env)
    if code != 0 or not report.exists():
        return {"status": "FAIL", "failed": f"flare run (exit {code})"}
    anomalies = json.loads(report.read_text())["anomalies"]
    labels = [(a["kind"], a["ranks"], a["cause"]) for a in anomalies]
    ok = ("straggler", [2], "compute") in labels
    log.write(f"labels: {labels}\n")
    return {"status": "PASS" if ok else "FAIL", "labels": labels,
            **({} if ok else {"failed": "diagnosis"})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (no `choices`: argparse refuses an empty list against them, so no arm would mean both)
    parser.add_argument("arms", nargs="*", metavar="floor|newest", help="the arms (default both)")
    parser.add_argument("--torch", default="2.13.0", help="torch version for every arm")
    parser.add_argument("--tests", action="store_true", help="also the unit-test subset")
    parser.add_argument("--root", type=Path, default=Path("/tmp/flare-compat"))
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms if a not in ("floor", "newest")]
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r} (floor or newest)")
    args.root.mkdir(parents=True, exist_ok=True)
    results = [arm(name, args.root, args.torch, args.tests) for name in (args.arms or ["floor", "newest"])]
    print(f"{'arm':<8} {'status':<6} " + " ".join(f"{p.removeprefix('opentelemetry-'):<16}" for p in SHOWN))
    for r in results:
        versions = r.get("versions", {})
        print(f"{r['arm']:<8} {r['status']:<6} " + " ".join(f"{versions.get(p, '-'):<16}" for p in SHOWN)
              + (f"  failed at: {r['failed']} (see {r['log']})" if r["status"] != "PASS" else "")
              + f"  {r.get('seconds', '?')} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["status"] == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
