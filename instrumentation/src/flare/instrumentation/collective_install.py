"""Putting the collective wrappers on torch.distributed, once per install (not per call):
which argument of each wrapped function holds its group, data and peer (`CallSpec`,
read from its signature), and the patches that replace the functions, DDP's buffer
broadcast and `Work.wait` with the CollectiveTracker's wrappers."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

# The tracker's logger: what is said at install keeps the name it always had.
_log = logging.getLogger("flare.instrumentation.collectives")

# op -> the argument whose tensors define the per-rank message size.
DATA_ARGUMENT = {
    "all_reduce": "tensor", "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output", "reduce_scatter_tensor": "output", "broadcast": "tensor",
    "reduce": "tensor", "all_to_all": "input_tensor_list", "all_to_all_single": "input",
    "barrier": None, "send": "tensor", "recv": "tensor", "isend": "tensor",
    "irecv": "tensor", "gather": "tensor", "scatter": "tensor",
    # What FSDP (1 and 2) and newer torch call: the single-tensor all-gather and
    # reduce-scatter (torch >= 2.11), the underscore originals, the coalesced forms.
    "all_gather_single": "input_tensor", "reduce_scatter_single": "output",
    "_all_gather_base": "input_tensor", "_reduce_scatter_base": "output",
    "all_reduce_coalesced": "tensors", "all_gather_coalesced": "input_tensor_list",
    "monitored_barrier": None,
}
PEER_ARGUMENT = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}


@dataclass
class CallSpec:
    """Where a wrapped function keeps its arguments, resolved once at install time."""

    op: str
    group_index: int | None
    async_index: int | None
    data_name: str | None
    data_index: int | None
    peer_index: int | None
    peer_name: str | None

    @classmethod
    def of(cls, op: str, function) -> CallSpec:
        names = list(inspect.signature(function).parameters)

        def index(name):
            return names.index(name) if name in names else None

        data_name = DATA_ARGUMENT.get(op)
        peer_name = PEER_ARGUMENT.get(op)
        return cls(op, index("group"), index("async_op"), data_name,
                   index(data_name) if data_name else None,
                   index(peer_name) if peer_name else None, peer_name)

    def argument(self, args, kwargs, name, position):
        if name in kwargs:
            return kwargs[name]
        if position is not None and position < len(args):
            return args[position]
        return None


def wrap_distributed(patches, wrap, wrap_wait) -> None:
    """Replace torch.distributed's collectives (`wrap(original, spec)` makes each
    wrapper), DDP's buffer broadcast and `Work.wait` (`wrap_wait(original)`), recording
    every replacement in `patches` (a `Patches`) so that uninstall restores them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for op in (*DATA_ARGUMENT, "batch_isend_irecv"):
        original = getattr(distributed_c10d, op, None)
        if original is None or getattr(original, "_flare_traced", False):
            continue
        try:
            spec = CallSpec.of(op, original)
        except (TypeError, ValueError):
            _log.info("flare: cannot read the signature of torch.distributed.%s", op)
            continue
        wrapper = wrap(original, spec)
        patches.replace(distributed_c10d, op, wrapper)
        if getattr(dist, op, None) is original:
            patches.replace(dist, op, wrapper)
    _install_ddp_buffer_broadcast(dist, patches, wrap)
    work_class = getattr(distributed_c10d, "Work", None)
    if work_class is not None and hasattr(work_class, "wait"):
        try:
            patches.replace(work_class, "wait", wrap_wait(work_class.wait))
        except (AttributeError, TypeError):
            _log.info("flare: Work.wait cannot be wrapped; async waits are not timed")


def _install_ddp_buffer_broadcast(dist, patches, wrap) -> None:
    """DDP's broadcast of the module's buffers before every forward (BatchNorm's
    running statistics, a causal mask; `broadcast_buffers=True`, its default): a
    blocking collective where every rank waits for the slowest, called through
    `torch.distributed._broadcast_coalesced` — a private torch binding, looked up at
    each call (torch 2.x). Timed as a `broadcast` of its group; where torch has no
    such name it is left alone, and that wait reads as the step's own time, as
    before (transformers 4.46's GPT-2 waited 0.4 s there for rank 0's checkpoint,
    read as the other ranks' compute)."""
    original = getattr(dist, "_broadcast_coalesced", None)
    if original is None or getattr(original, "_flare_traced", False):
        if original is None:
            _log.info("flare: torch.distributed has no _broadcast_coalesced; DDP's buffer "
                      "broadcasts are not timed")
        return

    def _broadcast_coalesced(group, tensor, buffer_size, src=0):
        return original(group, tensor, buffer_size, src)

    wrapper = wrap(_broadcast_coalesced, CallSpec.of("broadcast", _broadcast_coalesced))
    patches.replace(dist, "_broadcast_coalesced", wrapper)
