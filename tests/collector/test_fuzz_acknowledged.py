"""Acknowledged ⇒ stored across `kill -9`: mutations over OTLP/HTTP and gRPC into a real
collector process that is killed and restarted on the way (the long run is
`benchmarks/fuzz_otlp.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "fuzz"))
import otlp_mutations  # a sibling module, shared with benchmarks/fuzz_otlp.py

pytestmark = pytest.mark.e2e


def test_no_acknowledged_span_is_lost_across_kills(collector_process, tmp_path):
    config = None

    def start():
        nonlocal config
        proc = collector_process(config)
        config = proc.config
        return proc.start()

    stats = otlp_mutations.check_collector(start, seed=11, count=600, kills=2)
    assert stats["kills"] == 2 and stats["mutations"] == 600
    assert stats["acknowledged_requests"] > 200 and stats["refused_requests"] > 100
    assert stats["acknowledged_spans"] > 600
    assert stats["lost_spans"] == 0, stats
    assert stats["dead_letter_files"] == 0
