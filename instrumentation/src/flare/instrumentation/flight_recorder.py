"""PyTorch's flight recorder: the ring buffer of every collective the process groups
issued, including those issued from C++ (DDP's bucket all-reduces, FSDP) that no Python
wrapper sees. Read only after detail steps (off the training thread) and for hang
reports: a dump costs ~7 µs per entry in the buffer."""

from __future__ import annotations

import logging
import math
import os
import pickle

from flare.instrumentation.config import FLIGHT_RECORDER_BUFFER
from flare.wire import semconv

_log = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
}
# Backend-level names in the recorder → the torch.distributed names used in span names.
_OP_NAMES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter_tensor", "alltoall_base": "all_to_all_single",
    "alltoall": "all_to_all", "reduce_scatter_tensor_coalesced":
    "reduce_scatter_tensor_coalesced",
}


def enable_if_unset() -> bool:
    """Turn the recorder on for process groups created from now on (it must be set before
    init_process_group). Returns True when Flare set it."""
    if os.environ.get(semconv.ENV_FR_BUFFER_SIZE):
        return False
    os.environ[semconv.ENV_FR_BUFFER_SIZE] = str(FLIGHT_RECORDER_BUFFER)
    return True


def op_name(profiling_name: str) -> str:
    raw = profiling_name.split(":", 1)[-1] if profiling_name else "unknown"
    return _OP_NAMES.get(raw, raw)


def entry_bytes(entry: dict) -> int:
    total = 0
    for sizes, dtype in zip(entry.get("input_sizes") or (), entry.get("input_dtypes") or (),
                            strict=False):
        total += math.prod(sizes) * _DTYPE_BYTES.get(dtype, 4)
    return total


class FlightRecorder:
    def __init__(self):
        self._dump = None
        self._warned = False
        try:
            from torch._C import _distributed_c10d

            self._dump = _distributed_c10d._dump_fr_trace
        except (ImportError, AttributeError):
            _log.warning("flare: this torch has no flight recorder; collectives issued "
                         "from C++ (DDP buckets) are counted but not detailed")

    @property
    def available(self) -> bool:
        return self._dump is not None

    def entries(self) -> list[dict]:
        """All entries now in the buffer, oldest first; [] when unavailable."""
        if self._dump is None:
            return []
        try:
            dump = pickle.loads(self._dump(True, False, False))
        except Exception as error:
            if not self._warned:
                self._warned = True
                _log.warning("flare: reading the flight recorder failed (%r); "
                             "continuing without it", error)
            return []
        return list(dump.get("entries") or ())

    @staticmethod
    def overwrote(entries: list[dict], since_ns: int) -> bool:
        """Whether the ring (full: `entries` is as long as the buffer) has overwritten
        entries created at or after `since_ns`."""
        try:
            capacity = int(os.environ.get(semconv.ENV_FR_BUFFER_SIZE) or 0)
        except ValueError:
            return False
        oldest = (entries[0].get("time_created_ns") or 0) if entries else 0
        return capacity > 0 and len(entries) >= capacity and oldest > since_ns

    def note_empty(self) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("flare: the flight recorder is empty although collectives ran "
                         "(process groups created before Flare set %s?); C++-issued "
                         "collectives are counted but not detailed", semconv.ENV_FR_BUFFER_SIZE)


def entry_pg_name(entry: dict) -> str:
    group = entry.get("process_group") or ("?", "")
    return str(group[0])


def entry_pg_desc(entry: dict) -> str:
    group = entry.get("process_group") or ("?", "")
    return str(group[1]) if len(group) > 1 else ""
