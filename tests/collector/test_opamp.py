"""The collector's OpAMP endpoint, against a real collector process and the contrib
OpAMP client (`opentelemetry-opamp-client`) as the agent: registration by job and rank,
a capture request delivered and acknowledged, the token that guards it, the protocol's
error answer to a malformed body, and an agent that goes away."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request

import pytest
from opentelemetry._opamp.client import OpAMPClient
from opentelemetry._opamp.proto import opamp_pb2

TOKEN = "s3cret-token-for-opamp"
KEY = {"X-Flare-Agent-Key": "an-agent-key-of-24-chars"}


def _client(collector, rank: int, job: str = "job-a", token: str | None = TOKEN,
            headers: dict[str, str] | None = None) -> OpAMPClient:
    return OpAMPClient(
        endpoint=f"http://{collector.http}/v1/opamp",
        headers={**({"Authorization": f"Bearer {token}"} if token else {}),
                 "X-Flare-Agent-Key": secrets.token_urlsafe(24), **(headers or {})},
        agent_identifying_attributes={"flare.job.id": job, "flare.rank": rank},
        timeout_millis=5000,
    )


def _capture(collector, body: dict, token: str = TOKEN) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        f"http://{collector.http}/flare/v1/capture", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _agents(collector, token: str = TOKEN) -> list[dict]:
    request = urllib.request.Request(f"http://{collector.http}/flare/v1/agents",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["agents"]


@pytest.fixture
def collector(collector_process, tmp_path, helpers):
    config = helpers.base_config(tmp_path / "store.duckdb")
    config["receivers"]["otlp"]["protocols"]["http"]["auth"] = {"bearer_token": TOKEN}
    return collector_process(config).start()


def test_a_capture_request_reaches_the_asked_ranks_only_and_is_acknowledged(collector):
    clients = {rank: _client(collector, rank) for rank in range(3)}
    for client in clients.values():
        reply = client.send(client.build_full_state_message())
        assert not reply.HasField("error_response") and not reply.HasField("remote_config")
    assert [(a["job"], a["rank"], a["state"]) for a in _agents(collector)] == \
        [("job-a", 0, "alive"), ("job-a", 1, "alive"), ("job-a", 2, "alive")]

    status, result = _capture(collector, {"job": "job-a", "ranks": [1, 2, 7], "steps": 5})
    assert status == 200 and result["asked"] == [1, 2] and result["unknown"] == [7], result
    # the next poll of an asked rank carries the config; a rank not asked gets nothing
    assert not clients[0].send(clients[0].build_heartbeat_message()).HasField("remote_config")
    reply = clients[1].send(clients[1].build_heartbeat_message())
    assert reply.HasField("remote_config")
    files = dict(clients[1].decode_remote_config(reply.remote_config))
    assert files["flare"]["capture"]["steps"] == 5
    # until the agent says it applied it (by its hash), every poll repeats it
    assert clients[1].send(clients[1].build_heartbeat_message()).HasField("remote_config")
    applied = clients[1].update_remote_config_status(
        reply.remote_config.config_hash, opamp_pb2.RemoteConfigStatuses_APPLIED)
    clients[1].send(clients[1].build_remote_config_status_response_message(applied))
    assert not clients[1].send(clients[1].build_heartbeat_message()).HasField("remote_config")
    rows = {a["rank"]: a for a in _agents(collector)}
    assert rows[1]["remote_config_status"] == "APPLIED" and not rows[1]["pending"]
    assert rows[2]["pending"]


def test_without_the_token_opamp_is_refused_counted_and_changes_nothing(collector):
    stranger = _client(collector, 0, token="wrong")
    refused = collector.scrape().get("flare_collector_unauthenticated_requests_total", 0)
    try:
        stranger.send(stranger.build_full_state_message())
        raise AssertionError("an OpAMP request with a wrong token was answered")
    except Exception as exc:  # the client's OpAMPException carrying the 401
        assert "401" in str(exc)
    status, _ = _capture(collector, {"job": "job-a", "ranks": [0]}, token="wrong")
    assert status == 401
    assert collector.scrape()["flare_collector_unauthenticated_requests_total"] == refused + 2
    assert _agents(collector) == []


def test_a_malformed_opamp_body_gets_the_protocols_error_answer(collector, helpers):
    status, _, body = helpers.post(f"http://{collector.http}/v1/opamp", b"\xff\xff\xff\x0f garbage",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 400
    reply = opamp_pb2.ServerToAgent.FromString(body)
    assert reply.error_response.type == opamp_pb2.ServerErrorResponseType_BadRequest
    assert "AgentToServer" in reply.error_response.error_message
    status, _, body = helpers.post(f"http://{collector.http}/v1/opamp",
                                   opamp_pb2.AgentToServer(instance_uid=b"short").SerializeToString(),
                                   headers={"Authorization": f"Bearer {TOKEN}", "X-Flare-Agent-Key": "k" * 20})
    assert status == 400 and b"16 bytes" in body
    assert collector.scrape()["flare_collector_opamp_malformed_total"] == 2
    # a bad capture request is one line, not a 500
    status, text = _capture(collector, {"job": "job-a"})
    assert status == 400 and "ranks" in text
    assert collector.proc.poll() is None


def test_an_agent_that_disconnects_is_gone_and_its_request_dropped(collector):
    client = _client(collector, 3)
    client.send(client.build_full_state_message())
    assert _capture(collector, {"ranks": [3], "steps": 2})[1]["asked"] == [3]  # the only job
    client.send(client.build_agent_disconnect_message())
    rows = _agents(collector)
    assert rows[0]["state"] == "gone" and not rows[0]["pending"]
    assert collector.scrape()["flare_collector_opamp_requests_dropped_total"] == 1
    _status, result = _capture(collector, {"job": "job-a", "ranks": [3]})
    assert result["unknown"] == [3]
    # heard from again (a restart of the server or the agent): alive, nothing pending
    client.send(client.build_heartbeat_message())
    time.sleep(0.1)
    assert _agents(collector)[0]["state"] == "alive"


def test_a_capture_without_a_job_names_what_is_missing():
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters())
    with pytest.raises(ValueError) as none:
        server.request_capture(None, [1], 5)
    assert str(none.value) == ("no job has live agents: no rank of a running job is connected "
                               "to this collector's control channel")
    for job in ("job-x", "job-y"):
        message = opamp_pb2.AgentToServer(instance_uid=bytes(range(16)) if job == "job-x" else bytes(16))
        attr = message.agent_description.identifying_attributes
        attr.add(key="flare.job.id").value.string_value = job
        attr.add(key="flare.rank").value.int_value = 0
        assert server.handle(message.SerializeToString(), KEY)[0] == 200
    with pytest.raises(ValueError) as two:
        server.request_capture(None, [0], 5)
    assert str(two.value) == "2 jobs have live agents (job-x, job-y); name one with --job"


def test_an_agent_not_heard_from_is_marked_gone_and_its_request_dropped():
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters(), gone_after_s=0.3)
    message = opamp_pb2.AgentToServer(instance_uid=bytes(range(16)))
    attr = message.agent_description.identifying_attributes
    attr.add(key="flare.job.id").value.string_value = "job-b"
    attr.add(key="flare.rank").value.int_value = 5
    assert server.handle(message.SerializeToString(), KEY)[0] == 200
    assert server.request_capture("job-b", [5], 20)["asked"] == [5]
    time.sleep(0.5)
    assert [(a["rank"], a["state"], a["pending"]) for a in server.agents()] == [(5, "gone", False)]
    assert server.counters.get("opamp_requests_dropped") == 1
    assert server.gauges() == [("opamp_agents", {"flare_job": "job-b", "state": "gone"}, 1.0)]


def test_an_agent_that_polls_slowly_is_not_marked_gone_between_its_polls():
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters(), gone_after_s=0.3)
    for uid, interval in ((1, 10.0), (2, None)):  # says it polls every 10 s / says nothing
        message = opamp_pb2.AgentToServer(instance_uid=bytes([uid]) * 16)
        description = message.agent_description
        description.identifying_attributes.add(key="flare.job.id").value.string_value = "job-c"
        description.identifying_attributes.add(key="flare.rank").value.int_value = uid
        if interval is not None:
            description.non_identifying_attributes.add(key="flare.opamp.interval_s").value.double_value = interval
        server.handle(message.SerializeToString(), KEY)
    server.request_capture("job-c", [1, 2], 20)
    time.sleep(0.5)
    rows = {a["rank"]: a for a in server.agents()}
    assert rows[1]["state"] == "alive" and rows[1]["pending"]  # 3 × 10 s not yet past
    assert rows[2]["state"] == "gone" and not rows[2]["pending"]


# ---------------------------------------------------------------- who is who
OPERATOR = "operator-token-0123456789"
JOB_SECRET = "job-secret-0123456789abcdef"


def _job_token(job: str) -> str:
    from flare.collector.opamp import job_token

    return job_token(JOB_SECRET.encode(), job)


def _get(url: str, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _refused(collector, cause: str) -> float:
    with urllib.request.urlopen(collector.metrics, timeout=10) as response:
        text = response.read().decode()
    line = f'flare_collector_opamp_refused_total{{cause="{cause}"}} '
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_a_second_agent_cannot_take_a_live_ranks_identity(collector):
    real = _client(collector, 2)
    assert not real.send(real.build_full_state_message()).HasField("error_response")
    spoof = _client(collector, 2)  # the shared token, a uid of its own, the same job and rank
    with pytest.raises(Exception, match="409"):
        spoof.send(spoof.build_full_state_message())
    assert _refused(collector, "identity_taken") == 1
    assert _capture(collector, {"job": "job-a", "ranks": [2], "steps": 3})[1]["asked"] == [2]
    assert real.send(real.build_heartbeat_message()).HasField("remote_config")  # the real rank has it
    with pytest.raises(Exception, match="409"):
        spoof.send(spoof.build_full_state_message())
    # once the real rank is gone (a restart), the rank can be registered again
    real.send(real.build_agent_disconnect_message())
    assert not spoof.send(spoof.build_full_state_message()).HasField("error_response")


def test_messages_under_another_agents_uid_change_nothing(collector, helpers):
    victim = _client(collector, 1)
    victim.send(victim.build_full_state_message())
    assert _capture(collector, {"job": "job-a", "ranks": [1], "steps": 3})[1]["asked"] == [1]
    reply = victim.send(victim.build_heartbeat_message())
    # the attacker knows the uid (and even the config's hash) but not the agent's key
    forged = [
        opamp_pb2.AgentToServer(instance_uid=victim._instance_uid,
                                agent_disconnect=opamp_pb2.AgentDisconnect()),
        opamp_pb2.AgentToServer(instance_uid=victim._instance_uid, remote_config_status=opamp_pb2.RemoteConfigStatus(
            last_remote_config_hash=reply.remote_config.config_hash,
            status=opamp_pb2.RemoteConfigStatuses_APPLIED)),
        opamp_pb2.AgentToServer(instance_uid=victim._instance_uid),  # a poll to read its request
    ]
    for message in forged:
        for key in ({"X-Flare-Agent-Key": "another-key-of-24-chars!"}, {}):
            status, _, body = helpers.post(f"http://{collector.http}/v1/opamp", message.SerializeToString(),
                                           headers={"Authorization": f"Bearer {TOKEN}", **key})
            assert status in (401, 403), status
            assert not opamp_pb2.ServerToAgent.FromString(body).HasField("remote_config")
    assert _refused(collector, "agent_key") == 3 and _refused(collector, "no_agent_key") == 3
    row = _agents(collector)[0]
    assert row["state"] == "alive" and row["pending"]  # still the victim's, still pending
    assert victim.send(victim.build_heartbeat_message()).HasField("remote_config")


def test_an_agent_cannot_change_the_rank_it_registered_as():
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters())
    for rank, expected in ((4, 200), (5, 403)):
        message = opamp_pb2.AgentToServer(instance_uid=b"u" * 16)
        attrs = message.agent_description.identifying_attributes
        attrs.add(key="flare.job.id").value.string_value = "job-d"
        attrs.add(key="flare.rank").value.int_value = rank
        assert server.handle(message.SerializeToString(), KEY)[0] == expected
    assert [a["rank"] for a in server.agents()] == [4]
    assert server.counters.get("opamp_refused", cause="identity_changed") == 1


@pytest.fixture
def scoped_collector(collector_process, tmp_path, helpers):
    config = helpers.base_config(tmp_path / "store.duckdb")
    config["receivers"]["otlp"]["protocols"]["http"]["auth"] = {"bearer_token": TOKEN}
    config["extensions"]["flare_opamp"] = {"operator_token": OPERATOR, "job_secret": JOB_SECRET}
    config["service"]["extensions"].append("flare_opamp")
    return collector_process(config).start()


def test_with_a_job_secret_only_the_jobs_ranks_register_and_control_is_scoped(scoped_collector):
    collector = scoped_collector
    for headers in ({}, {"X-Flare-Job-Token": _job_token("job-b")}):  # none, another job's
        stranger = _client(collector, 0, headers=headers)
        with pytest.raises(Exception, match="403"):
            stranger.send(stranger.build_full_state_message())
    assert _refused(collector, "job_token") == 2
    ranks = {r: _client(collector, r, headers={"X-Flare-Job-Token": _job_token("job-a")}) for r in (0, 1)}
    for client in ranks.values():
        assert not client.send(client.build_full_state_message()).HasField("error_response")

    def capture(job, headers):
        request = urllib.request.Request(
            f"http://{collector.http}/flare/v1/capture", method="POST",
            data=json.dumps({"job": job, "ranks": [0]}).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as err:
            return err.code

    assert capture("job-a", {}) == 403  # the ingest token alone asks nothing
    assert capture("job-a", {"X-Flare-Job-Token": _job_token("job-b")}) == 403
    assert capture(None, {"X-Flare-Job-Token": _job_token("job-a")}) == 403  # "every job"
    assert capture("job-a", {"X-Flare-Job-Token": _job_token("job-a")}) == 200
    assert capture("job-a", {"X-Flare-Operator-Token": OPERATOR}) == 200
    assert _refused(collector, "control_scope") == 3

    url = f"http://{collector.http}/flare/v1/agents"
    assert _get(url, {})[0] == 403
    assert _get(url + "?job=job-a", {"X-Flare-Job-Token": _job_token("job-b")})[0] == 403
    status, body = _get(url + "?job=job-a", {"X-Flare-Job-Token": _job_token("job-a")})
    assert status == 200 and [a["rank"] for a in json.loads(body)["agents"]] == [0, 1]
    assert "instance_uid" not in body  # uids are for operators only
    status, body = _get(url, {"X-Flare-Operator-Token": OPERATOR})
    rows = json.loads(body)["agents"]
    assert status == 200 and {r["instance_uid"] for r in rows} == {c._instance_uid.hex() for c in ranks.values()}


def test_without_an_operator_the_listing_has_no_uids(collector):
    client = _client(collector, 0)
    client.send(client.build_full_state_message())
    assert _agents(collector) and "instance_uid" not in _agents(collector)[0]


# ---------------------------------------------------------------- bounded state
def _describe(uid: bytes, job: str, rank: int, host: str = "h") -> bytes:
    message = opamp_pb2.AgentToServer(instance_uid=uid)
    description = message.agent_description
    description.identifying_attributes.add(key="flare.job.id").value.string_value = job
    description.identifying_attributes.add(key="flare.rank").value.int_value = rank
    description.non_identifying_attributes.add(key="host.name").value.string_value = host
    return message.SerializeToString()


def test_oversized_fields_are_refused_and_nothing_is_kept(collector, helpers):
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters())
    assert server.handle(_describe(b"a" * 16, "job-e", 0, host="h" * 1000), KEY)[0] == 400
    assert server.handle(_describe(b"b" * 16, "j" * 1000, 0), KEY)[0] == 400
    big = opamp_pb2.AgentToServer(instance_uid=b"c" * 16)
    big.effective_config.config_map.config_map["flare"].body = b'{"x": "' + b"y" * 8000 + b'"}'
    assert server.handle(big.SerializeToString(), KEY)[0] == 400
    assert server.agents() == [] and server.counters.get("opamp_refused", cause="oversized_field") == 3
    # over HTTP, a message over 64 KiB is refused, its body dropped unparsed
    status, _, _ = helpers.post(f"http://{collector.http}/v1/opamp",
                                _describe(b"d" * 16, "job-e", 0, host="h" * (512 << 10)),
                                headers={"Authorization": f"Bearer {TOKEN}", **KEY})
    assert status == 413 and _agents(collector) == []


def test_gone_agents_are_forgotten_with_their_jobs_series_and_the_agent_count_is_capped():
    from flare.collector.config import OpampConfig
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters(), gone_after_s=0.2, policy=OpampConfig(max_agents=50, forget_after_s=0.3))
    for i in range(50):
        assert server.handle(_describe(i.to_bytes(16, "big"), "job-f", i), KEY)[0] == 200
    status, _ = server.handle(_describe((99).to_bytes(16, "big"), "job-g", 0), KEY)
    assert status == 503 and server.counters.get("opamp_refused", cause="agent_cap") == 1
    time.sleep(0.3)  # all gone now: a newcomer makes room by forgetting the oldest gone
    assert server.handle(_describe((99).to_bytes(16, "big"), "job-g", 0), KEY)[0] == 200
    assert len(server.agents()) == 50
    time.sleep(0.4)  # job-f's agents went 0.3 s ago or more: forgotten, and its series with them
    jobs = {labels["flare_job"] for _, labels, _ in server.gauges()}
    assert jobs == {"job-g"}, jobs
    assert server.counters.get("opamp_forgotten") == 50


def test_flare_job_token_admits_the_jobs_ranks_to_a_collector_with_that_secret(scoped_collector, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    secret = tmp_path / "job_secret"
    secret.write_text(JOB_SECRET + "\n")
    flare = str(Path(sys.executable).parent / "flare")
    done = subprocess.run([flare, "job-token", "job-z", "--secret-file", str(secret)],
                          capture_output=True, text=True, timeout=60)
    token = done.stdout.strip()
    assert done.returncode == 0 and token == _job_token("job-z")
    client = _client(scoped_collector, 0, job="job-z", headers={"X-Flare-Job-Token": token})
    assert not client.send(client.build_full_state_message()).HasField("error_response")
    missing = subprocess.run([flare, "job-token", "job-z", "--secret-file", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("body", [
    b'{"ranks": [2], "steps": Infinity}', b'{"ranks": [1e400]}', b"[" * 60_000,
    b'{"job": ["a"], "ranks": [0]}', b'{"ranks": [true]}', b'{"ranks": [0], "steps": 2.5}',
    b'{"ranks": [-1]}', b'{"ranks": [0], "stacks": "no"}', b'{"ranks": [0], "colour": 1}', b"\xff",
])
def test_a_hostile_capture_request_is_one_line_400_and_asks_nothing(collector, body):
    client = _client(collector, 0)
    client.send(client.build_full_state_message())
    request = urllib.request.Request(
        f"http://{collector.http}/flare/v1/capture", data=body, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    text = err.value.read().decode()
    assert err.value.code == 400 and text.startswith("capture request refused: ") and text.count("\n") == 1
    assert not client.send(client.build_heartbeat_message()).HasField("remote_config")
    assert collector.scrape().get("flare_collector_internal_errors_total", 0) == 0


def test_a_capture_body_over_64_kib_is_refused_with_a_413(collector, helpers):
    status, _, body = helpers.post(f"http://{collector.http}/flare/v1/capture", b"[" * 100_000,
                                   content_type="application/json",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 413 and body.decode().count("\n") <= 1


def test_flare_capture_sends_the_job_token_and_says_why_it_is_refused(scoped_collector):
    import os
    import subprocess
    import sys
    from pathlib import Path

    client = _client(scoped_collector, 0, headers={"X-Flare-Job-Token": _job_token("job-a")})
    client.send(client.build_full_state_message())
    flare = str(Path(sys.executable).parent / "flare")
    command = [flare, "capture", "--collector", f"http://{scoped_collector.http}", "--job", "job-a", "--ranks", "0"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60,
                             env={**base, "FLARE_BACKEND_TOKEN": TOKEN})
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "HTTP 403" in refused.stderr and "X-Flare-Job-Token" in refused.stderr
    asked = subprocess.run(command, capture_output=True, text=True, timeout=60,
                           env={**base, "FLARE_BACKEND_TOKEN": TOKEN, "FLARE_JOB_TOKEN": _job_token("job-a")})
    assert asked.returncode == 0 and "asked job job-a ranks 0" in asked.stdout, asked.stderr
    assert client.send(client.build_heartbeat_message()).HasField("remote_config")


def test_an_agent_back_after_it_was_gone_does_not_share_its_rank_with_its_successor():
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters(), gone_after_s=0.2)
    old, new = KEY, {"X-Flare-Agent-Key": "the-restarted-ranks-key"}
    assert server.handle(_describe(b"o" * 16, "job-h", 1), old)[0] == 200
    time.sleep(0.3)  # gone; the rank restarts under a new uid and takes its rank
    assert server.handle(_describe(b"n" * 16, "job-h", 1), new)[0] == 200
    heartbeat = opamp_pb2.AgentToServer(instance_uid=b"o" * 16).SerializeToString()
    assert server.handle(heartbeat, old)[0] == 409
    assert server.request_capture("job-h", [1], 5)["asked"] == [1]
    assert sorted((a["state"], a["pending"]) for a in server.agents()) == [("alive", True), ("gone", False)]
