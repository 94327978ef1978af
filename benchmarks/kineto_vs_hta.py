"""Flare's `import-kineto` + `diagnose` against Holistic Trace Analysis on the same trace.

    .venv/bin/python benchmarks/kineto_vs_hta.py [--trace FILE] [--hta-python PY] [--sizes 1,2,4]
                                                 [--rounds 3] [--baseline TREE]

Side by side in one run, each side a fresh process measured with wait4 (wall time, CPU
seconds = user + system, and peak RSS of exactly that process); after one untimed
warm-up of each side, `--rounds` rounds alternate which side goes first (Flare, HTA;
then HTA, Flare; ...) and the medians are compared, so load from other processes on a
shared machine falls on both sides. Both sides run as installed: with Python's bytecode
cache (the warm-up writes Flare's, as `pip install` does for HTA's packages), even
where PYTHONDONTWRITEBYTECODE is set in the calling shell.
- Flare: `flare import-kineto FILE --store S` then `flare diagnose --store S --format json`
  (wall times added, peak RSS the larger of the two processes);
- HTA 0.5.0: `TraceAnalysis(trace_dir)` + `get_temporal_breakdown()` +
  `get_cuda_kernel_launch_stats()` — load and the two analyses whose figures Flare
  reproduces (GPU idle share, launch delay).
Then memory against trace size: the trace's events replicated 1x, 2x, 4x (shifted in
time, ids offset) and imported by each side.

`--baseline TREE` (a copy of another Flare tree, e.g. `git archive <commit> | tar -x -C
TREE`) runs that tree's Flare in the same rounds too (through PYTHONPATH, this venv),
for a before/after side by side with the same HTA runs.

HTA needs pandas, which Flare does not; pyarrow imports pandas whenever it is installed,
so HTA should live in its own environment (`--hta-python`, or FLARE_HTA_PYTHON). Without
one, the HTA side is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from child_measure import run_measured

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared/data/kineto/ws16_rank0.json.gz"
HTA_SCRIPT = r"""
import logging, sys
logging.disable(logging.CRITICAL)
import warnings; warnings.filterwarnings("ignore")
from hta.trace_analysis import TraceAnalysis
analysis = TraceAnalysis(trace_dir=sys.argv[1])
breakdown = analysis.get_temporal_breakdown(visualize=False)
launch = analysis.get_cuda_kernel_launch_stats(visualize=False)
rank = sorted(launch)[0]
print(float(breakdown["idle_time_pctg"].iloc[0]), float(launch[rank]["launch_delay"].median()))
"""


# The children run as installed programs do: with the bytecode cache.
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
_CPU: dict[tuple[str, ...], float] = {}  # CPU seconds of the last run of each command


def measured(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stdout) of one command, in a clean process; its CPU
    seconds are left in `_CPU[tuple(cmd)]`."""
    wall, cpu, rss_kb, stdout = run_measured(cmd, env=env or _ENV)
    _CPU[tuple(cmd)] = cpu
    return wall, rss_kb / 1024, stdout


def last_cpu(cmd: list[str]) -> float:
    return _CPU[tuple(cmd)]


def hta_python(requested: str | None) -> tuple[str | None, str]:
    candidates = [c for c in (requested, os.environ.get("FLARE_HTA_PYTHON"), "/tmp/hta-venv/bin/python",
                              sys.executable) if c]
    for python in candidates:
        if not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import hta, importlib.metadata as m; "
                                "print(m.version('holistictraceanalysis'))"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return python, probe.stdout.strip()
    return None, "holistictraceanalysis not installed (pip install holistictraceanalysis==0.5.0 " \
                 "in a separate venv and pass --hta-python)"


def tree_env(tree: Path) -> dict:
    """The environment that runs Flare from the source folders of `tree`."""
    sources = [str(p) for p in sorted(tree.glob("*/src")) if (p / "flare").is_dir()]
    if not sources:
        raise SystemExit(f"{tree}: no Flare source folders (*/src/flare)")
    return _ENV | {"PYTHONPATH": os.pathsep.join(sources)}


