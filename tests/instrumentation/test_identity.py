"""Job id chain, the c10d-store agreement, and the `flare` resource detector."""

from __future__ import annotations

import os
import re
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from opentelemetry.sdk.resources import Resource

from flare.instrumentation import identity
from flare.instrumentation.resource import FlareResourceDetector
from flare.wire import semconv


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("FLARE_", "TORCHELASTIC", "SLURM", "MASTER_", "OTEL_")) or key in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK"):
            monkeypatch.delenv(key)
    identity.current_identity.cache_clear()
    yield monkeypatch
    identity.current_identity.cache_clear()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_job_id_chain(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "4242")
    assert identity.resolve_job_id() == "4242"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's placeholder: skipped
    assert identity.resolve_job_id() == "4242"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "0b0e4a9c-3d2f-4b1e-9c1a-2f3e4d5c6b7a")  # --standalone's
    assert identity.resolve_job_id() == "4242"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert identity.resolve_job_id() == "run-7"
    clean_env.setenv("FLARE_JOB_ID", "explicit")
    assert identity.resolve_job_id() == "explicit"


def test_ranks_agree_on_a_job_id_through_the_c10d_store(clean_env):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    results = []
    threads = [threading.Thread(target=lambda: results.append(identity.resolve_job_id()))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert server.get(identity.STORE_KEY_JOB_ID).decode() == results[0]


def test_with_nothing_set_the_job_is_named_by_its_script_and_start_and_is_the_service(clean_env):
    job = identity.resolve_job_id()
    assert re.fullmatch(rf"{re.escape(identity.script_name())}-\d{{8}}-\d{{6}}-[0-9a-f]{{4}}", job), job
    assert identity.job_id_source() == "derived"
    identity.current_identity.cache_clear()
    clean_env.setenv("FLARE_JOB_ID", "named")
    assert identity.current_identity().service_name == "named"  # no OTEL_SERVICE_NAME: the job
    identity.current_identity.cache_clear()
    clean_env.setenv("OTEL_SERVICE_NAME", "trainer")
    assert identity.current_identity().service_name == "trainer"
    identity.current_identity.cache_clear()


def test_job_id_without_a_store_is_still_shared(clean_env, caplog):
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))  # nobody listens
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setattr(identity, "STORE_TIMEOUT_S", 0.5)
    first = identity.resolve_job_id()
    assert first == identity.resolve_job_id() and first.startswith(f"{identity.script_name()}-")
    assert any("c10d store" in r.getMessage() for r in caplog.records)


