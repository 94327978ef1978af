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

Who is who (docs/collector.md, "The control channel"). The ingest token lets a client
talk to the endpoint at all; every rank holds it, so it proves nothing about *which*
rank is talking. Hence:

- **An agent is bound to a key.** Each agent sends a random secret of its own,
  `X-Flare-Agent-Key`, with every message; the first message of an instance uid binds
  the uid to that key (its SHA-256 is kept), and any later message for the uid without
  the same key is refused (403). Knowing a uid (a listing shows them to operators only)
  is therefore not enough to disconnect an agent, acknowledge its request or read it.
- **A rank is held by one live agent.** A second live agent claiming the job and rank
  of a live one is refused (409) until the first is gone; an agent cannot change the
  job or rank it registered with.
- **A job can be closed to other jobs' ranks.** With a `job_secret` (`flare run` makes
  one per run), an agent must show its job's token, `X-Flare-Job-Token` =
  HMAC-SHA256(job_secret, job id) in hex, to register as a rank of that job.
- **Control is scoped.** With an `operator_token` or a `job_secret` configured, a
  capture request or an agent listing needs `X-Flare-Operator-Token` (any job) or the
  job's token (that job only); listings show instance uids to operators only.
- **State is bounded.** Identity fields are at most 256 characters, a reported config
  4 KiB, a message 64 KiB; gone agents are forgotten `forget_after` (10 min) after they
  went (and with them their job's series in /metrics); at most `max_agents` are kept,
  the oldest gone first to make room, further newcomers refused (503).

Every refusal is counted in `opamp_refused{cause}` and logged at most once a minute
per cause.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from flare.collector.config import OpampConfig
from flare.collector.telemetry import Counters, Refusals
from flare.wire.sdk_adapter import opamp_protocol

opamp_pb2 = opamp_protocol()

log = logging.getLogger(__name__)

PATH = "/v1/opamp"
CONTENT_TYPE = "application/x-protobuf"
CONFIG_NAME = "flare"  # the one file of Flare's remote config map
DEFAULT_GONE_AFTER_S = 15.0
DEFAULT_STEPS = 20
MAX_STEPS = 1000
# (flare.wire.semconv spells the same names for the ranks and the CLI)
AGENT_KEY_HEADER = "X-Flare-Agent-Key"
JOB_TOKEN_HEADER = "X-Flare-Job-Token"
OPERATOR_TOKEN_HEADER = "X-Flare-Operator-Token"
MAX_MESSAGE_BYTES = 64 << 10
MAX_FIELD_CHARS = 256
MAX_CONFIG_BYTES = 4 << 10
MAX_ERROR_CHARS = 1024
_REFUSALS = ("no_agent_key", "agent_key", "identity_taken", "identity_changed", "job_token",
             "oversized_field", "agent_cap", "control_scope")


def job_token(job_secret: bytes, job: str) -> str:
    """The token that admits a job's ranks and scopes control to that job."""
    return hmac.new(job_secret, job.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


class Denied(Exception):
    """A message or request the control channel refuses: (HTTP status, cause, sentence)."""

    def __init__(self, status: int, cause: str, message: str) -> None:
        super().__init__(message)
        self.status, self.cause = status, cause

_CAPABILITIES = (opamp_pb2.ServerCapabilities_AcceptsStatus
                 | opamp_pb2.ServerCapabilities_OffersRemoteConfig
                 | opamp_pb2.ServerCapabilities_AcceptsEffectiveConfig)


@dataclass
class Agent:
    uid: bytes
    key_hash: bytes = b""
    job: str | None = None
    rank: int | None = None
    host: str | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0
    gone: bool = False
    gone_at: float = 0.0
    effective: dict = field(default_factory=dict)
    interval_s: float = 0.0  # the poll interval it says it keeps (flare.opamp.interval_s)
    pending: bytes | None = None  # the remote config's JSON body still to be applied
    pending_hash: bytes = b""
    applied_hash: bytes = b""
    status: str = ""  # the last remote config status the agent reported
    error: str = ""

    def row(self, now: float, with_uid: bool) -> dict[str, Any]:
        row = {"job": self.job, "rank": self.rank, "host": self.host,
               "state": "gone" if self.gone else "alive", "last_seen_s_ago": round(now - self.last_seen, 1),
               "effective_config": self.effective, "pending": self.pending is not None,
               "remote_config_status": self.status, "error": self.error or None}
        return {"instance_uid": self.uid.hex(), **row} if with_uid else row


def _attributes(kvs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        if kind in ("string_value", "int_value", "bool_value", "double_value"):
            value = getattr(kv.value, kind)
            if len(kv.key) > MAX_FIELD_CHARS or (kind == "string_value" and len(value) > MAX_FIELD_CHARS):
                raise Denied(400, "oversized_field",
                             f"attribute {kv.key[:40]!r} is over {MAX_FIELD_CHARS} characters")
            out[kv.key] = value
    return out


def _digest(text: str | bytes) -> bytes:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")).digest()


def _error(message: str, uid: bytes = b"") -> bytes:
    return opamp_pb2.ServerToAgent(
        instance_uid=uid,
        error_response=opamp_pb2.ServerErrorResponse(
            type=opamp_pb2.ServerErrorResponseType_BadRequest, error_message=message),
    ).SerializeToString()


class OpampServer:
    """The agents' registry and the capture requests waiting for them (thread-safe: the
    HTTP server answers each connection on a thread of its own)."""

    def __init__(self, counters: Counters, gone_after_s: float = DEFAULT_GONE_AFTER_S,
                 policy: OpampConfig | None = None) -> None:
        self.counters = counters
        self.gone_after_s = gone_after_s
        self.policy = policy or OpampConfig()
        self.refusals = Refusals(counters)
        self._agents: dict[bytes, Agent] = {}
        self._holders: dict[tuple[str, int], Agent] = {}  # (job, rank) -> the agent that holds it
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._expired_at = float("-inf")
        self._operator = _digest(self.policy.operator_token) if self.policy.operator_token else None
        for name in ("opamp_messages", "opamp_malformed", "opamp_requests_dropped", "opamp_forgotten"):
            counters.add(name, 0.0)
        for cause in _REFUSALS:
            counters.add("opamp_refused", 0.0, cause=cause)

    @property
    def scoped(self) -> bool:
        """Control needs an operator or a job token (one of them is configured)."""
        return self._operator is not None or self.policy.job_secret is not None

    # ------------------------------------------------------------------ the protocol
    def handle(self, body: bytes, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """(HTTP status, ServerToAgent bytes) for one AgentToServer body and its headers."""
        message = opamp_pb2.AgentToServer()
        try:
            message.ParseFromString(body)
        except (DecodeError, ValueError, RecursionError) as exc:
            self.counters.add("opamp_malformed")
            return 400, _error(f"not an OpAMP AgentToServer message: {exc}")
        uid = bytes(message.instance_uid)
        if len(uid) != 16:
            self.counters.add("opamp_malformed")
            return 400, _error("instance_uid must be 16 bytes", uid)
        try:
            with self._lock:
                reply = self._handle(uid, message, headers or {})
        except Denied as denied:
            self.refused(denied)
            return denied.status, _error(str(denied), uid)
        self.counters.add("opamp_messages")
        return 200, reply.SerializeToString()

    def _handle(self, uid: bytes, message: Any, headers: Mapping[str, str]) -> Any:
        key = headers.get(AGENT_KEY_HEADER) or ""
        if not 16 <= len(key) <= MAX_FIELD_CHARS:
            raise Denied(401, "no_agent_key", f"every OpAMP message needs its agent's {AGENT_KEY_HEADER}")
        now = time.monotonic()
        self._expire(now)
        agent = self._agents.get(uid)
        if agent is not None and not hmac.compare_digest(agent.key_hash, _digest(key)):
            raise Denied(403, "agent_key", f"instance uid {uid.hex()} belongs to another agent")
        new = agent is None
        if agent is not None and agent.gone and agent.job is not None and agent.rank is not None:
            holder = self._holders.get((agent.job, agent.rank))
            if holder is not None and holder is not agent and not holder.gone:
                # back after it was gone, but its rank is another live agent's now
                raise Denied(409, "identity_taken", f"rank {agent.rank} of job {agent.job} is held by "
                             "another live agent since this one went")
        if new:
            self._make_room()
            agent = Agent(uid=uid, key_hash=_digest(key), first_seen=now)
        reply = opamp_pb2.ServerToAgent(instance_uid=uid, capabilities=_CAPABILITIES)
        # Everything is checked before anything is kept: a refused message changes nothing.
        described = message.HasField("agent_description")
        if described:
            attrs = _attributes(message.agent_description.identifying_attributes)
            attrs.update(_attributes(message.agent_description.non_identifying_attributes))
            job = str(attrs.get("flare.job.id") or attrs.get("service.name") or "") or None
            rank = attrs.get("flare.rank")
            rank = int(rank) if isinstance(rank, (int, float, str)) and str(rank).lstrip("-").isdigit() \
                and len(str(rank)) < 12 else None
            self._check_identity(agent, job, rank, headers)
        effective = None
        if message.HasField("effective_config"):
            files = message.effective_config.config_map.config_map
            if CONFIG_NAME in files:
                if len(files[CONFIG_NAME].body) > MAX_CONFIG_BYTES:
                    raise Denied(400, "oversized_field", f"effective config over {MAX_CONFIG_BYTES} bytes")
                try:
                    effective = json.loads(files[CONFIG_NAME].body or b"{}")
                except (ValueError, RecursionError):
                    effective = {}
        if new:
            self._agents[uid] = agent
            if not described:  # a server that restarted does not know it: ask for the whole state
                reply.flags |= opamp_pb2.ServerToAgentFlags_ReportFullState
        agent.last_seen, agent.gone = now, False
        if described:
            if job is not None and rank is not None:
                self._holders[(job, rank)] = agent
            agent.job, agent.rank = job, rank
            host = attrs.get("host.name")
            agent.host = str(host) if host is not None else None
            interval = attrs.get("flare.opamp.interval_s")
            agent.interval_s = float(interval) if isinstance(interval, (int, float)) else 0.0
        if effective is not None:
            agent.effective = effective if isinstance(effective, dict) else {}
        if message.HasField("remote_config_status"):
            status = message.remote_config_status
            agent.status = opamp_pb2.RemoteConfigStatuses.Name(status.status).split("_", 1)[-1] \
                if status.status in opamp_pb2.RemoteConfigStatuses.values() else "UNKNOWN"
            agent.error = status.error_message[:MAX_ERROR_CHARS]
            if agent.pending is not None and hmac.compare_digest(bytes(status.last_remote_config_hash),
                                                                agent.pending_hash) \
                    and status.status in (opamp_pb2.RemoteConfigStatuses_APPLIED,
                                          opamp_pb2.RemoteConfigStatuses_FAILED):
                agent.applied_hash, agent.pending = agent.pending_hash, None
        if message.HasField("agent_disconnect"):
            self._drop(agent, "it disconnected")
            return reply
        if agent.pending is not None:
            config = reply.remote_config
            config.config_hash = agent.pending_hash
            file = config.config.config_map[CONFIG_NAME]
            file.body, file.content_type = agent.pending, "application/json"
        return reply

    def _check_identity(self, agent: Agent, job: str | None, rank: int | None,
                        headers: Mapping[str, str]) -> None:
        if agent.job is not None and (job, rank) != (agent.job, agent.rank):
            raise Denied(403, "identity_changed",
                         f"this agent registered as rank {agent.rank} of job {agent.job}; it cannot become "
                         f"rank {rank} of job {job}")
        if self.policy.job_secret is not None and job is not None and agent.job is None \
                and not self._job_token_ok(headers, job):
            raise Denied(403, "job_token", f"no valid {JOB_TOKEN_HEADER} for job {job}")
        if job is not None and rank is not None:
            holder = self._holders.get((job, rank))
            if holder is not None and holder is not agent and not holder.gone and self._overdue(holder):
                self._drop(holder, "a new agent registered its rank after it fell silent")
            if holder is not None and holder is not agent and not holder.gone:
                raise Denied(409, "identity_taken",
                             f"rank {rank} of job {job} is held by a live agent; a second one is refused "
                             "until it is gone")

    def _make_room(self) -> None:
        if len(self._agents) < self.policy.max_agents:
            return
        self._expire(time.monotonic(), 0.0)  # who is gone by now
        gone = sorted((a for a in self._agents.values() if a.gone), key=lambda a: a.gone_at)
        for agent in gone[:max(1, len(self._agents) - self.policy.max_agents + 1)]:
            self._forget(agent)
        if len(self._agents) >= self.policy.max_agents:
            raise Denied(503, "agent_cap", f"the collector keeps at most {self.policy.max_agents} agents")

    def _forget(self, agent: Agent) -> None:
        self._agents.pop(agent.uid, None)
        if agent.job is not None and agent.rank is not None \
                and self._holders.get((agent.job, agent.rank)) is agent:
            del self._holders[(agent.job, agent.rank)]
        self.counters.add("opamp_forgotten")

    def _overdue(self, agent: Agent, now: float | None = None) -> bool:
        silent = (time.monotonic() if now is None else now) - agent.last_seen
        return silent > max(self.gone_after_s, 3 * agent.interval_s)

    def _expire(self, now: float, every_s: float = 1.0) -> None:
        if now - self._expired_at < every_s:
            return  # (a pass over every agent, at most once a second per poll)
        self._expired_at = now
        for agent in list(self._agents.values()):
            if not agent.gone and self._overdue(agent, now):
                self._drop(agent, f"not heard from for {now - agent.last_seen:.0f} s")
            elif agent.gone and now - agent.gone_at >= self.policy.forget_after_s:
                self._forget(agent)

    def _drop(self, agent: Agent, why: str) -> None:
        agent.gone, agent.gone_at = True, time.monotonic()
        if agent.pending is not None:
            agent.pending = None
            self.counters.add("opamp_requests_dropped")
            log.info("rank %s of job %s is gone (%s): its capture request is dropped", agent.rank, agent.job, why)

    # ------------------------------------------------------------------ who may ask
    def refused(self, denied: Denied) -> None:
        """Count a refusal by its cause; one log line a minute per cause."""
        self.refusals.add("opamp_refused", denied.cause, "control channel: refused (%s): %s",
                          denied.cause, str(denied))

    def is_operator(self, headers: Mapping[str, str]) -> bool:
        given = headers.get(OPERATOR_TOKEN_HEADER)
        return self._operator is not None and given is not None \
            and hmac.compare_digest(_digest(given), self._operator)

    def may_control(self, headers: Mapping[str, str], job: str | None) -> bool:
        """True when the caller may list or capture `job` (None: every job)."""
        if not self.scoped or self.is_operator(headers):
            return True
        return job is not None and self._job_token_ok(headers, job)

    def _job_token_ok(self, headers: Mapping[str, str], job: str) -> bool:
        """The request carries `job`'s token (constant-time; False without a job secret)."""
        secret, given = self.policy.job_secret, headers.get(JOB_TOKEN_HEADER)
        return secret is not None and given is not None \
            and hmac.compare_digest(given.encode("utf-8", "replace"), job_token(secret, job).encode())

    def check_control(self, headers: Mapping[str, str], job: str | None) -> None:
        """Denied (403) unless the caller may list or capture `job` (None: every job)."""
        if not self.may_control(headers, job):
            what = f"job {job}" if job is not None else "every job (name one with its token)"
            raise Denied(403, "control_scope",
                         f"no {OPERATOR_TOKEN_HEADER}, or {JOB_TOKEN_HEADER} of the job, covers {what}")

    # ------------------------------------------------------------------ requests
    def request_capture(self, job: str | None, ranks: list[int], steps: int,
                        stacks: bool = True) -> dict[str, Any]:
        """Ask the live agents of `ranks` (of `job`, or of the only job the agents name)
        for `steps` captured steps (detail steps only, without `stacks`). Returns which
        ranks were asked and which are unknown or gone; raises ValueError for a job that
        is ambiguous. (The caller checks who may ask: `check_control`.)"""
        steps = max(1, min(MAX_STEPS, int(steps)))
        now = time.monotonic()
        with self._lock:
            self._expire(now, 0.0)
            if job is None:
                jobs = sorted({a.job for a in self._agents.values() if a.job and not a.gone})
                if not jobs:  # (it said "0 jobs have live agents (none); name one")
                    raise ValueError("no job has live agents: no rank of a running job is connected "
                                     "to this collector's control channel")
                if len(jobs) != 1:
                    raise ValueError(f"{len(jobs)} jobs have live agents ({', '.join(jobs[:20])}); "
                                     "name one with --job")
                job = jobs[0]
            # the id is not guessable: a status naming its hash comes from the agent it was sent to
            request_id = f"capture-{next(self._ids)}-{secrets.token_hex(6)}"
            key = "capture" if stacks else "detail"
            body = json.dumps({key: {"steps": steps, "id": request_id}}, sort_keys=True).encode()
            digest = hashlib.sha256(body).digest()
            asked, unknown = [], []
            for rank in ranks:
                agent = self._holders.get((job, rank))
                if agent is None or agent.gone:
                    unknown.append(rank)
                    continue
                agent.pending, agent.pending_hash = body, digest
                asked.append(rank)
        if asked:
            log.info("capture %s: %d steps asked of job %s ranks %s", request_id, steps, job, asked)
        return {"job": job, "id": request_id, "steps": steps, "stacks": stacks, "asked": asked,
                "unknown": unknown}

    def agents(self, job: str | None = None, with_uids: bool = False) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            self._expire(now, 0.0)
            rows = [a.row(now, with_uids) for a in self._agents.values() if job is None or a.job == job]
        return sorted(rows, key=lambda r: (r["job"] or "", r["rank"] if r["rank"] is not None else -1))

    def gauges(self) -> list[tuple[str, dict[str, str], float]]:
        """flare_collector_opamp_agents{flare_job, state}: the ranks alive and gone (a job's
        series goes with its last agent, forgotten `forget_after` after it went)."""
        counts: dict[tuple[str, str], int] = {}
        now = time.monotonic()
        with self._lock:
            self._expire(now, 0.0)
            for agent in self._agents.values():
                key = (agent.job or "", "gone" if agent.gone else "alive")
                counts[key] = counts.get(key, 0) + 1
        return [("opamp_agents", {"flare_job": job, "state": state}, float(n))
                for (job, state), n in sorted(counts.items())]
