"""Flare's C module built with warnings as errors and AddressSanitizer + UBSan, and the
mutation fuzzer run over it.

`build(directory)` compiles Flare's two OTLP wire modules — the collector's readers
(`flare.processors._otlp_read`: the store's decoder, the correlator's picker and link
writer, the receivers' checks) and the ranks' attribute writer (`flare.wire._otlp_write`) — with `-Wall -Wextra -Werror -fsanitize=address,undefined`
(unused parameters are allowed: CPython's method signatures have them). Run as a
script, under `LD_PRELOAD=<libasan>`, this file puts the sanitized build in place of
the installed one and feeds it the mutations (`otlp_mutations.check_in_process`:
every C reader sees every mutation, acknowledged or not), random attribute maps for
the attribute writer and random windows for the link writer; a sanitizer finding
aborts the process with its report on stderr.

    python tests/fuzz/sanitized.py BUILD_DIR SEED COUNT      # prints a JSON line of counts

tests/fuzz/test_sanitizers.py runs it briefly in CI; benchmarks/fuzz_otlp.py --sanitize
runs it long.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READ = REPO / "processors/csrc/otlp_read"
MODULES = {  # module -> (sources, include directories); loaded in this order, the writer
    # first: importing flare.processors imports the writer's users
    "flare.wire._otlp_write": ([REPO / "wire/src/flare/wire/_otlp_write.c"], []),
    "flare.processors._otlp_read": (sorted(READ.glob("*.c")), [READ]),
}
CFLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
          "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]
ENV = {
    # The interpreter itself is not built with ASan: its own allocations at exit are
    # not ours to report, so leak detection is off; every other finding aborts.
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    # PyMem_Malloc through malloc, not pymalloc's arenas, so ASan sees every buffer.
    "PYTHONMALLOC": "malloc",
}


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and subprocess.run(["sh", "-c", f"command -v {name}"],
                                   capture_output=True).returncode == 0:
            return name
    return None


def asan_runtime(cc: str) -> str | None:
    path = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True,
                          text=True).stdout.strip()
    return path if path and os.path.isabs(path) and os.path.exists(path) else None


def build(directory: Path) -> dict[str, Path]:
    """Compile every module into `directory`; CalledProcessError (with the compiler's
    output) on a warning or error."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler")
    include = sysconfig.get_paths()["include"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    out = {}
    for name, (sources, includes) in MODULES.items():
        target = directory / (name.rsplit(".", 1)[1] + suffix)
        subprocess.run([cc, "-shared", "-fPIC", *CFLAGS, f"-I{include}", *(f"-I{d}" for d in includes),
                        *map(str, sources), "-o", str(target)], check=True, capture_output=True, text=True)
        out[name] = target
    return out


def run(build_dir: Path, seed: int, count: int, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """This script under the sanitizers' runtime, in a child process."""
    cc = compiler()
    runtime = asan_runtime(cc) if cc else None
    if runtime is None:
        raise FileNotFoundError("no AddressSanitizer runtime (libasan.so) for the compiler")
    env = {**os.environ, **ENV, "LD_PRELOAD": runtime}
    return subprocess.run([sys.executable, __file__, str(build_dir), str(seed), str(count)],
                          capture_output=True, text=True, env=env, timeout=timeout_s)


def _load(build_dir: Path) -> None:
    """Put the sanitized build where `from flare.x import _mod` finds it (before any
    of its users is imported: they bind it at import)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in MODULES:
        package, leaf = name.rsplit(".", 1)
        spec = importlib.util.spec_from_file_location(name, build_dir / (leaf + suffix))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        setattr(importlib.import_module(package), leaf, module)


def _encoder_rounds(seed: int, count: int) -> int:
    """Random attribute maps through the C attribute writer, read back by protobuf."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from flare.wire import otlp_values

    rng = random.Random(seed)
    values = [lambda: rng.random(), lambda: rng.getrandbits(64) - (1 << 63),
              lambda: rng.choice([True, False]), lambda: "s" * rng.randint(0, 300),
              lambda: [rng.random() for _ in range(rng.randint(0, 5))],
              lambda: tuple("ab"[: rng.randint(0, 2)]), lambda: rng.randbytes(rng.randint(0, 9)),
              lambda: float("nan"), lambda: rng.choice([1 << 64, "\udcff", "é"])]
    done = 0
    for _ in range(count):
        attrs = {f"k{i}" * rng.randint(1, 40): rng.choice(values)() for i in range(rng.randint(0, 12))}
        try:
            wire = otlp_values.write_attributes(attrs, 0x4A)  # Span.attributes
        except (otlp_values.Unsupported, ValueError, TypeError, OverflowError):
            continue
        Span.FromString(wire)
        done += 1
    return done


def _link_rounds(seed: int, count: int) -> int:
    """Random per-rank windows through the C link writer, read back by protobuf."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from flare.processors import correlation_output
    from flare.processors.correlation_windows import RankArrival

    rng = random.Random(seed)
    for _ in range(count):
        ranks = {rng.randrange(-5, 1 << rng.randint(1, 62)): RankArrival(
            rng.randbytes(rng.choice([0, 8, 3])), rng.randbytes(rng.choice([0, 16, 40])), 0, 0)
            for _ in range(rng.randint(0, 300))}
        span = Span()
        correlation_output._add_rank_links(span, ranks)
        Span.FromString(span.SerializeToString())
    return count


def main() -> None:
    build_dir, seed, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    _load(build_dir)
    sys.path.insert(0, str(Path(__file__).parent))
    import otlp_mutations

    from flare.collector import validate
    from flare.exporters import otlp_columns
    from flare.processors import correlation_output, span_select
    from flare.wire import otlp_values

    sanitized = sys.modules["flare.processors._otlp_read"]
    assert otlp_columns._otlp_read is span_select._otlp_read is sanitized
    assert correlation_output._otlp_read is sanitized
    assert otlp_values._otlp_write is sys.modules["flare.wire._otlp_write"]
    assert validate._check_traces_strict is sanitized.check_traces_strict
    with tempfile.TemporaryDirectory() as tmp:
        stats = otlp_mutations.check_in_process(seed, count, Path(tmp) / "wal")
    stats["encoded_attribute_maps"] = _encoder_rounds(seed, max(200, count // 10))
    stats["rank_link_sets"] = _link_rounds(seed, max(100, count // 20))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
