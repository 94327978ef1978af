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
from flare.wire import semconv as sc

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
    table = job.spans([sc.SPAN_STEP], attributes=[sc.STEP_PG_NAMES, sc.STEP_PG_ROLES],
                      columns=["rank", "resource"],
                      first_step=span[0], last_step=span[0] + FIRST_STEPS - 1)
    groups: dict[str, set[int]] = {}
    roles: dict[str, str] = {}  # pg name -> role, where the ranks said it
    seen: set[int] = set()

    def column(name: str) -> list:
        return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows

    for rank, resource, names, pg_roles in zip(column("rank"), column("resource"),
                                               column(sc.STEP_PG_NAMES), column(sc.STEP_PG_ROLES),
                                               strict=True):
        if rank is None:
            continue
        rank = int(rank)
        if isinstance(names, list):
            pg_roles = pg_roles if isinstance(pg_roles, list) and len(pg_roles) == len(names) else ()
            for index, name in enumerate(names):
                if isinstance(name, str) and name:
                    groups.setdefault(f"process group {name}", set()).add(rank)
                    if pg_roles and isinstance(pg_roles[index], str) and pg_roles[index]:
                        roles.setdefault(name, pg_roles[index])
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
    stages = _pipeline_stages(groups, roles)
    groups = {_group_name(name, descriptions, roles): members for name, members in groups.items()}
    # Nodes and hosts first: the more concrete name when a node is also a group; then
    # pipeline stages (a stage is also a data-parallel group of the stage's replicas).
    groups = {**stages, **groups}
    ordered = sorted(groups.items(), key=lambda item: (not item[0].startswith(("node ", "host ")),
                                                        not item[0].startswith("pipeline stage")))
    return Topology(everyone, {name: frozenset(m) for name, m in ordered
                               if 1 < len(m) < len(everyone)})


ROLE_NAMES = {sc.ROLE_DATA: "data-parallel", sc.ROLE_TENSOR: "tensor-parallel",
              sc.ROLE_PIPELINE: "pipeline", sc.ROLE_CONTEXT: "context-parallel",
              sc.ROLE_EXPERT: "expert-parallel"}


def _group_name(key: str, descriptions: dict[str, str], roles: dict[str, str]) -> str:
    """"process group 5" as the report says it: with its role ("tensor-parallel group 5")
    and its description where the ranks gave one."""
    if not key.startswith("process group "):
        return key
    name = key[len("process group "):]
    role = ROLE_NAMES.get(roles.get(name, ""))
    head = f"{role} group {name}" if role else key
    return f"{head} ({descriptions[name]})" if name in descriptions else head


def _pipeline_stages(groups: dict[str, set[int]], roles: dict[str, str]) -> dict[str, set[int]]:
    """Pipeline stage k: the k-th rank of every pipeline group (a group's ranks in order
    are its stages, as torch.distributed.pipelining and Megatron build them)."""
    stages: dict[str, set[int]] = {}
    for name, role in roles.items():
        members = groups.get(f"process group {name}")
        if role != sc.ROLE_PIPELINE or not members:
            continue
        for stage, rank in enumerate(sorted(members)):
            stages.setdefault(f"pipeline stage {stage}", set()).add(rank)
    return stages


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
