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

from flare.diagnostics.model import JobData
from flare.instrumentation import semconv as sc

FIRST_STEPS = 5  # steps read for it: enough for every rank to have reported one


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
    """The groups, from the job's first steps (a rank's resource and process groups do
    not change within a job; reading them from every step of a 1,024-rank hour cost
    1.8 s and 200 MiB)."""
    everyone = frozenset(int(r) for r in ranks)
    span = job.steps_range()
    if span is None:
        return Topology(everyone, {})
    table = job.spans([sc.SPAN_STEP], attributes=[sc.STEP_PG_NAMES], columns=["rank", "resource"],
                      first_step=span[0], last_step=span[0] + FIRST_STEPS - 1)
    groups: dict[str, set[int]] = {}
    seen: set[int] = set()
    pg_names = (table.column(sc.STEP_PG_NAMES).to_pylist() if sc.STEP_PG_NAMES in table.column_names
                else [None] * table.num_rows)
    for rank, resource, names in zip(table.column("rank").to_pylist(),
                                     table.column("resource").to_pylist(), pg_names, strict=True):
        if rank is None:
            continue
        rank = int(rank)
        if isinstance(names, list):
            for name in names:
                if isinstance(name, str) and name:
                    groups.setdefault(f"process group {name}", set()).add(rank)
        if rank in seen:
            continue
        seen.add(rank)
        try:
            attrs = json.loads(resource) if resource else {}
        except ValueError:
            attrs = {}
        if not isinstance(attrs, dict):
            continue
        node = attrs.get(sc.NODE_RANK)
        if node is not None:
            groups.setdefault(f"node {node}", set()).add(rank)
        host = attrs.get(sc.HOST_NAME)
        if host:
            groups.setdefault(f"host {host}", set()).add(rank)
    descriptions = _descriptions(job, len(everyone))
    groups = {(f"{name} ({descriptions[name[len('process group '):]]})"
               if name.startswith("process group ") and name[len("process group "):] in descriptions
               else name): members for name, members in groups.items()}
    # Nodes and hosts first: the more concrete name when a node is also a group.
    ordered = sorted(groups.items(), key=lambda item: not item[0].startswith(("node ", "host ")))
    return Topology(everyone, {name: frozenset(m) for name, m in ordered
                               if 1 < len(m) < len(everyone)})


def _descriptions(job: JobData, world: int) -> dict[str, str]:
    """pg name -> its description (`group_desc`: a DeviceMesh dimension's `mesh_tp`,
    a pipeline stage's own name), from the first collective spans of detail steps."""
    table = job.spans(["collective.*"], attributes=[sc.COLL_PG, sc.COLL_PG_DESC], columns=["rank"],
                      limit=max(64, 16 * world))
    if sc.COLL_PG not in table.column_names or sc.COLL_PG_DESC not in table.column_names:
        return {}
    out: dict[str, str] = {}
    for name, desc in zip(table.column(sc.COLL_PG).to_pylist(),
                          table.column(sc.COLL_PG_DESC).to_pylist(), strict=True):
        if name and desc and desc not in ("undefined", "default_pg") and name not in out:
            out[str(name)] = str(desc)
    return out
