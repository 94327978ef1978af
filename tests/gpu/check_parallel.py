"""Checks an FSDP2 or FSDP2 + tensor-parallel job on NCCL (tests/gpu/run_gpu_checks.sh).

    python tests/gpu/check_parallel.py --store S --job J --diagnosis D --slow-rank 3 --slow-from 50

One PASS/FAIL/N/A line per check; exit 1 on a FAIL. What it asks of the store: every
rank's steps name their process groups (two with tensor parallel), with the time
blocked in them and device time from CUDA events; no collective that Flare could not
time (FSDP2's all-gathers and reduce-scatters and DTensor's functional all-reduces are
all seen from Python); and of the diagnosis, the slow rank named, cause compute, onset
within 3 steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flare.diagnostics.backends.store import StoreBackend
from flare.wire import semconv as sc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--diagnosis", required=True)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-from", type=int, default=50)
    parser.add_argument("--groups", type=int, default=1, help="process groups every step names")
    args = parser.parse_args()
    failed = False

    def check(name: str, ok: bool | None, **figures) -> None:
        nonlocal failed
        status = "N/A" if ok is None else ("PASS" if ok else "FAIL")
        failed = failed or ok is False
        print(f"{status:4} {args.job}: {name} {json.dumps(figures, default=str)}")

    job = StoreBackend(args.store).job_data(args.job)
    steps = job.spans([sc.SPAN_STEP], attributes=[
        sc.STEP_PG_NAMES, sc.STEP_PG_WAIT_MS, sc.STEP_PG_DEVICE_MS, sc.STEP_COLLECTIVE_UNTIMED,
        sc.STEP_PG_ROLES], columns=["rank", "step"])
    rows = steps.to_pylist()
    ranks = sorted({r["rank"] for r in rows})
    check("steps from every rank", len(rows) > 0, ranks=ranks, steps=len(rows))
    named = [r for r in rows if isinstance(r[sc.STEP_PG_NAMES], list)]
    check(f"every step names its {args.groups} process group(s)",
          bool(rows) and all(len(r[sc.STEP_PG_NAMES] or []) >= args.groups for r in rows[len(ranks) * 3:]),
          groups=sorted({tuple(r[sc.STEP_PG_NAMES]) for r in named})[:4],
          roles=sorted({tuple(r[sc.STEP_PG_ROLES] or ()) for r in named})[:4])
    waits = [sum(r[sc.STEP_PG_WAIT_MS] or []) for r in named]
    check("time blocked in the groups measured", any(w > 0 for w in waits),
          mean_wait_ms=round(sum(waits) / max(len(waits), 1), 3))
    device = [r for r in rows if r[sc.STEP_PG_DEVICE_MS]]
    check("collectives timed on the device (CUDA events)", len(device) > 0,
          steps_with_device_ms=len(device))
    untimed = [r for r in rows if r[sc.STEP_COLLECTIVE_UNTIMED]]
    check("no collective Flare could not time", not untimed, steps_with_untimed=len(untimed))
    report = json.loads(Path(args.diagnosis).read_text())
    labels = [(a["kind"], a["ranks"], a["cause"], a["first_step"]) for a in report["anomalies"]]
    if args.slow_rank < 0:
        check("healthy: no straggler or fail-slow",
              not any(k in ("straggler", "fail_slow") for k, *_ in labels), labels=labels)
    else:
        stragglers = [a for a in report["anomalies"] if a["kind"] == "straggler"]
        check(f"straggler rank {args.slow_rank}, compute, onset within 3 steps of {args.slow_from}",
              any(a["ranks"] == [args.slow_rank] and a["cause"] == "compute"
                  and abs(a["first_step"] - args.slow_from) <= 3 for a in stragglers), labels=labels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
