"""Point-to-point and async handles on two real gloo ranks (two processes, each
instrumented with a real TracerProvider and an in-memory exporter)."""

from __future__ import annotations

import json
import socket

import torch.multiprocessing as mp
from p2p_worker import rank_main

from flare.wire import semconv


def test_point_to_point_and_async_handles(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        spans = json.loads((tmp_path / f"{rank}.json").read_text())
        names = sorted(s["name"] for s in spans if s["name"].startswith("collective."))
        assert names == sorted(["collective.send", "collective.recv",
                                "collective.batch_isend_irecv",
                                "collective.irecv" if rank else "collective.isend",
                                "collective.all_reduce"])
        by_name = {s["name"]: s["attributes"] for s in spans}
        assert by_name["collective.send"][semconv.COLL_P2P_PEER] == 1 - rank
        assert by_name["collective.send"][semconv.COLL_BYTES] == 32
        assert by_name["collective.batch_isend_irecv"][semconv.COLL_BYTES] == 64
        assert by_name["collective.batch_isend_irecv"][semconv.COLL_ASYNC] is True
        assert by_name["collective.all_reduce"][semconv.COLL_ASYNC] is True
        assert semconv.COLL_SEQ in by_name["collective.all_reduce"]
        assert semconv.COLL_SEQ not in by_name["collective.send"]
        step = by_name[semconv.SPAN_STEP]
        # the group's counter also advances per operation inside batch_isend_irecv
        assert step[semconv.STEP_PG_COUNTS][0] >= 5
        assert step[semconv.STEP_PG_BYTES] == [32 + 32 + 64 + 32 + 32]
