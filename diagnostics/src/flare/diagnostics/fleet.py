"""The fleet view: which hosts keep slowing jobs down, across every job a backend holds.

Each job whose steps ran within the window is diagnosed as `flare diagnose` would; each
label that names ranks charges their hosts (the `host.name` their step spans carry) with
the seconds the job lost to it: its impact (the share of the run the job spent waiting
on those ranks) times the job's wall time from its first step to its last, or a hang's
elapsed time. A label naming ranks on several hosts splits its seconds evenly; labels
for the whole job (a slower fabric, a busy host) name no host. A host is a culprit in a
job when one of its ranks is named there. Hosts that were culprits in at least
`min_jobs` jobs make the exclude list, the input a scheduler's node blocklist takes.
"""

from __future__ import annotations

import re
import time
from typing import Any

from flare.diagnostics.model import DiagnosisConfig, JobData
from flare.wire import semconv as sc

UNKNOWN_HOST = "(unknown host)"
_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s`, `2w` → seconds; ValueError with the reason otherwise."""
    match = _SINCE.match(text or "")
    if not match:
        raise ValueError(f"--since {text!r} is not a duration such as 7d, 12h or 30m")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def rank_hosts(job: JobData) -> dict[int, str]:
    """rank → host name, from the job's first steps (a rank keeps its host for the run)."""
    steps = job.steps_range()
    if steps is None:
        return {}
    table = job.spans([sc.SPAN_STEP], first_step=steps[0], last_step=steps[0] + 2,
                      columns=["rank", "host"])
    hosts: dict[int, str] = {}
    for rank, host in zip(table.column("rank").to_pylist(), table.column("host").to_pylist(), strict=True):
        if rank is not None and host and int(rank) not in hosts:
            hosts[int(rank)] = str(host)
    return hosts


def fleet(backend: Any, since_s: float | None = None, min_jobs: int = 2,
          config: DiagnosisConfig | None = None, now_s: float | None = None) -> dict[str, Any]:
    """{"jobs": N, "nodes": [{"host", "lost_s", "jobs", "culprit_jobs", "labels"}],
    "exclude": [host, …]}, nodes by seconds lost, most first."""
    from flare.diagnostics.pipeline import diagnose

    config = config or DiagnosisConfig()
    cutoff_ns = None if since_s is None else int(((now_s or time.time()) - since_s) * 1e9)
    nodes: dict[str, dict[str, Any]] = {}

    def node(host: str) -> dict[str, Any]:
        return nodes.setdefault(host, {"host": host, "lost_s": 0.0, "jobs": set(),
                                       "culprit_jobs": set(), "labels": []})

    counted = 0
    for name in backend.jobs():
        job = backend.job_data(name)
        activity = job.rank_activity([sc.SPAN_STEP]).to_pylist()
        starts = [r["first_start_ns"] for r in activity if r.get("first_start_ns") is not None]
        ends = [r["last_end_ns"] for r in activity if r.get("last_end_ns") is not None]
        if not ends or (cutoff_ns is not None and max(ends) < cutoff_ns):
            continue
        counted += 1
        hosts = rank_hosts(job)
        for host in set(hosts.values()) or {UNKNOWN_HOST}:
            node(host)["jobs"].add(name)
        wall_s = (max(ends) - min(starts)) / 1e9
        for anomaly in diagnose(job, config, warn=lambda _: None).anomalies:
            named = sorted({hosts.get(r, UNKNOWN_HOST) for r in anomaly.ranks})
            if not named:
                continue
            if anomaly.kind == "hang":
                lost = float(anomaly.evidence.get("elapsed_s") or 0.0)
            else:
                lost = max(0.0, float(anomaly.impact or 0.0)) * wall_s
            for host in named:
                entry = node(host)
                entry["lost_s"] += lost / len(named)
                entry["culprit_jobs"].add(name)
                entry["labels"].append({"job": name, "kind": anomaly.kind, "cause": anomaly.cause,
                                        "ranks": [r for r in anomaly.ranks if hosts.get(r, UNKNOWN_HOST) == host],
                                        "lost_s": round(lost / len(named), 1)})
    rows = sorted(nodes.values(), key=lambda n: (-n["lost_s"], -len(n["culprit_jobs"]), n["host"]))
    out = [{"host": n["host"], "lost_s": round(n["lost_s"], 1), "jobs": len(n["jobs"]),
            "culprit_jobs": len(n["culprit_jobs"]), "labels": n["labels"]} for n in rows]
    exclude = [n["host"] for n in out if n["culprit_jobs"] >= min_jobs and n["host"] != UNKNOWN_HOST]
    return {"jobs": counted, "nodes": out, "exclude": exclude}


def format_text(result: dict[str, Any], min_jobs: int) -> str:
    if not result["nodes"]:
        return f"no job with steps in the window ({result['jobs']} jobs)\n"
    width = max(len("HOST"), *(len(n["host"]) for n in result["nodes"]))
    lines = [f"{'HOST':<{width}}  {'LOST (s)':>9}  {'JOBS':>4}  {'CULPRIT IN':>10}  LABELS"]
    for n in result["nodes"]:
        labels = ", ".join(f"{lab['job']}: {lab['kind']} {lab['cause']} (ranks "
                           f"{','.join(map(str, lab['ranks']))})" for lab in n["labels"][:3])
        more = f", +{len(n['labels']) - 3} more" if len(n["labels"]) > 3 else ""
        lines.append(f"{n['host']:<{width}}  {n['lost_s']:>9.1f}  {n['jobs']:>4}  "
                     f"{n['culprit_jobs']:>10}  {labels or '-'}{more}")
    lines.append(f"exclude (culprit in ≥ {min_jobs} of {result['jobs']} jobs): "
                 + (", ".join(result["exclude"]) or "none"))
    return "\n".join(lines) + "\n"


def signature(job: JobData) -> dict[str, Any] | None:
    """What makes two jobs the same training: the script the ranks run, the world size,
    and the service name where the user set one (else it is the job id). None without a
    script (spans of an older Flare, or not run from a file)."""
    import json

    from flare.diagnostics.model import rank_resources

    for _, text in rank_resources(job, [sc.SPAN_STEP]):
        try:
            resource = json.loads(text) if text else {}
        except ValueError:
            continue
        command = resource.get(sc.PROCESS_COMMAND)
        if command:
            service = resource.get(sc.SERVICE_NAME)
            return {"command": str(command), "world_size": resource.get(sc.WORLD_SIZE),
                    "service": None if service in (None, "", job.job) else str(service)}
    return None


def auto_baseline(backend: Any, job: str,
                  passed_over: list[str] | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """The most recent job that ended before `job` began, with the same signature and no
    label written back into it (`flare run` writes its labels into the job's spans): a
    faulty earlier run is no baseline (seen: a job with a 60 % communication regression
    against its healthy predecessor read "No anomalies found" against the run in
    between, itself a gc straggler). When every such job carries labels, the most recent
    of them. (its name or None, `job`'s signature or None); `passed_over` receives the
    names of labelled jobs skipped, most recent first, and the one picked when all are."""
    from flare.diagnostics.pipeline import has_span

    target = backend.job_data(job)
    wanted = signature(target)
    starts = [r["first_start_ns"] for r in target.rank_activity([sc.SPAN_STEP]).to_pylist()
              if r.get("first_start_ns") is not None]
    if wanted is None or not starts:
        return None, wanted
    candidates: list[tuple[int, str, JobData]] = []
    for other in backend.jobs():
        if other == job:
            continue
        data = backend.job_data(other)
        ends = [r["last_end_ns"] for r in data.rank_activity([sc.SPAN_STEP]).to_pylist()
                if r.get("last_end_ns") is not None]
        if ends and max(ends) < min(starts) and signature(data) == wanted:
            candidates.append((max(ends), other, data))
    candidates.sort(key=lambda c: c[0], reverse=True)
    skipped = passed_over if passed_over is not None else []
    for _, name, data in candidates:
        if not has_span(data, sc.SPAN_ANOMALY):  # no label written back into it
            return name, wanted
        skipped.append(name)
    return (candidates[0][1] if candidates else None), wanted


def describe_signature(found: dict[str, Any] | None) -> str:
    if not found:
        return "no script recorded"
    parts = [f"script {found['command']}", f"{found['world_size']} ranks"]
    if found.get("service"):
        parts.append(f"service {found['service']}")
    return ", ".join(parts)
