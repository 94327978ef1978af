"""The rank as an OpAMP agent: the collector's channel for asking a capture.

On when `FLARE_OPAMP_ENDPOINT` names the collector's OpAMP endpoint
(`http(s)://HOST:4318/v1/opamp`; `flare run` sets it). One thread of its own
(`flare-opamp`) polls it every `FLARE_OPAMP_INTERVAL_S` (default 5 s), off the training
thread, with the contrib client's messages (`opentelemetry-opamp-client`'s
`OpAMPClient`): a poll is one small POST on a kept-alive connection of Flare's one HTTP
client (`http_client`, the client's pluggable transport). A collector that is down or
slow costs that thread a refused connection or the client's 1 s timeout per poll, the
polls backing off (doubling up to 60 s), never a step.

The agent identifies itself by the rank's `flare.job.id` and `flare.rank` (and says its
host and pid), with the token and TLS files the rank's OTLP exporter uses
(`OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, `…_CERTIFICATE`, `…_CLIENT_CERTIFICATE`,
`…_CLIENT_KEY`), and proves who it is: a random key of its own on every message (the
collector binds its instance uid to it, so no one else can speak for this agent) and
its job's token, `FLARE_JOB_TOKEN`, where the launcher gives one (`flare run` does). Flare's remote config is one JSON file, `flare`:

    {"capture": {"steps": 20, "id": "capture-3"}}

asks for K captured steps (`stack_capture.StackCapture`: detail steps with the training
thread's stack sampled); `{"detail": {"steps": K, "id": …}}` for K detail steps only
(collectives from the flight recorder, kernel windows where they are on), no sampling;
`"steps": 0` ends either. A request id is served once. Unknown keys are ignored with one
warning each. The agent reports the config applied (by its hash) and its effective
config (`{"capture": {"steps_left": n}}`), again when a capture ends. When the
collector stops answering, a capture in progress is stopped.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
import time

from flare.wire import http_client, semconv

_log = logging.getLogger(__name__)

ENV_ENDPOINT = "FLARE_OPAMP_ENDPOINT"
ENV_INTERVAL_S = "FLARE_OPAMP_INTERVAL_S"
DEFAULT_INTERVAL_S = 5.0
MAX_BACKOFF_S = 60.0
CONFIG_NAME = "flare"
INTERVAL_ATTRIBUTE = "flare.opamp.interval_s"
SAY_FAILURE_EVERY_S = 300.0


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _interval_s() -> float:
    text = os.environ.get(ENV_INTERVAL_S, "")
    try:
        value = float(text) if text else DEFAULT_INTERVAL_S
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600:
        _log.warning("flare: %s=%r is not a number of seconds in 0.1-3600; using %g",
                     ENV_INTERVAL_S, text, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return value


def start(identity, capture) -> CaptureAgent | None:
    """The rank's agent, started, or None (no endpoint, or no OpAMP client installed)."""
    endpoint = os.environ.get(ENV_ENDPOINT)
    if not endpoint:
        return None
    try:
        agent = CaptureAgent(endpoint, identity, capture, _interval_s())
    except ImportError as exc:
        _log.warning("flare: %s is set but the OpAMP client cannot be imported (%s); capture on "
                     "request is off", ENV_ENDPOINT, exc)
        return None
    agent.start()
    return agent


