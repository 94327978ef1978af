"""The long hostile-input run: an OK must mean stored.

Three parts, each seeded (a failure names its seed and case):
1. in-process: mutations through the real receiver path (check → WAL → queue) and the
   store's decoder; every acknowledged span must be stored as the reference reads it;
2. collectors: mutations over OTLP/HTTP and gRPC into a real collector process,
   `kill -9`-ed and restarted on the way; every acknowledged span id must be in the store;
3. sanitizers: part 1 again over the C modules built with -Werror, ASan and UBSan.

    python benchmarks/fuzz_otlp.py [--mutations 20000] [--kills 5] [--sanitized 5000] [--seed 1]

Prints one line per part and a summary; exits 1 on any lost span or sanitizer finding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fuzz"))
sys.path.insert(0, str(REPO / "tests" / "collector"))

import otlp_mutations  # noqa: E402
import sanitized  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=20_000, help="per part 1 and 2")
    parser.add_argument("--kills", type=int, default=5, help="kill -9 restarts in part 2")
    parser.add_argument("--sanitized", type=int, default=5_000, help="mutations in part 3 (0: skip)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    failed = False

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        chunks = max(1, args.mutations // 2000)
        total: dict[str, int] = {}
        for chunk in range(chunks):  # a fresh log per chunk bounds its size
            stats = otlp_mutations.check_in_process(args.seed * 1000 + chunk, args.mutations // chunks,
                                                    Path(tmp) / f"wal-{chunk}")
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        print(f"in-process: {json.dumps(total)} in {time.monotonic() - t0:.0f} s", flush=True)
        failed |= total["lost_spans"] > 0

        from conftest import CollectorProcess, base_config  # tests/collector

        workdir = Path(tmp) / "collector"
        workdir.mkdir()
        config = base_config(workdir / "store.duckdb")
        runs = iter(range(10**6))

        def start():
            return CollectorProcess(config, workdir, name=f"collector-{next(runs)}").start()

        t0 = time.monotonic()
        stats = otlp_mutations.check_collector(start, args.seed, args.mutations, args.kills)
        print(f"collectors: {json.dumps(stats)} in {time.monotonic() - t0:.0f} s", flush=True)
        failed |= stats["lost_spans"] > 0

        if args.sanitized:
            t0 = time.monotonic()
            build = Path(tmp) / "sanitized"
            build.mkdir()
            sanitized.build(build)
            result = sanitized.run(build, args.seed, args.sanitized, timeout_s=3600)
            finding = result.returncode != 0 or "runtime error" in result.stderr
            line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "{}"
            print(f"sanitizers (ASan+UBSan, -Werror): {'FINDING' if finding else 'clean'}; "
                  f"{line} in {time.monotonic() - t0:.0f} s", flush=True)
            if finding:
                print(result.stderr[-6000:], file=sys.stderr)
            failed |= finding
    print("FAILED" if failed else "ok: no acknowledged span lost, no sanitizer finding")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
