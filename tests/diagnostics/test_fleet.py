"""`flare nodes`: across jobs, the host behind repeated culprits is named and excluded,
on the DuckDB store and on ClickHouse (chDB) alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest

from flare.diagnostics import fleet
from flare.diagnostics.backends import open_backend
from flare.diagnostics.synthetic import Fault, job_spans
from flare.exporters import store as flare_store
from flare.wire import semconv as sc

BAD_HOST = "gpu-node-07"
# job → (the slow rank, the hosts of ranks 0-3): the bad host runs a different rank in
# each of its three jobs; node-12 is a culprit once; the last job is healthy.
JOBS = {
    "llama-a": (2, ["gpu-node-01", "gpu-node-02", BAD_HOST, "gpu-node-03"]),
    "llama-b": (0, [BAD_HOST, "gpu-node-04", "gpu-node-05", "gpu-node-06"]),
    "llama-c": (3, ["gpu-node-02", "gpu-node-03", "gpu-node-05", BAD_HOST]),
    "bert-d": (1, ["gpu-node-01", "gpu-node-12", "gpu-node-04", "gpu-node-06"]),
    "bert-e": (None, ["gpu-node-01", "gpu-node-02", BAD_HOST, "gpu-node-12"]),
}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet") / "store.duckdb"
    with flare_store.writer(path) as con:
        for seed, (job, (slow, hosts)) in enumerate(JOBS.items()):
            faults = () if slow is None else (Fault("compute", slow, 20),)
            table = job_spans(job, 4, 80, faults, seed=seed, hiccups=0.05,
                              start_ns=1_700_000_000_000_000_000 + seed * 10**12)
            by_rank = table.column("rank").to_pylist()
            table = table.set_column(table.column_names.index("host"), "host",
                                     pa.array([None if r is None else hosts[r] for r in by_rank]))
            flare_store.insert_spans(con, table)
    return path


def _check(result):
    assert result["jobs"] == 5
    top = result["nodes"][0]
    assert top["host"] == BAD_HOST, result["nodes"][:3]
    assert (top["jobs"], top["culprit_jobs"]) == (4, 3)
    assert top["lost_s"] > 0 and {lab["job"] for lab in top["labels"]} == {"llama-a", "llama-b", "llama-c"}
    once = next(n for n in result["nodes"] if n["host"] == "gpu-node-12")
    assert once["culprit_jobs"] == 1
    assert result["exclude"] == [BAD_HOST]
    clean = [n for n in result["nodes"] if n["host"] not in (BAD_HOST, "gpu-node-12")]
    assert all(n["culprit_jobs"] == 0 and n["lost_s"] == 0 for n in clean), clean


def test_the_host_behind_repeated_culprits_is_named_and_excluded(store_path):
    result = fleet.fleet(open_backend(f"store:{store_path}"), min_jobs=2)
    _check(result)
    # a window that ends before the last jobs leaves them out
    later = fleet.fleet(open_backend(f"store:{store_path}"), since_s=60, now_s=1_700_004_010.0)
    assert later["jobs"] == 1 and later["exclude"] == []


def test_the_same_on_clickhouse(store_path, tmp_path):
    pytest.importorskip("chdb", reason="chdb is not installed (pip install chdb)")
    script = ("import json, sys\n"
              "from flare.diagnostics import fleet\n"
              "from flare.diagnostics.backends import clickhouse\n"
              "backend = clickhouse.create_chdb(sys.argv[1])\n"
              "clickhouse.load_store(backend, sys.argv[2])\n"
              "print(json.dumps(fleet.fleet(backend)))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "chdb"), str(store_path)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    _check(result)
    assert result == json.loads(json.dumps(fleet.fleet(open_backend(f"store:{store_path}"))))


def test_flare_nodes_command(store_path):
    def flare_nodes(*args):
        return subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "nodes", "--store",
                               str(store_path), *args], capture_output=True, text=True, timeout=180,
                              check=False)

    done = flare_nodes("--format", "json")
    assert done.returncode == 0, done.stderr
    _check(json.loads(done.stdout))
    text = flare_nodes()
    assert text.returncode == 0 and text.stdout.splitlines()[1].startswith(BAD_HOST), text.stdout
    assert f"exclude (culprit in ≥ 2 of 5 jobs): {BAD_HOST}" in text.stdout
    for bad in (["--since", "a week"], ["--min-jobs", "0"]):
        refused = flare_nodes(*bad)
        assert refused.returncode != 0 and refused.stderr.strip().count("\n") == 0, refused.stderr
        assert "Traceback" not in refused.stderr


def _with_command(table: pa.Table, command: str | None) -> pa.Table:
    resources = []
    for text in table.column("resource").to_pylist():
        resource = json.loads(text)
        if command:
            resource["process.command"] = command
        resources.append(json.dumps(resource))
    return table.set_column(table.column_names.index("resource"), "resource", pa.array(resources))


def test_baseline_auto_passes_over_an_earlier_run_with_labels(tmp_path):
    """A run whose labels `flare run` wrote back is no baseline while a clean one of the
    same script is there (seen: a 60 % communication regression read "No anomalies found"
    against the run before it, a gc straggler); with only labelled runs, the latest is
    picked and the report says it carries labels."""
    path = tmp_path / "store.duckdb"

    def run(con, job, at_s, faults=(), labelled=False):
        table = _with_command(job_spans(job, 4, 60, faults, start_ns=1_700_000_000_000_000_000 + at_s * 10**9),
                              "train.py")
        if labelled:  # one of its spans as the written-back label
            names = table.column("name").to_pylist()
            names[0] = sc.SPAN_ANOMALY
            table = table.set_column(table.column_names.index("name"), "name", pa.array(names))
        flare_store.insert_spans(con, table)

    with flare_store.writer(path) as con:
        run(con, "healthy", 0)
        run(con, "gc", 1000, (Fault("gc", 1, 10),), labelled=True)
        run(con, "slower", 2000, (Fault("communication", 0, 0),))
    passed_over: list[str] = []
    assert fleet.auto_baseline(open_backend(f"store:{path}"), "slower", passed_over)[0] == "healthy"
    assert passed_over == ["gc"]
    done = subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--store", str(path),
                           "--job", "slower", "--baseline-job", "auto"],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0 and "Compared with job healthy" in done.stdout, done.stdout + done.stderr
    assert "Passed over for their labels: gc." in done.stdout
    only = tmp_path / "only.duckdb"
    with flare_store.writer(only) as con:
        run(con, "gc", 1000, (Fault("gc", 1, 10),), labelled=True)
        run(con, "next", 2000)
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--store", str(only), "--job", "next",
         "--baseline-job", "auto", "--format", "json"], capture_output=True, text=True, timeout=180,
        check=True).stdout)
    assert report["baseline"]["job"] == "gc" and report["baseline"]["labelled"] is True


def test_baseline_auto_picks_the_latest_earlier_run_of_the_same_script(tmp_path):
    """--baseline-job auto: the most recent job that ended before this one began, with
    the same script and world size — not a later run, not another script, not another
    world size — named in the report; without a script recorded it says so and goes on."""
    path = tmp_path / "store.duckdb"
    runs = [("pretrain-1", "train.py", 4, 0, ()), ("pretrain-2", "train.py", 4, 1000, ()),
            ("eval-1", "eval.py", 4, 1500, ()), ("pretrain-wide", "train.py", 8, 1700, ()),
            ("pretrain-3", "train.py", 4, 2000, (Fault("communication", 0, 0),)),
            ("pretrain-4", "train.py", 4, 3000, ()), ("no-script", None, 4, 4000, ())]
    with flare_store.writer(path) as con:
        for seed, (job, command, world, at_s, faults) in enumerate(runs):
            table = job_spans(job, world, 60, faults, seed=seed, bytes_per_step=1 << 20,
                              start_ns=1_700_000_000_000_000_000 + at_s * 10**9)
            flare_store.insert_spans(con, _with_command(table, command))
    picked, found = fleet.auto_baseline(open_backend(f"store:{path}"), "pretrain-3")
    assert picked == "pretrain-2"
    assert found == {"command": "train.py", "world_size": 4, "service": None}

    def diagnose(job, fmt):
        return subprocess.run([sys.executable, "-m", "flare.diagnostics.cli", "diagnose", "--store",
                               str(path), "--job", job, "--baseline-job", "auto", "--format", fmt],
                              capture_output=True, text=True, timeout=180, check=False)

    done = diagnose("pretrain-3", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["baseline"]["job"] == "pretrain-2" and report["baseline"]["picked"] == "auto"
    assert "regression" in [a["kind"] for a in report["anomalies"]], report["anomalies"]
    text = diagnose("pretrain-3", "text")
    assert ("Compared with job pretrain-2, picked as the most recent earlier job with the same "
            "signature (script train.py, 4 ranks)") in text.stdout
    alone = diagnose("no-script", "json")
    assert alone.returncode == 0 and "baseline" not in json.loads(alone.stdout)
    assert alone.stderr.strip() == ("flare: no earlier job with the same signature (no script "
                                    "recorded): diagnosing without a baseline")
