"""A single training rank for the exit and fatal-signal tests (run under
`opentelemetry-instrument`): `STEPS` optimizer steps, then an ending chosen by
`ENDING`: `exit` (normal), `sigabrt` (the signal raised in Python, as `kill -ABRT` or
`signal.raise_signal` deliver it), `abort` (C `abort()` through `os.abort`) or `segv`
(a null-pointer read through ctypes). The crash happens inside step STEPS."""

import ctypes
import gc
import os
import signal
import sys
import time

import torch


def crash_in_step(ending: str) -> None:
    if ending == "sigabrt":
        signal.raise_signal(signal.SIGABRT)
    elif ending == "abort":
        os.abort()
    elif ending == "segv":
        ctypes.string_at(0)


def main() -> None:
    steps, ending = int(sys.argv[1]), sys.argv[2]
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    print(f"LAST_STEP_DONE {time.time():.3f}", flush=True)
    if ending != "exit":
        model(torch.randn(4, 8)).sum().backward()  # opens step `steps`
        crash_in_step(ending)


if __name__ == "__main__":
    main()
    # as examples/train_ddp.py does: no last collection over torch's objects at exit,
    # which on a busy host took seconds of the linger these tests measure
    gc.freeze()
