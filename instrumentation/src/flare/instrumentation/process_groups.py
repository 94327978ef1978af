"""Process-group facts (name, description, ranks, backend) and per-group sequence
numbers, cached so the per-collective cost is a dict lookup and one C++ call."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from flare.wire import semconv

_log = logging.getLogger(__name__)


# A group's role from its description (`group_desc`): a DeviceMesh dimension's
# "mesh_<dim>" (torchtitan's dp_shard, dp_replicate, cp, tp, pp, ep), Megatron's
# "TENSOR_MODEL_PARALLEL_GROUP" and the like, or a user's own name ("pipeline0").
_ROLE_WORDS = {
    **dict.fromkeys(("tp", "tensor"), semconv.ROLE_TENSOR),
    **dict.fromkeys(("pp", "pipe", "pipeline"), semconv.ROLE_PIPELINE),
    **dict.fromkeys(("cp", "context"), semconv.ROLE_CONTEXT),
    **dict.fromkeys(("ep", "expert", "moe"), semconv.ROLE_EXPERT),
    **dict.fromkeys(("dp", "data", "fsdp", "ddp", "hsdp", "zero", "shard", "replicate"),
                    semconv.ROLE_DATA),
}
_WORD = re.compile(r"[a-z]+")


def role_of(desc: str) -> str:
    """The parallelism a group serves, from its description; "" when it cannot be told.
    The first role word wins ("DATA_PARALLEL_GROUP_WITH_CP" is data parallel)."""
    desc = desc.lower()
    if desc in ("default_pg", "world"):
        return semconv.ROLE_WORLD
    for word in _WORD.findall(desc.removeprefix("mesh_")):
        role = _ROLE_WORDS.get(word)
        if role:
            return role
    return ""


@dataclass(frozen=True)
class PgInfo:
    name: str
    desc: str
    ranks: tuple[int, ...]
    backend: str
    role: str = ""

    @property
    def size(self) -> int:
        return len(self.ranks)


class ProcessGroups:
    def __init__(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._dist = dist
        self._c10d = distributed_c10d
        self._info: dict[int, tuple[object, PgInfo]] = {}
        self._no_sequence: set[int] = set()
        # sequence_snapshot() runs a few times per step: the groups and their names are
        # resolved again only when the set of groups changes.
        self._snapshot_groups: tuple = ()
        self._pg_registry: dict | None = None  # c10d's dict of live groups (see _registry)
        self._snapshot_named: list[tuple[object, str]] = []
        self.roles: dict[str, str] = {}  # group name -> role, of the groups known by role

    def resolve(self, group):
        """The ProcessGroup object a `group=` argument means (None: the default group)."""
        if group is None or group is getattr(self._dist.GroupMember, "WORLD", None):
            try:
                return self._c10d._get_default_group()
            except Exception:  # not initialised: the call itself will raise
                return None
        return group

    def info(self, pg) -> PgInfo | None:
        if pg is None:
            return None
        cached = self._info.get(id(pg))
        if cached is not None and cached[0] is pg:
            return cached[1]
        try:
            ranks = tuple(self._dist.get_process_group_ranks(pg))
        except Exception:
            ranks = ()
        try:
            backend = str(self._dist.get_backend(pg))
        except Exception:
            backend = "unknown"
        desc = str(getattr(pg, "group_desc", "") or "")
        info = PgInfo(name=str(getattr(pg, "group_name", "") or "?"), desc=desc,
                      ranks=ranks, backend=backend, role=role_of(desc))
        self._info[id(pg)] = (pg, info)
        if info.role and len(self.roles) < 4096:
            self.roles[info.name] = info.role
        return info

    def sequence(self, pg) -> int | None:
        """The group's collective sequence number (the id of its latest collective)."""
        if pg is None or id(pg) in self._no_sequence:
            return None
        try:
            return int(pg._get_sequence_number_for_group())
        except Exception:
            self._no_sequence.add(id(pg))
            _log.warning("flare: process group %s (backend %s) has no sequence numbers: its "
                         "collectives are counted from Python only, and any it issues "
                         "from C++ are not seen (their wait reads as compute)",
                         getattr(pg, "group_name", "?"), self.info(pg).backend)
            return None

    def all_groups(self) -> list:
        try:
            return list(self._c10d._world.pg_map.keys())
        except Exception:
            return []

    def sequenced_groups(self) -> int:
        """How many groups the last `sequence_snapshot` read (0 before the first)."""
        return len(self._snapshot_named)

    def _registry(self) -> tuple[dict | None, bool]:
        """c10d's registry of live groups, and whether it may be held across calls:
        the module's `_pg_map` (which `_world.pg_map` returns; torch adds to it,
        deletes from it and clears it, never rebinds it) may; another torch's
        `_world.pg_map` is asked again each time."""
        registry = getattr(self._c10d, "_pg_map", None)
        if isinstance(registry, dict):
            return registry, True
        try:
            registry = self._c10d._world.pg_map
        except Exception:
            return None, False
        return (registry if isinstance(registry, dict) else None), False

    def sequence_snapshot(self) -> dict[str, int]:
        """{group name: sequence number} of every live group: one native call per
        group. It runs at every step boundary, right after the optimizer step (cold
        caches): whether the set of groups changed is checked on the registry dict
        held since the first call (its size, and each known group still in it),
        without building anything."""
        registry = self._pg_registry
        if registry is None:
            registry, held = self._registry()
            if held:
                self._pg_registry = registry
        groups = self._snapshot_groups
        if registry is None:
            changed = bool(groups)
        elif len(registry) != len(groups):
            changed = True
        elif len(groups) == 1:
            changed = groups[0] not in registry
        else:
            changed = not all(pg in registry for pg in groups)
        if changed:
            groups = tuple(registry) if registry is not None else ()
            named = []
            for pg in groups:
                info = self.info(pg)
                if info is not None and self.sequence(pg) is not None:
                    named.append((pg._get_sequence_number_for_group, info.name))
            self._snapshot_groups, self._snapshot_named = groups, named
        snapshot = {}
        for sequence_of, name in self._snapshot_named:
            try:
                snapshot[name] = sequence_of()  # (an int: pybind converts the uint64)
            except Exception:  # a group being torn down; resolved again next change
                self._snapshot_groups = ()
        return snapshot

    def infos_by_name(self) -> dict[str, PgInfo]:
        return {info.name: info for _, info in self._info.values()}