def test_detector_describes_the_rank(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("GROUP_RANK", "1")
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    clean_env.setenv("FLARE_JOB_ID", "job-x")
    clean_env.setenv("OTEL_SERVICE_NAME", "trainer")
    attributes = FlareResourceDetector().detect().attributes
    assert attributes[semconv.RANK] == 3
    assert attributes[semconv.LOCAL_RANK] == 1
    assert attributes[semconv.WORLD_SIZE] == 4
    assert attributes[semconv.NODE_RANK] == 1
    assert attributes[semconv.RESTART_COUNT] == 2
    assert attributes[semconv.JOB_ID] == "job-x"
    assert attributes[semconv.SERVICE_NAME] == "trainer"
    assert attributes[semconv.PROCESS_PID] == os.getpid()
    assert attributes[semconv.HOST_NAME] == socket.gethostname()


def test_detector_is_empty_outside_a_rank(clean_env):
    assert FlareResourceDetector().detect().attributes == {}


def test_sdk_runs_the_detector_from_its_entry_point(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("FLARE_JOB_ID", "job-y")
    clean_env.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "otel,flare")
    resource = Resource.create()
    assert resource.attributes[semconv.RANK] == 2
    assert resource.attributes[semconv.JOB_ID] == "job-y"
    # without the opt-in the SDK does not run it (the instrumentor then puts the rank
    # on its spans; see test_instrumentor)
    clean_env.delenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS")
    identity.current_identity.cache_clear()
    assert semconv.RANK not in Resource.create().attributes


@pytest.mark.parametrize(("argv", "launcher"), [
    (["/venv/bin/torchrun", "--nproc_per_node", "4", "train.py"], True),
    (["/venv/bin/python3", "-m", "torch.distributed.run", "train.py"], True),
    (["python", "-m", "torch.distributed.launch", "train.py"], True),
    (["/usr/bin/deepspeed", "train.py"], True),
    # the per-node agent DeepSpeed's runner starts (it has no RANK; its children do)
    (["/venv/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "train.py"], True),
    (["/venv/bin/python", "train.py"], False),
    (["python", "-m", "mypackage.train"], False),
])
def test_launchers_are_told_from_training_scripts(argv, launcher):
    assert identity.is_launcher(argv) is launcher


def test_a_process_flare_run_started_without_rank_is_a_single_process_job(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(identity, "is_launcher", lambda argv=None: False)
    monkeypatch.setenv("FLARE_RUN_PID", str(os.getppid()))
    assert identity.in_training_rank()
    monkeypatch.setenv("FLARE_RUN_PID", str(os.getppid() + 1))  # a grandchild: a worker
    assert not identity.in_training_rank()
    monkeypatch.setenv("FLARE_RUN_PID", str(os.getppid()))
    monkeypatch.setattr(identity, "is_launcher", lambda argv=None: True)  # torchrun itself
    assert not identity.in_training_rank()


def test_a_rank_that_rank_zero_started_is_its_local_rank_on_node_zero(clean_env, caplog):
    # what Lightning's own launcher gives the processes it starts (no RANK)
    clean_env.setenv("LOCAL_RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    clean_env.setenv("NODE_RANK", "0")
    clean_env.setenv("FLARE_JOB_ID", "lightning-job")
    assert identity.in_training_rank()
    me = identity.current_identity()
    assert (me.rank, me.local_rank, me.world_size) == (2, 2, 4)
    clean_env.setenv("WORLD_SIZE", "1")  # LOCAL_RANK alone (a one-process tool) is no rank
    assert not identity.in_training_rank()
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("NODE_RANK", "1")  # ranks per node unknown: refused, in one line
    assert not identity.in_training_rank()
    assert "the global rank cannot be told" in caplog.text


def test_a_rank_started_by_a_rank_of_another_local_rank_is_no_helper(monkeypatch):
    from flare.instrumentation import torch_training

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(semconv.ENV_RANK_PID, f"{os.getpid() + 1}:0")  # a DataLoader worker
    assert torch_training._is_helper_of_a_rank()
    monkeypatch.setenv("LOCAL_RANK", "3")  # rank 0 started this process as local rank 3
    assert not torch_training._is_helper_of_a_rank()
    monkeypatch.setenv(semconv.ENV_RANK_PID, torch_training._rank_marker())  # its own marker
    assert not torch_training._is_helper_of_a_rank()


def test_a_process_given_a_rank_of_its_own_is_no_helper(monkeypatch):
    """The marker carries its rank's RANK: a spawned worker inherits it unchanged (a
    helper); a process its parent gave a RANK of its own is a rank (a launcher Flare does
    not know, under flare run, took itself for a job of one process: RANK unset)."""
    from flare.instrumentation import torch_training

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv(semconv.ENV_RANK_PID, f"{os.getpid() + 1}:0:4")  # its rank's worker
    assert torch_training._is_helper_of_a_rank()
    monkeypatch.setenv(semconv.ENV_RANK_PID, f"{os.getpid() + 1}:0:")  # a launcher's rank
    assert not torch_training._is_helper_of_a_rank()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv(semconv.ENV_RANK_PID, f"{os.getpid() + 1}:0:")  # a job of one's worker
    assert torch_training._is_helper_of_a_rank()


def test_the_one_process_a_launcher_under_flare_run_started_is_the_job(monkeypatch):
    # `flare run -- accelerate launch train.py` on one CPU: the script is accelerate's
    # child, without RANK
    read_proc = identity._parent_of
    assert read_proc(os.getpid())[0] == os.getppid()  # read from /proc
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(identity, "is_launcher", lambda argv=None: bool(argv) and "accelerate" in argv[0])
    monkeypatch.setenv("FLARE_RUN_PID", "4242")
    monkeypatch.setattr(identity, "_parent_of", lambda pid: (4242, ["/venv/bin/accelerate", "launch"]))
    assert identity.single_process_job()
    monkeypatch.setattr(identity, "_parent_of", lambda pid: (4242, ["python", "train.py"]))
    assert not identity.single_process_job()  # a DataLoader worker of the job's process
    monkeypatch.setattr(identity, "_parent_of", lambda pid: (7, ["/venv/bin/accelerate", "launch"]))
    assert not identity.single_process_job()  # another flare run's launcher
