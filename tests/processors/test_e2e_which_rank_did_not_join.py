"""A real 4-rank torchrun job where one rank hangs: the correlator names it, live.

Rank 2 blocks before backward; ranks 0, 1 and 3 then sit inside the step's gradient
all-reduce and their watchdogs report the hang with the collective's (pg, seq). The
`collective.ranks` span the correlator derives from those reports must name rank 2 as
the member that never joined, while the job is still hung (no NCCL/gloo timeout, no
post-mortem dump).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flare.exporters import store
from flare.wire import semconv as sc

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HUNG_RANK = 2


def _hang_verdicts(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        con = store.open_reader(path, timeout_s=2)
    except store.StoreError:
        return []  # the collector is mid-flush; ask again
    try:
        rows = con.execute("SELECT attributes FROM spans WHERE name = ?",
                           [sc.SPAN_COLLECTIVE_RANKS]).fetchall()
    finally:
        con.close()
    verdicts = [json.loads(attributes) for (attributes,) in rows]
    return [v for v in verdicts if v.get(sc.COLL_SOURCE) == "hang"]


@pytest.mark.e2e
def test_the_rank_that_never_joined_is_named_while_the_job_hangs(tmp_path):
    store_path = tmp_path / "store.duckdb"
    command = [str(BIN / "flare"), "run", "--store", str(store_path), "--job", "join",
               "--no-diagnose", "--", str(BIN / "torchrun"), "--nproc_per_node", "4",
               str(REPO / "examples" / "train_ddp.py"), "--steps", "50", "--fault", "hang",
               "--fault-rank", str(HUNG_RANK), "--fault-from", "3"]
    env = {**os.environ, sc.ENV_HANG_TIMEOUT_S: "3"}
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=env)
    verdicts: list[dict] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and run.poll() is None and not verdicts:
            time.sleep(1.0)
            verdicts = _hang_verdicts(store_path)
        assert run.poll() is None, "the hung job ended by itself"
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
        try:
            _, stderr = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            _, stderr = run.communicate()
    assert verdicts, stderr[-3000:]
    (verdict,) = verdicts
    assert verdict[sc.RANKS_MISSING] == [HUNG_RANK]
    assert verdict[sc.RANKS_COUNT] == 3 and verdict[sc.RANKS_EXPECTED] == 4
    assert verdict[sc.COLL_OP] == "all_reduce" and verdict[sc.STEP] == 3
    # rank 2's own watchdog says it is stuck in its step: the answer did not wait out
    # the hang grace period
    assert verdict[sc.RANKS_CLOSED_BY] == "hung_elsewhere", verdict
