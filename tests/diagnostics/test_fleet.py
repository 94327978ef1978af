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