def flare_run(trace: Path, work: Path, diagnose: bool = True, env: dict | None = None,
              tag: str = "") -> dict:
    store = work / f"{trace.stem}{tag}.duckdb"
    store.unlink(missing_ok=True)
    cli = [sys.executable, "-m", "flare.diagnostics.cli"]
    command = [*cli, "import-kineto", str(trace), "--store", str(store), "--job", "bench"]
    wall_i, rss_i, _ = measured(command, env)
    result = {"import_s": wall_i, "import_rss_mb": rss_i, "import_cpu_s": last_cpu(command),
              "store": store}
    if diagnose:
        report = work / f"report{tag}.json"
        command = [*cli, "diagnose", "--store", str(store), "--job", "bench", "--format", "json",
                   "-o", str(report)]
        wall_d, rss_d, _ = measured(command, env)
        anomalies = json.loads(report.read_text())["anomalies"]
        result.update(diagnose_s=wall_d, diagnose_rss_mb=rss_d, diagnose_cpu_s=last_cpu(command),
                      kinds=sorted({a["kind"] for a in anomalies}), anomalies=anomalies)
        result.update(wall_s=wall_i + wall_d, cpu_s=result["import_cpu_s"] + last_cpu(command),
                      rss_mb=max(rss_i, rss_d))
    return result


def hta_run(python: str, trace: Path, work: Path, analyse: bool = True) -> dict:
    trace_dir = work / f"hta-{trace.stem}"
    trace_dir.mkdir(exist_ok=True)
    link = trace_dir / trace.name
    if not link.exists():
        link.symlink_to(trace.resolve())
    script = HTA_SCRIPT if analyse else HTA_SCRIPT.split("breakdown =")[0] + "print(0, 0)"
    command = [python, "-c", script, str(trace_dir)]
    wall, rss, out = measured(command)
    idle, launch_median = (float(x) for x in out.split())
    return {"wall_s": wall, "rss_mb": rss, "cpu_s": last_cpu(command), "idle_pct": idle,
            "launch_delay_median_us": launch_median}


def flare_figures(store: Path) -> tuple[float, float]:
    """Flare's idle share (HTA's definition) and median launch delay from the store."""
    import numpy as np

    from flare.diagnostics import gpu_metrics as gm
    from flare.diagnostics.backends.store import StoreBackend
    from flare.wire import semconv as sc

    job = StoreBackend(store).job_data("bench")
    kernels = gm.gpu_activities(job)
    steps = job.spans([sc.SPAN_STEP], columns=["start_ns"])
    last = max(steps.column("start_ns").to_pylist()) if steps.num_rows >= 2 else None
    launches = kernels.column(sc.KERNEL_LAUNCH_NS).to_numpy(zero_copy_only=False).astype(float)
    share, _, _ = gm.trace_idle_share(kernels.column("start_ns").to_numpy(),
                                      kernels.column("end_ns").to_numpy(), launches, last)
    latency = kernels.column(sc.KERNEL_ISSUE_LATENCY_US).to_numpy(zero_copy_only=False).astype(float)
    durs = kernels.column(sc.KERNEL_LAUNCH_DUR_US).to_numpy(zero_copy_only=False).astype(float)
    delay = np.clip(latency - durs, 0, None)
    return 100 * share, float(np.nanmedian(delay))


def replicate(trace: Path, factor: int, out: Path) -> Path:
    """The trace's events `factor` times, each copy shifted past the previous one.

    Factor 0: only the first kernel, its launch and two ProfilerSteps around them.
    """
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"]
    if factor == 0:
        kernel = next(e for e in events if e.get("cat") == "kernel")
        launch = next(e for e in events if e.get("cat") == "cuda_runtime"
                      and e["args"].get("correlation") == kernel["args"]["correlation"])
        steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")][:2]
        events, factor = [launch, kernel, *steps], 1
    stamps = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(stamps) - min(stamps) + 1000
    copies = []
    for k in range(factor):
        for event in events:
            e = dict(event)
            if k and isinstance(e.get("ts"), (int, float)):
                e["ts"] = e["ts"] + k * span
                args = e.get("args")
                if isinstance(args, dict):
                    args = dict(args)
                    for key in ("correlation", "External id"):
                        if isinstance(args.get(key), int):
                            args[key] += k * 100_000_000
                    e["args"] = args
                if isinstance(e.get("id"), int):
                    e["id"] += k * 100_000_000
                if e.get("name", "").startswith("ProfilerStep#"):
                    e["name"] = f"ProfilerStep#{int(e['name'].split('#')[1]) + k * 1000}"
            copies.append(e)
    data["traceEvents"] = copies
    path = out / f"x{factor}_{trace.name}"
    with gzip.open(path, "wt") as f:
        json.dump(data, f)
    return path


