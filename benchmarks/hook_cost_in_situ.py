"""In-situ cost of Flare's two per-step training-thread hooks (torchrun wrapper).

Run under `opentelemetry-instrument torchrun` like benchmarks/rank_thread_cpu.py (same
environment); it times, with `perf_counter_ns`, the optimizer post-hook that closes
each step (Flare's step boundary) and Flare's backward wrapper minus the backward
itself, inside the real job (cold caches, four ranks on the cores), and writes the
medians in µs to `hooks<RANK>.json` in OUT_DIR:

    ... torchrun --nproc_per_node 4 benchmarks/hook_cost_in_situ.py OUT_DIR \\
        examples/train_ddp.py --steps 400
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import statistics
import sys
import time


def main() -> None:
    from torch.optim import optimizer as torch_optimizer

    from flare.instrumentation import step_hooks

    out_dir, script = sys.argv[1], sys.argv[2]
    clock = time.perf_counter_ns
    samples: dict[str, list[int]] = {"backward wrapper": [], "step boundary": []}
    wrapped = step_hooks.StepHooks._timed_backward

    def timed_backward(self, original, tensors, args, kwargs):
        inner = [0]

        def timed_original(*a, **k):
            start = clock()
            try:
                return original(*a, **k)
            finally:
                inner[0] = clock() - start

        start = clock()
        try:
            return wrapped(self, timed_original, tensors, args, kwargs)
        finally:
            samples["backward wrapper"].append(clock() - start - inner[0])

    step_hooks.StepHooks._timed_backward = timed_backward
    hooks = torch_optimizer._global_optimizer_post_hooks  # Flare's, registered at startup
    for key, hook in list(hooks.items()):
        def timed_hook(*a, _hook=hook, **k):
            start = clock()
            try:
                return _hook(*a, **k)
            finally:
                samples["step boundary"].append(clock() - start)
        hooks[key] = timed_hook

    def dump():
        medians = {name: round(statistics.median(values) / 1e3, 1)
                   for name, values in samples.items() if values}
        with open(os.path.join(out_dir, f"hooks{os.environ.get('RANK', '0')}.json"),
                  "w") as handle:
            json.dump(medians, handle)

    atexit.register(dump)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