class CaptureAgent:
    def __init__(self, endpoint: str, identity, capture, interval_s: float) -> None:
        from opentelemetry.util.re import parse_env_headers

        from flare.wire.sdk_adapter import opamp

        headers = parse_env_headers(_env("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") or "",
                                    liberal=True)
        headers[semconv.HEADER_AGENT_KEY] = secrets.token_urlsafe(32)
        job_token = os.environ.get(semconv.ENV_JOB_TOKEN)
        if job_token:
            headers[semconv.HEADER_JOB_TOKEN] = job_token
        self.capture = capture
        self.identity = identity
        self.interval_s = interval_s
        self.transport = _transport()
        self._seen_ids: set[str] = set()
        self._warned: set[str] = set()
        self._failing_since: float | None = None
        self._said_failure = 0.0
        self._full_state = True  # the next message carries the whole state (first, asked, changed)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flare-opamp", daemon=True)
        verify, client_certificate, client_key = http_client.otlp_tls_from_env()
        self.client = opamp().OpAMPClient(
            endpoint=endpoint,
            headers=headers,
            agent_identifying_attributes={
                semconv.JOB_ID: identity.job_id, semconv.RANK: identity.rank,
                "service.name": identity.service_name},
            agent_non_identifying_attributes={
                semconv.HOST_NAME: identity.host_name, semconv.PROCESS_PID: identity.pid,
                semconv.LOCAL_RANK: identity.local_rank, semconv.WORLD_SIZE: identity.world_size,
                INTERVAL_ATTRIBUTE: interval_s},  # (the collector marks it gone after 3 missed polls)
            tls_certificate=verify, tls_client_certificate=client_certificate, tls_client_key=client_key,
            transport=self.transport,
        )
        self._report_effective()
        capture.on_finished = self._capture_finished

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the poller, then say the agent disconnects (the collector drops what it
        held for this rank): one request, within the client's 1 s timeout."""
        self.capture.on_finished = None
        self._stopping.set()
        self._wake.set()
        self.transport.close()  # ends a poll in flight at once
        self._thread.join(timeout=2.0)
        if self._failing_since is None:  # (a collector that is away is not waited for again)
            try:
                self.client.send(self.client.build_agent_disconnect_message())
            except Exception:  # it went away meanwhile: nothing to tell
                pass
        self.transport.close()

    # ------------------------------------------------------------ the poller (its own thread)
    def _run(self) -> None:
        """One thread, asleep between polls: the contrib OpAMPAgent keeps two (a worker
        that wakes every second even when idle, and a scheduler), retries a failed
        heartbeat at the same interval however long the collector stays away, and logs
        every failure with its payload. Here a failed poll backs off (doubling, up to
        MAX_BACKOFF_S, with jitter), and a collector that is away is said once."""
        failures = 0
        delay = 0.0
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stopping.is_set():
                return
            full, self._full_state = self._full_state, False
            message = self.client.build_full_state_message() if full else self.client.build_heartbeat_message()
            try:
                reply = self.client.send(message)
            except Exception as exc:  # refused, timed out, not 2xx: the collector is away
                if self._stopping.is_set():
                    return  # (stop() ended the request)
                self._full_state = self._full_state or full
                failures += 1
                self._on_connect_failed(exc)
                delay = min(MAX_BACKOFF_S, self.interval_s * 2 ** min(failures, 16)) * random.uniform(0.8, 1.2)
                continue
            failures = 0
            self._on_connect()
            self._on_reply(reply)
            delay = 0.0 if self._full_state else self.interval_s

    def _on_reply(self, reply) -> None:
        from flare.wire.sdk_adapter import opamp_protocol

        opamp_pb2 = opamp_protocol()
        if reply.HasField("error_response"):
            _log.warning("flare: rank %d: the collector's OpAMP endpoint answered an error: %s",
                         self.identity.rank, reply.error_response.error_message)
            return
        if reply.flags & opamp_pb2.ServerToAgentFlags_ReportFullState:
            self._full_state = True
        if reply.HasField("remote_config"):
            self._on_remote_config(reply.remote_config)

    # ------------------------------------------------------------ what the collector asks
    def _on_remote_config(self, remote) -> None:
        from flare.wire.sdk_adapter import opamp_protocol

        opamp_pb2 = opamp_protocol()
        status, error = opamp_pb2.RemoteConfigStatuses_APPLIED, ""
        try:
            for name, config in self.client.decode_remote_config(remote):
                if name != CONFIG_NAME:
                    self._warn_once(f"file {name!r}")
                    continue
                self._apply(config)
        except Exception as exc:  # a config this agent cannot read: FAILED, said to the server
            status, error = opamp_pb2.RemoteConfigStatuses_FAILED, str(exc)
            _log.warning("flare: rank %d: remote config not applied: %s", self.identity.rank, exc)
        self.client.update_remote_config_status(remote.config_hash, status, error)
        self._report_effective()
        self._full_state = True  # reported at once: the status (by hash) and the effective config

    def _apply(self, config) -> None:
        if not isinstance(config, dict):
            raise ValueError("the flare remote config is not a JSON object")
        for key, value in config.items():
            if key not in ("capture", "detail"):
                self._warn_once(f"key {key!r}")
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{key} is not a JSON object")
            request_id = str(value.get("id", ""))
            if request_id and request_id in self._seen_ids:
                continue  # re-sent before our status reached the server
            self._seen_ids.add(request_id)
            steps = int(value.get("steps", 0))
            if steps > 0:
                self.capture.start(steps, request_id or "opamp", stacks=key == "capture")
            else:
                self.capture.stop("the collector asked to stop")

    def _warn_once(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            _log.warning("flare: rank %d: the collector's remote config has an unknown %s; ignored",
                         self.identity.rank, what)

    def _on_connect(self) -> None:
        if self._failing_since is not None:
            _log.info("flare: rank %d: the collector's OpAMP endpoint answers again", self.identity.rank)
        self._failing_since = None

    def _on_connect_failed(self, error) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        stopped = self.capture.stop("the collector went away")
        if stopped or now - self._said_failure >= SAY_FAILURE_EVERY_S:
            self._said_failure = now
            _log.warning("flare: rank %d: the collector's OpAMP endpoint does not answer (%s); "
                         "retrying in the background%s", self.identity.rank, str(error)[:200],
                         "; the capture in progress is stopped" if stopped else "")

    # ------------------------------------------------------------ effective config
    def _report_effective(self) -> None:
        key = "capture" if self.capture.stacks else "detail"
        self.client.update_effective_config({CONFIG_NAME: {key: {"steps_left": self.capture.steps_left}}},
                                            "application/json")

    def _capture_finished(self) -> None:
        """From the training thread when a capture ends: the poller reports the state at
        once (an event set here; the request is the poller's)."""
        self._report_effective()
        self._full_state = True
        self._wake.set()


def _transport():
    """The OpAMP client's transport on Flare's HTTP client (one kept-alive connection)."""

    from flare.wire.sdk_adapter import opamp

    client = opamp()
    messages, OpAMPException = client.messages, client.OpAMPException

    class FlareTransport(client.HttpTransport):
        def __init__(self) -> None:
            self._client: http_client.HttpClient | None = None

        def send(self, *, url, headers, data, timeout_millis, tls_certificate,
                 tls_client_certificate=None, tls_client_key=None):
            if self._client is None:
                context = None
                if url.startswith("https:"):
                    context = http_client.tls_context(
                        tls_certificate if isinstance(tls_certificate, (str, bool)) else True,
                        tls_client_certificate, tls_client_key)
                self._client = http_client.HttpClient(url, timeout_millis / 1e3, context)
            client = self._client
            try:
                reply = client.request("POST", client.prefix or "/", body=data, headers=headers,
                                       timeout_s=timeout_millis / 1e3)
            except http_client.TransportError as exc:
                raise OpAMPException(f"{exc.kind}: {exc.reason}") from None
            if not 200 <= reply.status < 300:
                raise OpAMPException(f"HTTP {reply.status} {reply.reason}")
            return messages.decode_message(reply.body)

        def close(self) -> None:
            if self._client is not None:
                self._client.close()

    return FlareTransport()
