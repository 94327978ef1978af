"""Naming the cause of a rank's (or the job's) excess time from its step breakdown."""

from __future__ import annotations

from flare.diagnostics.causes import attribute


def _parts(dataloader: float, compute: float, pycall: float = 0.0, gc: float = 0.0) -> dict[str, float]:
    return {"dataloader": dataloader, "compute": compute, "pycall": pycall, "gc": gc}


def test_a_slow_loader_that_also_slows_compute_a_little_is_input():
    # a single process on a loaded host: the loader +40 ms, compute +6 ms per step
    past, now = _parts(1.0, 10.0), _parts(41.0, 16.0)
    why = attribute(now, past, 0.5, sum(now.values()), sum(past.values()))
    assert why.cause == "input" and why.share > 0.8


def test_two_python_side_components_growing_together_are_cpu():
    # a GIL-holding thread: compute +30 ms, the loader's wait +6 ms
    past, now = _parts(1.0, 10.0), _parts(7.0, 40.0)
    why = attribute(now, past, 0.5, sum(now.values()), sum(past.values()))
    assert why.cause == "cpu"


def test_a_loader_and_compute_growing_alike_is_cpu():
    past, now = _parts(1.0, 10.0), _parts(21.0, 30.0)
    why = attribute(now, past, 0.5, sum(now.values()), sum(past.values()))
    assert why.cause == "cpu"
