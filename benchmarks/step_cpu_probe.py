"""Run a training script and record, per optimizer step, the wall time and the CPU time
of the training thread and of the whole process (used by instrumentation_overhead.py).

    python step_cpu_probe.py OUT_DIR script.py [script args...]

Both arms of the overhead benchmark run through this wrapper, so its own optimizer
post-hook (three clock reads a step) is in both. Each rank writes OUT_DIR/rank<R>.json
with the per-step medians (ms) from step 20 on; detail steps are not told apart, so
medians (not means) keep them out.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import statistics
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

_samples: list[tuple[float, float, float]] = []


def _on_step(optimizer, args, kwargs) -> None:
    _samples.append((time.perf_counter(), time.thread_time(), time.process_time()))


def _write() -> None:
    deltas = [tuple(b - a for a, b in zip(_samples[i - 1], _samples[i], strict=True))
              for i in range(20, len(_samples))]
    if not deltas:
        return
    out = {name: statistics.median(d[i] for d in deltas) * 1e3
           for i, name in enumerate(("wall_ms", "thread_cpu_ms", "process_cpu_ms"))}
    out["steps"] = len(deltas)
    path = os.path.join(_OUT, f"rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as handle:
        json.dump(out, handle)


if __name__ == "__main__":
    _OUT = sys.argv[1]
    register_optimizer_step_post_hook(_on_step)
    atexit.register(_write)
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
