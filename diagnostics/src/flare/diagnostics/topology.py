"""Which groups the job's ranks form: nodes, hosts and process groups.

Read from what the spans already hold: each rank's resource (`flare.node_rank`,
`host.name`) and the process groups its steps report (`flare.step.pg.names`: a group's
name is the same on every member, so the ranks reporting a name are its members).
`describe(ranks)` names the group a set of ranks forms, if any: "node 1", "host h3",
"process group 3" — what a slow node, a slow switch or an unbalanced pipeline stage
looks like from the diagnosis.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

from flare.diagnostics.model import JobData, rank_resources
from flare.instrumentation import semconv as sc


@dataclasses.dataclass
class Topology:
    ranks: frozenset[int]
    groups: dict[str, frozenset[int]]  # description -> members, most specific kinds first

    def describe(self, ranks: Iterable[int]) -> str | None:
        """The group these ranks form exactly (a node, a host, a process group), or None."""
        wanted = frozenset(int(r) for r in ranks)
        if len(wanted) < 2 or wanted == self.ranks:
            return None
        for name, members in self.groups.items():
            if members == wanted:
                return name
        return None


def load(job: JobData, ranks: Iterable[int]) -> Topology:
    everyone = frozenset(int(r) for r in ranks)
    groups: dict[str, set[int]] = {}
    for rank, resource in rank_resources(job, [sc.SPAN_STEP]):
        try:
            attrs = json.loads(resource) if resource else {}
        except ValueError:
            attrs = {}
        if not isinstance(attrs, dict):
            continue
        node = attrs.get(sc.NODE_RANK)
        if node is not None:
            groups.setdefault(f"node {node}", set()).add(int(rank))
        host = attrs.get(sc.HOST_NAME)
        if host:
            groups.setdefault(f"host {host}", set()).add(int(rank))
    for name, members in _process_groups(job, len(everyone)).items():
        groups.setdefault(f"process group {name}", set()).update(members)
    return Topology(everyone, {name: frozenset(m) for name, m in groups.items()
                               if 1 < len(m) < len(everyone)})


def _process_groups(job: JobData, world: int) -> dict[str, set[int]]:
    """pg name -> ranks reporting it, from the first steps of each rank."""
    table = job.spans([sc.SPAN_STEP], attributes=[sc.STEP_PG_NAMES], columns=["rank"],
                      limit=max(64, 8 * world))
    if sc.STEP_PG_NAMES not in table.column_names:
        return {}
    members: dict[str, set[int]] = {}
    for rank, names in zip(table.column("rank").to_pylist(),
                           table.column(sc.STEP_PG_NAMES).to_pylist(), strict=True):
        if rank is None or not isinstance(names, list):
            continue
        for name in names:
            if isinstance(name, str) and name:
                members.setdefault(name, set()).add(int(rank))
    return members
