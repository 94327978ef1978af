"""`flare import-kineto` on hostile traces: wall time, peak RSS and outcome of each.

    python benchmarks/kineto_bomb.py [--string-size 1G] [--ws-size 64M] [--flood-size 256M]

Each case is a small `.json.gz` written to a temporary folder (streamed through gzip in
1 MiB blocks; 1 GiB of one character compresses to ~1 MB) and imported by its own
`flare import-kineto` process, measured with wait4 by a launcher (see child_measure.py:
measured straight from this process every child would inherit its size):

- string:   one event whose name is a `--string-size` string (default 1 GiB), then a good event
- ws:       `--ws-size` of whitespace between two events of traceEvents
- ws-event: `--ws-size` of whitespace inside one event (past the 16 MiB event cap)
- deep:     `[` nested 1,000,000 deep inside an event's args
- nan:      NaN and Infinity timestamps (events skipped, the file imports)
- rank:     distributedInfo.rank 2^40 (the file is skipped)
- flood:    `--flood-size` of minimal GPU kernel events, the costliest text per byte the
            importer accepts (it keeps every kernel): the time and memory per input byte
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time
from pathlib import Path

from child_measure import run_measured_status

from flare.importers.kineto import format_size, parse_size

_BLOCK = 1 << 20
_GOOD = b'{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 10, "dur": 1, "pid": 1, "tid": 1}'
_HEAD = b'{"schemaVersion": 1, "distributedInfo": {"rank": 0}, "traceEvents": ['

def _repeat(out, byte: bytes, size: int) -> None:
    block = byte * _BLOCK
    for _ in range(size // _BLOCK):
        out.write(block)
    out.write(byte * (size % _BLOCK))


def write_cases(folder: Path, string_size: int, ws_size: int, flood_size: int) -> dict[str, Path]:
    cases = {}

    def case(name: str) -> gzip.GzipFile:
        cases[name] = folder / name / "rank0.json.gz"
        cases[name].parent.mkdir()
        return gzip.GzipFile(cases[name], "wb", compresslevel=6)

    with case("string") as out:
        out.write(_HEAD + b'{"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 1, "name": "')
        _repeat(out, b"a", string_size)
        out.write(b'"}, ' + _GOOD + b"]}")
    with case("ws") as out:
        out.write(_HEAD + _GOOD + b",")
        _repeat(out, b" ", ws_size)
        out.write(_GOOD + b"]}")
    with case("ws-event") as out:
        out.write(_HEAD + b'{"ph": "X", "cat": "cpu_op", "name": "x", "ts":')
        _repeat(out, b" ", ws_size)
        out.write(b'1, "dur": 1}]}')
    with case("deep") as out:
        out.write(_HEAD + b'{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 1, "dur": 1, "args": {"a": ')
        _repeat(out, b"[", 1_000_000)
        _repeat(out, b"]", 1_000_000)
        out.write(b"}}, " + _GOOD + b"]}")
    with case("nan") as out:
        out.write(_HEAD + b'{"ph": "X", "cat": "cpu_op", "name": "a", "ts": NaN, "dur": 1}, '
                  b'{"ph": "X", "cat": "cpu_op", "name": "b", "ts": 1, "dur": Infinity}, ' + _GOOD + b"]}")
    with case("rank") as out:
        out.write(b'{"schemaVersion": 1, "distributedInfo": {"rank": 1099511627776}, '
                  b'"traceEvents": [' + _GOOD + b"]}")
    with case("flood") as out:
        out.write(_HEAD)
        event = b'{"ph":"X","cat":"kernel","ts":1,"dur":1},'
        _repeat(out, event, flood_size // len(event))
        out.write(_GOOD + b"]}")
    return cases


def measure(path: Path, store: Path) -> tuple[float, int, int, str]:
    """(wall s, peak RSS KiB, exit status, last stderr line) of one import."""
    flare = str(Path(sys.executable).parent / "flare")
    cmd = [flare, "import-kineto", str(path.parent), "--store", str(store), "--job", path.parent.name]
    wall, _cpu, peak_kb, status, stdout, stderr = run_measured_status(cmd)
    said = [line for line in stderr.splitlines() if line.strip()] + stdout.strip().splitlines()
    return wall, peak_kb, status, " | ".join(said)[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--string-size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--ws-size", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--flood-size", type=parse_size, default=parse_size("256M"))
    parser.add_argument("--only", nargs="*", help="cases to run (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kineto-bomb-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        cases = write_cases(folder, args.string_size, args.ws_size, args.flood_size)
        print(f"wrote {len(cases)} cases in {time.perf_counter() - start:.1f} s "
              f"(string {format_size(args.string_size)}, whitespace {format_size(args.ws_size)}, "
              f"flood {format_size(args.flood_size)})")
        print(f"{'case':10s} {'gzip':>9s} {'wall s':>7s} {'peak RSS':>9s} {'exit':>4s}  output")
        for name, path in cases.items():
            if args.only and name not in args.only:
                continue
            wall, peak_kb, status, said = measure(path, folder / f"{name}.duckdb")
            print(f"{name:10s} {os.path.getsize(path) / 1e6:7.2f}MB {wall:7.2f} "
                  f"{peak_kb / 1024:7.0f}MB {status:4d}  {said}")


if __name__ == "__main__":
    main()