def rank_directory(trace: Path, ranks: int, out: Path) -> Path:
    """`ranks` copies of the trace as the files of ranks 0..ranks-1 of one job."""
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    folder = out / f"ranks{ranks}"
    folder.mkdir(exist_ok=True)
    for rank in range(ranks):
        data.setdefault("distributedInfo", {})["rank"] = rank
        with gzip.open(folder / f"rank{rank}.json.gz", "wt") as f:
            json.dump(data, f)
    return folder



def _rounds(left: list[dict], right: list[dict]) -> str:
    """Each round's wall/CPU/RSS of two sides, side by side."""
    def one(r: dict) -> str:
        return f"{r['wall_s']:.2f}/{r['cpu_s']:.2f}/{r['rss_mb']:.0f}"

    return "; ".join(f"{one(a)} | {one(b)}" for a, b in zip(left, right, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--hta-python", help="a Python with holistictraceanalysis installed")
    parser.add_argument("--sizes", default="1,2,4", help="replication factors for the memory curve")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the comparison")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="another Flare tree to run in the same rounds (before/after)")
    args = parser.parse_args()
    base_env = tree_env(args.baseline) if args.baseline else None
    if not args.trace.exists():
        print(f"skipped: {args.trace} not found (the shared Kineto traces are absent)")
        return 0
    python, hta_version = hta_python(args.hta_python)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Warm-up, untimed: bytecode caches written, both sides' files in the page cache.
        flare_run(args.trace, work)
        if base_env:
            flare_run(args.trace, work, env=base_env, tag="-baseline")
        if python:
            hta_run(python, args.trace, work)
        flares: list[dict] = []
        bases: list[dict] = []
        htas: list[dict] = []
        for round_no in range(max(1, args.rounds)):
            # Which side goes first rotates: this tree, the baseline, HTA.
            sides = ["flare", "baseline", "hta"]
            sides = sides[round_no % 3:] + sides[:round_no % 3]
            for side in sides:
                if side == "flare":
                    flares.append(flare_run(args.trace, work))
                elif side == "baseline" and base_env:
                    bases.append(flare_run(args.trace, work, env=base_env, tag="-baseline"))
                elif side == "hta" and python:
                    htas.append(hta_run(python, args.trace, work))
        flare = flares[-1]
        idle, delay = flare_figures(flare["store"])

        def med(rows: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in rows)

        print(f"trace: {args.trace.name} ({args.trace.stat().st_size / 1e6:.1f} MB gzip); "
              f"median of {len(flares)} alternating rounds after a warm-up "
              f"(load average {os.getloadavg()[0]:.1f})")
        print(f"{'':34}{'wall s':>9}{'CPU s':>8}{'peak RSS MB':>13}")
        print(f"{'flare import-kineto':34}{med(flares, 'import_s'):9.2f}"
              f"{med(flares, 'import_cpu_s'):8.2f}{med(flares, 'import_rss_mb'):13.0f}")
        print(f"{'flare diagnose':34}{med(flares, 'diagnose_s'):9.2f}"
              f"{med(flares, 'diagnose_cpu_s'):8.2f}{med(flares, 'diagnose_rss_mb'):13.0f}")
        flare_wall, flare_cpu, flare_rss = (med(flares, k) for k in ("wall_s", "cpu_s", "rss_mb"))
        print(f"{'flare import + diagnose':34}{flare_wall:9.2f}{flare_cpu:8.2f}{flare_rss:13.0f}")
        print(f"flare anomalies: {', '.join(flare['kinds'])}")
        if bases:
            print(f"{'baseline import-kineto':34}{med(bases, 'import_s'):9.2f}"
                  f"{med(bases, 'import_cpu_s'):8.2f}{med(bases, 'import_rss_mb'):13.0f}")
            print(f"{'baseline diagnose':34}{med(bases, 'diagnose_s'):9.2f}"
                  f"{med(bases, 'diagnose_cpu_s'):8.2f}{med(bases, 'diagnose_rss_mb'):13.0f}")
            print(f"{'baseline import + diagnose':34}{med(bases, 'wall_s'):9.2f}"
                  f"{med(bases, 'cpu_s'):8.2f}{med(bases, 'rss_mb'):13.0f}")
            same = all(b["anomalies"] == flare["anomalies"] for b in bases)
            print(f"baseline anomalies: {', '.join(bases[-1]['kinds'])} "
                  f"(JSON anomalies {'identical' if same else 'DIFFERENT'} to this tree's)")
            print("rounds (this tree | baseline, wall/CPU/RSS): " + _rounds(flares, bases))
        print(f"flare figures: GPU idle {idle:.2f}% (HTA definition), "
              f"median launch delay {delay:.1f} µs")
        if python is None:
            print(f"HTA side skipped: {hta_version}")
        else:
            hta = htas[-1]
            hta_wall, hta_cpu, hta_rss = (med(htas, k) for k in ("wall_s", "cpu_s", "rss_mb"))
            print(f"{'HTA ' + hta_version + ' load + analyse':34}{hta_wall:9.2f}{hta_cpu:8.2f}"
                  f"{hta_rss:13.0f}")
            print(f"HTA figures:   GPU idle {hta['idle_pct']:.2f}%, median launch delay "
                  f"{hta['launch_delay_median_us']:.1f} µs")
            print(f"ratio flare/HTA: wall {flare_wall / hta_wall:.2f}, CPU {flare_cpu / hta_cpu:.2f}, "
                  f"peak RSS {flare_rss / hta_rss:.2f}  (target <= 0.50 wall and RSS)")
            if bases:
                print(f"ratio baseline/HTA: wall {med(bases, 'wall_s') / hta_wall:.2f}, "
                      f"peak RSS {med(bases, 'rss_mb') / hta_rss:.2f}")
            print("rounds (flare wall/CPU/RSS | HTA wall/CPU/RSS): " + _rounds(flares, htas))
        print("\nmemory against trace size (events replicated; factor 0 = a one-kernel trace,")
        print("the fixed cost of interpreter, DuckDB, numpy / pandas):")
        print(f"{'factor':>6}{'events MB (json)':>18}{'flare import MB':>17}"
              + (f"{'baseline MB':>13}" if base_env else "") + f"{'HTA MB':>9}")
        for factor in [0, *(int(x) for x in args.sizes.split(","))]:
            trace = args.trace if factor == 1 else replicate(args.trace, factor, work)
            if factor == 0:
                trace = trace.rename(trace.with_name("tiny_rank0.json.gz"))
            with gzip.open(trace, "rb") as f:
                raw_mb = sum(len(chunk) for chunk in iter(lambda: f.read(1 << 20), b"")) / 1e6
            imported = flare_run(trace, work, diagnose=False)
            base_mb = f"{flare_run(trace, work, diagnose=False, env=base_env, tag='-baseline')['import_rss_mb']:13.0f}" \
                if base_env else ""
            # A one-kernel trace is too small for HTA's analyses: its fixed cost is the load.
            hta_mb = hta_run(python, trace, work, analyse=factor > 0)["rss_mb"] if python \
                else float("nan")
            print(f"{factor:>6}{raw_mb:18.1f}{imported['import_rss_mb']:17.0f}{base_mb}{hta_mb:9.0f}")
        # Flare imports one rank file at a time: a job's peak is its largest file's,
        # where HTA holds every rank's frame at once.
        print("\na job of 4 rank files, each this trace:")
        folder = rank_directory(args.trace, 4, work)
        wall, rss, _ = measured([sys.executable, "-m", "flare.diagnostics.cli", "import-kineto",
                                 str(folder), "--store", str(work / "ranks.duckdb"), "--job", "r"])
        print(f"{'flare import-kineto':34}{wall:9.2f}{rss:13.0f}")
        if python:
            hta_wall, hta_rss, _ = measured([python, "-c", HTA_SCRIPT, str(folder)])
            print(f"{'HTA load + analyse':34}{hta_wall:9.2f}{hta_rss:13.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
