"""The collector's OpAMP endpoint, against a real collector process and the contrib
OpAMP client (`opentelemetry-opamp-client`) as the agent: registration by job and rank,
a capture request delivered and acknowledged, the token that guards it, the protocol's
error answer to a malformed body, and an agent that goes away."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from opentelemetry._opamp.client import OpAMPClient
from opentelemetry._opamp.proto import opamp_pb2

TOKEN = "s3cret-token-for-opamp"


def _client(collector, rank: int, job: str = "job-a", token: str | None = TOKEN) -> OpAMPClient:
    return OpAMPClient(
        endpoint=f"http://{collector.http}/v1/opamp",
        headers={"Authorization": f"Bearer {token}"} if token else {},
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
                                   headers={"Authorization": f"Bearer {TOKEN}"})
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


def test_an_agent_not_heard_from_is_marked_gone_and_its_request_dropped():
    from flare.collector.opamp import OpampServer
    from flare.collector.telemetry import Counters

    server = OpampServer(Counters(), gone_after_s=0.3)
    message = opamp_pb2.AgentToServer(instance_uid=bytes(range(16)))
    attr = message.agent_description.identifying_attributes
    attr.add(key="flare.job.id").value.string_value = "job-b"
    attr.add(key="flare.rank").value.int_value = 5
    assert server.handle(message.SerializeToString())[0] == 200
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
        server.handle(message.SerializeToString())
    server.request_capture("job-c", [1, 2], 20)
    time.sleep(0.5)
    rows = {a["rank"]: a for a in server.agents()}
    assert rows[1]["state"] == "alive" and rows[1]["pending"]  # 3 × 10 s not yet past
    assert rows[2]["state"] == "gone" and not rows[2]["pending"]
