"""The collector's OpAMP server: the ranks are agents; a capture request reaches them.

OpAMP (OpenTelemetry's agent-management protocol) over plain HTTP: each rank's agent
(`flare.instrumentation.opamp_agent`, on the contrib `opentelemetry-opamp-client`) POSTs
an `AgentToServer` to `/v1/opamp` every few seconds and reads the `ServerToAgent` the
answer carries. The endpoint sits on the OTLP/HTTP receiver, behind its TLS and bearer
token: a request without them is refused (401) and counted before its body is read, so a
stranger cannot switch capture on across a cluster.

What the server keeps per agent: its job and rank (the identifying attributes
`flare.job.id`, `flare.rank`), when it was last heard from (its heartbeat), the config
it reports as effective, and at most one pending remote config. `request_capture` sets
that remote config (`{"capture": {"steps": K, "id": ...}}`, or `"detail"` for detail
steps without stack sampling) on the agents of the asked ranks; each poll's answer carries it until the agent reports it applied (by its hash).
An agent not heard from for `gone_after_s` (15 s), or for three of the poll intervals it
says it keeps (`flare.opamp.interval_s`) when that is longer, is marked gone and its
pending request dropped; one that says `agent_disconnect` is gone at once.

A body that is not an `AgentToServer` gets the protocol's error answer (a
`ServerToAgent` with a `BadRequest` `error_response`), never an exception.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry._opamp.proto import opamp_pb2

from flare.collector.telemetry import Counters

log = logging.getLogger(__name__)

PATH = "/v1/opamp"
CONTENT_TYPE = "application/x-protobuf"
CONFIG_NAME = "flare"  # the one file of Flare's remote config map
DEFAULT_GONE_AFTER_S = 15.0
DEFAULT_STEPS = 20
MAX_STEPS = 1000

_CAPABILITIES = (opamp_pb2.ServerCapabilities_AcceptsStatus
                 | opamp_pb2.ServerCapabilities_OffersRemoteConfig
                 | opamp_pb2.ServerCapabilities_AcceptsEffectiveConfig)


@dataclass
class Agent:
    uid: bytes
    job: str | None = None
    rank: int | None = None
    host: str | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0
    gone: bool = False
    effective: dict = field(default_factory=dict)
    interval_s: float = 0.0  # the poll interval it says it keeps (flare.opamp.interval_s)
    pending: bytes | None = None  # the remote config's JSON body still to be applied
    pending_hash: bytes = b""
    applied_hash: bytes = b""
    status: str = ""  # the last remote config status the agent reported
    error: str = ""

    def row(self, now: float) -> dict[str, Any]:
        return {"instance_uid": self.uid.hex(), "job": self.job, "rank": self.rank, "host": self.host,
                "state": "gone" if self.gone else "alive", "last_seen_s_ago": round(now - self.last_seen, 1),
                "effective_config": self.effective, "pending": self.pending is not None,
                "remote_config_status": self.status, "error": self.error or None}


def _attributes(kvs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        if kind in ("string_value", "int_value", "bool_value", "double_value"):
            out[kv.key] = getattr(kv.value, kind)
    return out


def _error(message: str, uid: bytes = b"") -> bytes:
    return opamp_pb2.ServerToAgent(
        instance_uid=uid,
        error_response=opamp_pb2.ServerErrorResponse(
            type=opamp_pb2.ServerErrorResponseType_BadRequest, error_message=message),
    ).SerializeToString()


class OpampServer:
    """The agents' registry and the capture requests waiting for them (thread-safe: the
    HTTP server answers each connection on a thread of its own)."""

    def __init__(self, counters: Counters, gone_after_s: float = DEFAULT_GONE_AFTER_S) -> None:
        self.counters = counters
        self.gone_after_s = gone_after_s
        self._agents: dict[bytes, Agent] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._expired_at = float("-inf")
        for name in ("opamp_messages", "opamp_malformed", "opamp_requests_dropped"):
            counters.add(name, 0.0)

    # ------------------------------------------------------------------ the protocol
    def handle(self, body: bytes) -> tuple[int, bytes]:
        """(HTTP status, ServerToAgent bytes) for one AgentToServer body."""
        message = opamp_pb2.AgentToServer()
        try:
            message.ParseFromString(body)
        except (DecodeError, ValueError) as exc:
            self.counters.add("opamp_malformed")
            return 400, _error(f"not an OpAMP AgentToServer message: {exc}")
        uid = bytes(message.instance_uid)
        if len(uid) != 16:
            self.counters.add("opamp_malformed")
            return 400, _error("instance_uid must be 16 bytes", uid)
        self.counters.add("opamp_messages")
        now = time.monotonic()
        reply = opamp_pb2.ServerToAgent(instance_uid=uid, capabilities=_CAPABILITIES)
        with self._lock:
            self._expire(now)
            agent = self._agents.get(uid)
            if agent is None:
                agent = self._agents[uid] = Agent(uid=uid, first_seen=now)
                if not message.HasField("agent_description"):
                    # a server that restarted does not know it: ask for the whole state
                    reply.flags |= opamp_pb2.ServerToAgentFlags_ReportFullState
            agent.last_seen, agent.gone = now, False
            if message.HasField("agent_description"):
                attrs = _attributes(message.agent_description.identifying_attributes)
                attrs.update(_attributes(message.agent_description.non_identifying_attributes))
                agent.job = str(attrs.get("flare.job.id") or attrs.get("service.name") or "") or None
                rank = attrs.get("flare.rank")
                agent.rank = int(rank) if isinstance(rank, (int, float, str)) and str(rank).lstrip("-").isdigit() else None
                agent.host = attrs.get("host.name")
                interval = attrs.get("flare.opamp.interval_s")
                agent.interval_s = float(interval) if isinstance(interval, (int, float)) else 0.0
            if message.HasField("effective_config"):
                files = message.effective_config.config_map.config_map
                if CONFIG_NAME in files:
                    try:
                        agent.effective = json.loads(files[CONFIG_NAME].body or b"{}")
                    except ValueError:
                        agent.effective = {}
            if message.HasField("remote_config_status"):
                status = message.remote_config_status
                agent.status = opamp_pb2.RemoteConfigStatuses.Name(status.status).split("_", 1)[-1]
                agent.error = status.error_message
                if agent.pending is not None and bytes(status.last_remote_config_hash) == agent.pending_hash \
                        and status.status in (opamp_pb2.RemoteConfigStatuses_APPLIED,
                                              opamp_pb2.RemoteConfigStatuses_FAILED):
                    agent.applied_hash, agent.pending = agent.pending_hash, None
            if message.HasField("agent_disconnect"):
                self._drop(agent, "it disconnected")
                return 200, reply.SerializeToString()
            if agent.pending is not None:
                config = reply.remote_config
                config.config_hash = agent.pending_hash
                file = config.config.config_map[CONFIG_NAME]
                file.body, file.content_type = agent.pending, "application/json"
        return 200, reply.SerializeToString()

    def _expire(self, now: float, every_s: float = 1.0) -> None:
        if now - self._expired_at < every_s:
            return  # (a pass over every agent, at most once a second per poll)
        self._expired_at = now
        for agent in self._agents.values():
            if not agent.gone and now - agent.last_seen > max(self.gone_after_s, 3 * agent.interval_s):
                self._drop(agent, f"not heard from for {now - agent.last_seen:.0f} s")

    def _drop(self, agent: Agent, why: str) -> None:
        agent.gone = True
        if agent.pending is not None:
            agent.pending = None
            self.counters.add("opamp_requests_dropped")
            log.info("rank %s of job %s is gone (%s): its capture request is dropped", agent.rank, agent.job, why)

    # ------------------------------------------------------------------ requests
    def request_capture(self, job: str | None, ranks: list[int], steps: int,
                        stacks: bool = True) -> dict[str, Any]:
        """Ask the live agents of `ranks` (of `job`, or of the only job the agents name)
        for `steps` captured steps (detail steps only, without `stacks`). Returns which
        ranks were asked and which are unknown or gone; raises ValueError for a job that
        is ambiguous."""
        steps = max(1, min(MAX_STEPS, int(steps)))
        now = time.monotonic()
        with self._lock:
            self._expire(now, 0.0)
            jobs = sorted({a.job for a in self._agents.values() if a.job and not a.gone})
            if job is None:
                if len(jobs) != 1:
                    raise ValueError(f"{len(jobs)} jobs have live agents ({', '.join(jobs) or 'none'}); name one")
                job = jobs[0]
            request_id = f"capture-{next(self._ids)}"
            key = "capture" if stacks else "detail"
            body = json.dumps({key: {"steps": steps, "id": request_id}}, sort_keys=True).encode()
            digest = hashlib.sha256(body).digest()
            by_rank = {a.rank: a for a in self._agents.values() if a.job == job and not a.gone}
            asked, unknown = [], []
            for rank in ranks:
                agent = by_rank.get(rank)
                if agent is None:
                    unknown.append(rank)
                    continue
                agent.pending, agent.pending_hash = body, digest
                asked.append(rank)
        if asked:
            log.info("capture %s: %d steps asked of job %s ranks %s", request_id, steps, job, asked)
        return {"job": job, "id": request_id, "steps": steps, "stacks": stacks, "asked": asked,
                "unknown": unknown}

    def agents(self, job: str | None = None) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            self._expire(now, 0.0)
            rows = [a.row(now) for a in self._agents.values() if job is None or a.job == job]
        return sorted(rows, key=lambda r: (r["job"] or "", r["rank"] if r["rank"] is not None else -1))

    def gauges(self) -> list[tuple[str, dict[str, str], float]]:
        """flare_collector_opamp_agents{flare_job, state}: the ranks alive and gone."""
        counts: dict[tuple[str, str], int] = {}
        for row in self.agents():
            key = (row["job"] or "", row["state"])
            counts[key] = counts.get(key, 0) + 1
        return [("opamp_agents", {"flare_job": job, "state": state}, float(n))
                for (job, state), n in sorted(counts.items())]
