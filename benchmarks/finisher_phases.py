"""Where the `flare-step-finisher` thread's CPU goes, per rank-step, in the real job.

Wraps the finisher's phases with the thread CPU clock, counting only what runs on the
finisher thread, from the 100th optimizer step to exit: building the deferred step
spans (`StepFinisher.drain` calling `Runtime._emit_deferred`; of it the summary
attributes, `step_spans.build_summary`, and the hand-over to the span processors,
`FinishedSpans.emit`), the flight-recorder dump after detail steps
(`FlightRecorder.entries`), the batch processors' flush
(`FinishedSpans.flush_batches`; of it the request encoding, `otlp_encoding.encode_request`,
and the exporter's `export`), and the thread's whole CPU (`/proc/self/task/<tid>/schedstat`).
The timers add a little to what they time. The usual way runs the 4-rank job under
exactly `flare run`'s rank environment (like benchmarks/rank_thread_cpu.py) and prints
the four ranks' mean:

    .venv/bin/python benchmarks/finisher_phases.py --drive --steps 400 \\
        --hidden 1024 --batch-size 128

(arguments after `--drive` go to examples/train_ddp.py).
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from rank_thread_cpu import run_ranks, run_wrapped  # (this script's folder is on the path)

FINISHER = "flare-step-finisher"
PHASES = ("drain", "emit_deferred", "build_summary", "emit", "flight_recorder_dump",
          "flush_batches", "export", "encode_request")


def _timed(owner, name: str, key: str, totals: dict) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.thread_time_ns()
        try:
            return original(*args, **kwargs)
        finally:
            if threading.current_thread().name == FINISHER:
                totals[key] += time.thread_time_ns() - started

    setattr(owner, name, wrapper)


def _finisher_ns() -> int | None:
    for thread in threading.enumerate():
        if thread.name == FINISHER:
            try:
                with open(f"/proc/self/task/{thread.native_id}/schedstat") as handle:
                    return int(handle.read().split()[0])
            except OSError:
                return None
    return None


def main() -> None:
    from flare.instrumentation import (
        finished_span,
        flight_recorder,
        otlp_encoding,
        otlp_http,
        step_finisher,
        step_spans,
    )
    from flare.instrumentation import runtime as runtime_module

    totals: dict[str, int] = collections.defaultdict(int)
    for owner, name, key in (
            (step_finisher.StepFinisher, "drain", "drain"),
            (runtime_module.Runtime, "_emit_deferred", "emit_deferred"),
            (step_spans, "build_summary", "build_summary"),
            (finished_span.FinishedSpans, "emit", "emit"),
            (flight_recorder.FlightRecorder, "entries", "flight_recorder_dump"),
            (finished_span.FinishedSpans, "flush_batches", "flush_batches"),
            (otlp_http.FlareOTLPHttpSpanExporter, "export", "export"),
            (otlp_encoding, "encode_request", "encode_request")):
        _timed(owner, name, key, totals)
    finisher0: list[int | None] = [None]

    def start() -> None:
        totals.clear()
        finisher0[0] = _finisher_ns()

    def finish(steps: int) -> dict:
        out = {key: round(totals.get(key, 0) / 1e3 / steps, 1) for key in PHASES}
        now = _finisher_ns()
        if now is not None and finisher0[0] is not None:
            out["finisher_thread"] = round((now - finisher0[0]) / 1e3 / steps, 1)
        return out

    run_wrapped("phases", start, finish)


def drive(train_args: list[str]) -> None:
    ranks = run_ranks(__file__, "finisher-phases", "phases", train_args)
    if not ranks:
        raise SystemExit("finisher_phases: no rank wrote its figures (fewer than 100 steps?)")
    for key in (*PHASES, "finisher_thread"):
        values = [r[key] for r in ranks if key in r]
        if values:
            print(f"{key:24s} {sum(values) / len(values):8.1f} us/rank-step")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2:])
    else:
        main()
