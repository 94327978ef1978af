"""Flare's C modules built with warnings as errors and AddressSanitizer + UBSan, and the
mutation fuzzer run over them.

`build(directory)` compiles the three modules (`_otlp_fast`, `_span_select`,
`_otlp_attributes`) with `-Wall -Wextra -Werror -fsanitize=address,undefined`
(unused parameters are allowed: CPython's method signatures have them). Run as a
script, under `LD_PRELOAD=<libasan>`, this file puts the sanitized builds in place of
the installed ones and feeds them the mutations (`otlp_mutations.check_in_process`:
every C reader sees every mutation, acknowledged or not) and random attribute maps for
the ranks' encoder; a sanitizer finding aborts the process with its report on stderr.

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
MODULES = {
    "flare.exporters._otlp_fast": REPO / "exporters/src/flare/exporters/_otlp_fast.c",
    "flare.processors._span_select": REPO / "processors/src/flare/processors/_span_select.c",
    "flare.instrumentation._otlp_attributes":
        REPO / "instrumentation/src/flare/instrumentation/_otlp_attributes.c",
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
    for name, source in MODULES.items():
        target = directory / (name.rsplit(".", 1)[1] + suffix)
        subprocess.run([cc, "-shared", "-fPIC", *CFLAGS, f"-I{include}", str(source), "-o",
                        str(target)], check=True, capture_output=True, text=True)
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
    """Put the sanitized builds where `from flare.x import _mod` finds them."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in MODULES:
        package, leaf = name.rsplit(".", 1)
        spec = importlib.util.spec_from_file_location(name, build_dir / (leaf + suffix))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        setattr(importlib.import_module(package), leaf, module)


def _encoder_rounds(seed: int, count: int) -> int:
    """Random attribute maps through the ranks' C encoder, read back by protobuf."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from flare.instrumentation import otlp_encoding

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
            wire = otlp_encoding._attributes(attrs, 0x4A)  # Span.attributes
        except (otlp_encoding.Unsupported, ValueError, TypeError, OverflowError):
            continue
        Span.FromString(wire)
        done += 1
    return done


def main() -> None:
    build_dir, seed, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    _load(build_dir)
    sys.path.insert(0, str(Path(__file__).parent))
    import otlp_mutations

    from flare.exporters import otlp_columns

    assert otlp_columns._otlp_fast is sys.modules["flare.exporters._otlp_fast"]
    with tempfile.TemporaryDirectory() as tmp:
        stats = otlp_mutations.check_in_process(seed, count, Path(tmp) / "wal")
    stats["encoded_attribute_maps"] = _encoder_rounds(seed, max(200, count // 10))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
