"""Bus bandwidth (nccl-tests convention): algorithm bandwidth times a factor that makes
it comparable across group sizes. `bytes` is the per-rank message: the shard for
all-gather / reduce-scatter, the whole tensor otherwise."""

from __future__ import annotations

_ALLREDUCE_LIKE = {"all_reduce", "all_reduce_coalesced"}
_SHARDED = {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
            "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"}


def bus_factor(op: str, group_size: int) -> float:
    n = max(group_size, 1)
    if op in _ALLREDUCE_LIKE:
        return 2.0 * (n - 1) / n
    if op in _SHARDED:
        return float(n - 1)
    return 1.0


def busbw_gbps(op: str, nbytes: int, group_size: int, duration_ns: int) -> float | None:
    if duration_ns <= 0 or nbytes <= 0:
        return None
    return nbytes * bus_factor(op, group_size) / duration_ns  # bytes/ns == GB/s
