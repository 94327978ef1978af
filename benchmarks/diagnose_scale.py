"""Diagnosis at scale: one hour of a 1,024-rank job at one step per second.

Builds the store with DuckDB SQL (fast, no Python per row) at realistic volumes:
  - one `train.step` span per rank per step with the always-on summary attributes
    (3,686,400 spans for the default hour);
  - detail steps every 100: per rank 4 collectives, 2 dataloader fetches, 1 GC span
    and 1 hot Python call (~250 k spans);
  - one heartbeat per rank every 10 s (~370 k spans) and one correlator
    `train.step.ranks` span per step;
  - two real faults to find: rank 517's compute grows by 25 % from the middle of the
    hour, and earlier (from 1/6 to 1/3 of the hour) the 8 ranks of node 40 compute 30 %
    more (a slow node).
Then times `flare diagnose --format json` in a fresh process and reads its peak RSS,
and checks the answer names rank 517 with cause compute, and node 40's ranks as one
straggler label naming the node.

    .venv/bin/python benchmarks/diagnose_scale.py [--ranks 1024] [--steps 3600] [--keep PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from child_measure import run_measured

from flare.exporters import store as flare_store

JOB = "bench-1024"
T0_NS = 1_760_000_000_000_000_000
FAULT_RANK = 517  # or the middle rank of a smaller run


def fault_rank(ranks: int) -> int:
    return FAULT_RANK if ranks > FAULT_RANK else ranks // 2


def fault_node(ranks: int) -> int:
    """The slow node (8 ranks each): 40, or node 1 of a smaller run."""
    return 40 if ranks >= 8 * 41 and not 320 <= fault_rank(ranks) < 328 else 1


def build(path: str, ranks: int, steps: int) -> dict[str, int]:
    fault_from = steps // 2
    culprit = fault_rank(ranks)
    node = fault_node(ranks)
    with flare_store.writer(path, timeout_s=60) as con:
        con.execute("SET preserve_insertion_order = false")
        # Step time ~1 s; compute 700 ms, input 40 ms, gc 5 ms, hot calls 20 ms, the rest
        # is waiting in collectives for the slowest rank of the step.
        con.execute(f"""
        CREATE TEMP TABLE work AS
        SELECT s.step, r.rank,
               40 + 4 * (hash(s.step * 7919 + r.rank) % 1000) / 1000.0 AS dl,
               700 * (1 + 0.02 * ((hash(s.step * 31 + r.rank * 17) % 2001) / 1000.0 - 1))
                 * (CASE WHEN r.rank = {culprit} AND s.step >= {fault_from} THEN 1.25 ELSE 1 END)
                 * (CASE WHEN r.rank // 8 = {node} AND s.step >= {steps // 6} AND s.step < {steps // 3}
                    THEN 1.3 ELSE 1 END) AS comp,
               5.0 AS gc, 20.0 AS pyc
        FROM range({steps}) s(step), range({ranks}) r(rank)""")
        con.execute("""
        CREATE TEMP TABLE barrier AS
        SELECT step, max(dl + comp + gc + pyc) AS ready_max FROM work GROUP BY step""")
        con.execute(f"""
        INSERT INTO spans
        SELECT '{JOB}', '{JOB}',
               lpad(to_hex(hash('{JOB}', w.step)), 16, '0') || lpad(to_hex(hash(w.step, '{JOB}')), 16, '0'),
               lpad(to_hex(hash(w.step, w.rank)), 16, '0'), '', 'train.step', 1,
               {T0_NS} + w.step * 1000000000, {T0_NS} + w.step * 1000000000
                 + CAST((b.ready_max + 30) * 1e6 AS BIGINT),
               CAST((b.ready_max + 30) * 1e6 AS BIGINT), 0, '', w.rank, w.step,
               'node' || (w.rank // 8), 10000 + w.rank,
               printf('{{"flare.step": %d, "flare.step.dataloader_ms": %.3f, "flare.step.dataloader_count": 1, '
                      '"flare.step.compute_ms": %.3f, "flare.step.gc_ms": %.3f, "flare.step.gc_count": 1, '
                      '"flare.step.python_call_ms": %.3f, "flare.step.python_call_count": 2, '
                      '"flare.step.collective_wait_ms": %.3f, "flare.step.collective_count": 4, '
                      '"flare.step.collective_bytes": 268435456, "flare.step.pg.names": ["0"], '
                      '"flare.step.pg.wait_ms": [%.3f], "flare.step.detail": %s}}',
                      w.step, w.dl, w.comp, w.gc, w.pyc,
                      b.ready_max - (w.dl + w.comp + w.gc + w.pyc) + 30,
                      b.ready_max - (w.dl + w.comp + w.gc + w.pyc) + 30,
                      CASE WHEN w.step % 100 = 0 THEN 'true' ELSE 'false' END),
               printf('{{"service.name": "{JOB}", "flare.job.id": "{JOB}", "flare.rank": %d, '
                      '"flare.local_rank": %d, "flare.world_size": {ranks}, "flare.node_rank": %d, '
                      '"host.name": "node%d", "process.pid": %d}}',
                      w.rank, w.rank % 8, w.rank // 8, w.rank // 8, 10000 + w.rank),
               '[]', '[]'
        FROM work w JOIN barrier b USING (step)""")
        # Detail steps: children of train.step every 100th step.
        con.execute(f"""
        INSERT INTO spans
        SELECT '{JOB}', '{JOB}', lpad(to_hex(hash('{JOB}', s.step)), 32, '0'),
               lpad(to_hex(hash(s.step, r.rank, c.i)), 16, '0'), lpad(to_hex(hash(s.step, r.rank)), 16, '0'),
               CASE WHEN c.i < 4 THEN 'collective.all_reduce' WHEN c.i < 6 THEN 'dataloader.next'
                    WHEN c.i = 6 THEN 'gc.collect' ELSE 'python.call' END, 1,
               {T0_NS} + s.step * 1000000000 + c.i * 50000000,
               {T0_NS} + s.step * 1000000000 + c.i * 50000000 + 20000000, 20000000, 0, '',
               r.rank, s.step, 'node' || (r.rank // 8), 10000 + r.rank,
               printf('{{"flare.step": %d, "flare.collective.pg": "0", "flare.collective.seq": %d, '
                      '"flare.collective.bytes": 67108864, "flare.collective.busbw_gbps": 180.5}}',
                      s.step, s.step * 4 + c.i),
               printf('{{"flare.rank": %d, "flare.world_size": {ranks}}}', r.rank), '[]', '[]'
        FROM range(0, {steps}, 100) s(step), range({ranks}) r(rank), range(8) c(i)""")
        con.execute(f"""
        INSERT INTO spans
        SELECT '{JOB}', '{JOB}', lpad(to_hex(hash('hb', h.t, r.rank)), 32, '0'),
               lpad(to_hex(hash('hb', h.t, r.rank)), 16, '0'), '', 'flare.heartbeat', 1,
               {T0_NS} + h.t * 1000000000, {T0_NS} + h.t * 1000000000, 0, 0, '', r.rank, NULL,
               'node' || (r.rank // 8), 10000 + r.rank,
               printf('{{"flare.heartbeat.last_step": %d, "flare.heartbeat.interval_s": 10}}', h.t),
               printf('{{"flare.rank": %d, "flare.world_size": {ranks}}}', r.rank), '[]', '[]'
        FROM range(0, {steps}, 10) h(t), range({ranks}) r(rank)""")
        con.execute(f"""
        INSERT INTO spans
        SELECT '{JOB}', 'flare-collector', lpad(to_hex(hash('{JOB}', step)), 32, '0'),
               lpad(to_hex(hash('ranks', step)), 16, '0'), '', 'train.step.ranks', 1,
               {T0_NS} + step * 1000000000, {T0_NS} + step * 1000000000 + 1000000000, 1000000000, 0, '',
               NULL, step, NULL, NULL,
               printf('{{"flare.step": %d, "flare.ranks.count": {ranks}, "flare.ranks.expected": {ranks}}}', step),
               '%d', '[]', '[]'
        FROM range({steps}) s(step)""")
        counts = dict(con.execute("SELECT name, count(*) FROM spans GROUP BY name").fetchall())
    return counts


def load_chdb(path: str, directory: str) -> tuple[int, float]:
    """The store's spans into a chDB directory's `otel_traces`, as otelcol-contrib's
    ClickHouse exporter writes them (in a child: chDB holds its directory for the life
    of its process). Rows and seconds."""
    import subprocess

    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from flare.diagnostics.backends import clickhouse; "
         "print(clickhouse.load_store(clickhouse.create_chdb(sys.argv[1]), sys.argv[2]))",
         directory, path], capture_output=True, text=True, check=True)
    return int(done.stdout), time.perf_counter() - started


PULLED = """
import json, sys
from flare.diagnostics.backends import open_backend
from flare.diagnostics.model import DiagnosisConfig
from flare.diagnostics.pipeline import diagnose
backend = open_backend(sys.argv[1])
diagnose(backend.job_data(sys.argv[2]), DiagnosisConfig(), warn=lambda _: None)
stored = backend.query("SELECT sum(data_uncompressed_bytes) AS raw, sum(data_compressed_bytes) AS disk, "
                       "sum(rows) AS rows FROM system.parts WHERE active AND table = 'otel_traces'").to_pylist()[0]
print(json.dumps({"pulled": backend.bytes_received, **stored}))
"""


def pulled(spec: str) -> dict:
    """Bytes a diagnosis over `spec` received, against what the table holds."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", PULLED, spec, JOB], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def measure(path: str, backend: str | None = None) -> tuple[float, float, int, dict]:
    """Wall seconds, CPU seconds (user+sys: what the diagnosis costs whatever else
    shares the machine), peak RSS in KiB, and the JSON report."""
    # Through a small launcher that forks the diagnosis and reads its wait4 figures: Linux
    # starts a child's peak-RSS count at its parent's resident set, and this process has
    # just built the store with DuckDB (over 1 GiB), which RUSAGE_CHILDREN then reported
    # as the diagnosis's peak.
    source = ["--backend", backend, "--job", JOB] if backend else ["--store", path]
    elapsed, cpu, peak_kb, stdout = run_measured(
        [sys.executable, "-m", "flare.diagnostics.cli", "diagnose", *source, "--format", "json"])
    return elapsed, cpu, peak_kb, json.loads(stdout)



def per_detector(path: str) -> list[tuple[str, float]]:
    """Seconds each detector adds (the shared step summary is charged to the first)."""
    from flare.diagnostics import registry
    from flare.diagnostics.backends.store import StoreBackend
    from flare.diagnostics.model import DiagnosisConfig
    from flare.diagnostics.pipeline import CachedJobData

    job = CachedJobData(StoreBackend(path).job_data(JOB))
    out = []
    for name, detect in registry.discover().items():
        started = time.perf_counter()
        detect(job, DiagnosisConfig())
        out.append((name, time.perf_counter() - started))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3600)
    parser.add_argument("--keep", metavar="PATH", help="build (or reuse) the store at PATH")
    parser.add_argument("--chdb", action="store_true",
                        help="also copy the store into a chDB directory (the ClickHouse "
                             "exporter's otel_traces) and diagnose it there, side by side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or os.path.join(tmp, "bench.duckdb")
        if not os.path.exists(path):
            started = time.perf_counter()
            counts = build(path, args.ranks, args.steps)
            print(f"built {path}: {sum(counts.values()):,} spans "
                  f"({', '.join(f'{k} {v:,}' for k, v in sorted(counts.items()))}) "
                  f"in {time.perf_counter() - started:.1f} s, {os.path.getsize(path) / 2**20:.0f} MiB")
        load = os.getloadavg()[0]
        elapsed, cpu, peak_kb, report = measure(path)
        found = [(a["kind"], a["ranks"], a["cause"], a["first_step"]) for a in report["anomalies"]]
        print(f"flare diagnose: {elapsed:.1f} s wall, {cpu:.1f} s CPU, peak RSS {peak_kb / 1024:.0f} MiB "
              f"({args.ranks} ranks x {args.steps} steps; load average {load:.1f} on "
              f"{os.cpu_count()} CPUs when it started)")
        print(f"anomalies: {found}")
        print("per detector (in-process, same store): " + ", ".join(
            f"{name} {seconds:.1f} s" for name, seconds in per_detector(path)))
        if args.chdb:
            directory = os.path.join(tmp, "chdb")
            rows, seconds = load_chdb(path, directory)
            print(f"chDB: {rows:,} rows into otel_traces in {seconds:.0f} s")
            c_elapsed, c_cpu, c_peak_kb, c_report = measure(path, f"chdb:{directory}")
            c_found = [(a["kind"], a["ranks"], a["cause"], a["first_step"]) for a in c_report["anomalies"]]
            moved = pulled(f"chdb:{directory}")
            print(f"flare diagnose --backend chdb: {c_elapsed:.1f} s wall ({c_elapsed / elapsed:.2f}x the "
                  f"store's), {c_cpu:.1f} s CPU, peak RSS {c_peak_kb / 1024:.0f} MiB; same answer as the "
                  f"store: {'yes' if c_found == found else 'NO: ' + str(c_found)}")
            print(f"bytes pulled by the diagnosis: {moved['pulled'] / 2**20:.1f} MiB of the table's "
                  f"{moved['raw'] / 2**20:.0f} MiB uncompressed ({moved['pulled'] / moved['raw']:.2%}; "
                  f"{moved['disk'] / 2**20:.0f} MiB on disk, {moved['rows']:,} rows)")
            if c_found != found:
                return 1
        culprit = fault_rank(args.ranks)
        node = fault_node(args.ranks)
        members = list(range(8 * node, 8 * node + 8))
        ok = any(k == "straggler" and r == [culprit] and c == "compute" for k, r, c, _ in found)
        group = next((a for a in report["anomalies"] if a["kind"] == "straggler"
                      and a["ranks"] == members), None)
        ok_group = group is not None and group["cause"] == "compute" \
            and group["evidence"].get("group") == f"node {node}"
        print(f"diagnosis correct: {'yes' if ok else 'NO'} (expected a straggler on rank {culprit}, "
              f"cause compute); group {'yes' if ok_group else 'NO'} (expected ranks "
              f"{members[0]}-{members[-1]} as node {node}, cause compute"
              + (f"; got {group['evidence'].get('group')}, {group['cause']}, steps "
                 f"{group['first_step']}-{group['last_step']}" if group else "") + ")")
        return 0 if ok and ok_group else 1


if __name__ == "__main__":
    raise SystemExit(main())
