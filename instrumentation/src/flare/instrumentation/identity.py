"""Who this process is: rank, job and host, resolved once per process.

Shared by the resource detector (which the SDK runs only when it is listed in
`OTEL_EXPERIMENTAL_RESOURCE_DETECTORS`) and by the instrumentor (which falls back to
putting the same attributes on its own spans when the resource lacks them).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from flare.wire import semconv

_log = logging.getLogger(__name__)

STORE_KEY_JOB_ID = "flare/job_id"
STORE_TIMEOUT_S = 5.0


def _int_env(name: str, default: int = 0) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# Python launchers of ranks (`torchrun`, `python -m torch.distributed.run`, DeepSpeed,
# Accelerate): never a training process themselves.
# (DeepSpeed's runner, `deepspeed`, starts `python -u -m deepspeed.launcher.launch` on each
# node, which starts the ranks with RANK)
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "deepspeed",
             "deepspeed.launcher.runner", "deepspeed.launcher.launch", "accelerate",
             "accelerate-launch")


def is_launcher(argv: list[str] | None = None) -> bool:
    argv = list(getattr(sys, "orig_argv", None) or sys.argv) if argv is None else argv
    for index, arg in enumerate(argv[:4]):
        name = os.path.basename(arg)
        if name in LAUNCHERS:
            return True
        if arg == "-m" and index + 1 < len(argv) and argv[index + 1] in LAUNCHERS:
            return True
    return False


def _parent_of(pid: int) -> tuple[int, list[str]] | None:
    """`pid`'s parent pid and command line, from /proc (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
        return int(stat.rsplit(")", 1)[1].split()[1]), argv
    except (OSError, ValueError, IndexError):
        return None


def single_process_job() -> bool:
    """A process `flare run` started itself (its parent is `flare run`), or that a
    launcher `flare run` started ran as its one process (`accelerate launch` on one
    CPU runs the script as a child without RANK), with no RANK and not a launcher: a
    job of one process, rank 0 of a world of 1. Its own children (DataLoader workers)
    and a launcher's ranks have other parents, or RANK."""
    run_pid = os.environ.get(semconv.ENV_RUN_PID, "").strip()
    if not run_pid.isdigit() or os.environ.get("RANK", "").strip() or is_launcher():
        return False
    parent = os.getppid()
    if int(run_pid) == parent:
        return True
    above = _parent_of(parent)
    return above is not None and above[0] == int(run_pid) and is_launcher(above[1])


def started_by_its_rank_zero() -> bool:
    """A rank that rank 0 started itself, as Lightning does when a script asks for
    several devices (`python train.py` with `devices=4`): rank 0 runs the script again
    with LOCAL_RANK 1.., WORLD_SIZE, NODE_RANK and MASTER_ADDR, and no RANK. On node 0
    its global rank is its local rank; on another node it cannot be told from the
    environment (the ranks per node are not in it), and the process says so once."""
    if os.environ.get("RANK", "").strip():
        return False
    local, world = os.environ.get("LOCAL_RANK", "").strip(), os.environ.get("WORLD_SIZE", "").strip()
    if not (local.isdigit() and world.isdigit() and int(world) > 1
            and os.environ.get("MASTER_ADDR", "").strip()):
        return False
    node = os.environ.get("NODE_RANK", "0").strip() or "0"
    if node != "0":
        _rank_unknown(local, node)
        return False
    return True


@functools.cache
def _rank_unknown(local: str, node: str) -> None:
    """Said once per process (the detector and the instrumentor both ask)."""
    _log.warning("flare: LOCAL_RANK %s on node %s without RANK: the global rank cannot be "
                 "told from the environment; this process is not instrumented (a launcher "
                 "that sets RANK, such as torchrun or Slurm, is)", local, node)


def in_training_rank() -> bool:
    """True in a rank process started by torchrun or another launcher (RANK is set), in
    a rank its rank 0 started (`started_by_its_rank_zero`), or in a single-process job
    under `flare run`; False in the torchrun agent and other helper processes."""
    return (os.environ.get("RANK", "").strip().isdigit() or started_by_its_rank_zero()
            or single_process_job())


def script_name() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    name = os.path.basename(argv0)
    return name[:-3] if name.endswith(".py") else name


def readable_job_id(now: float | None = None) -> str:
    """`<script>-<UTC start time>-<4 hex>`, e.g. `train-20261201-221530-3f2a`: what a
    user who set nothing recognises in every backend's job list."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in script_name()) or "job"
    return f"{name}-{stamp}-{os.urandom(2).hex()}"  # two jobs started in one second differ


def _job_id_from_store() -> str | None:
    """Agree on a job id through the launcher's c10d TCPStore: every rank offers its
    readable candidate (script and start time) with compare_set and all of them read
    back the first one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        from torch.distributed import TCPStore

        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S))
        winner = store.compare_set(STORE_KEY_JOB_ID, "", readable_job_id())
        return winner.decode() if isinstance(winner, bytes) else str(winner)
    except Exception as error:  # no store, wrong port, no torch: fall back
        _log.warning("flare: could not agree on a job id through the c10d store "
                     "at %s:%s (%s); deriving one from the rendezvous address",
                     host, port, error.__class__.__name__)
        return None


def _job_id_from_rendezvous() -> str:
    """Same on every rank of a launch without any communication (last resort)."""
    key = "|".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
    return f"{script_name()}-" + hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


_GENERATED_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def job_id_source() -> str:
    """Where the job id comes from: "FLARE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
    or "derived" (no setting: the readable default agreed through the launcher)."""
    if os.environ.get(semconv.ENV_JOB_ID, "").strip():
        return semconv.ENV_JOB_ID
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    # torchrun's own "none", and the UUID `--standalone` makes up, are not a user's name
    if run_id and run_id.lower() != "none" and not _GENERATED_RUN_ID.fullmatch(run_id.lower()):
        return "TORCHELASTIC_RUN_ID"
    if os.environ.get("SLURM_JOB_ID", "").strip():
        return "SLURM_JOB_ID"
    return "derived"


def resolve_job_id() -> str:
    source = job_id_source()
    if source != "derived":
        return os.environ[source].strip()
    if not os.environ.get("MASTER_ADDR"):  # one process: nobody to agree with
        return readable_job_id()
    return _job_id_from_store() or _job_id_from_rendezvous()


def _gpu_index(local_rank: int) -> int | None:
    """The physical GPU a rank most likely owns, without initialising CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        if not devices:
            return None
        chosen = devices[local_rank % len(devices)]
        return int(chosen) if chosen.isdigit() else None
    if os.path.exists("/dev/nvidia0"):
        return local_rank
    return None


def _gpu_uuid(index: int | None) -> str | None:
    if index is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        value = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # no NVML here: the index alone is still useful
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    restart_count: int
    job_id: str
    service_name: str
    host_name: str
    pid: int
    gpu_index: int | None
    gpu_uuid: str | None
    command: str = ""

    def resource_attributes(self) -> dict:
        attributes = {
            semconv.JOB_ID: self.job_id,
            semconv.RANK: self.rank,
            semconv.LOCAL_RANK: self.local_rank,
            semconv.WORLD_SIZE: self.world_size,
            semconv.NODE_RANK: self.node_rank,
            semconv.RESTART_COUNT: self.restart_count,
            semconv.HOST_NAME: self.host_name,
            semconv.PROCESS_PID: self.pid,
        }
        if self.command:
            attributes[semconv.PROCESS_COMMAND] = self.command
        if self.gpu_index is not None:
            attributes[semconv.GPU_INDEX] = self.gpu_index
        if self.gpu_uuid:
            attributes[semconv.GPU_UUID] = self.gpu_uuid
        return attributes

    def span_fallback_attributes(self) -> dict:
        """What the instrumentor adds to its spans when the resource lacks flare.rank."""
        return {
            semconv.JOB_ID: self.job_id,
            semconv.RANK: self.rank,
            semconv.LOCAL_RANK: self.local_rank,
            semconv.WORLD_SIZE: self.world_size,
            semconv.NODE_RANK: self.node_rank,
        }


def explicit_service_name() -> str | None:
    """The service name the user set (OTEL_SERVICE_NAME, or service.name in
    OTEL_RESOURCE_ATTRIBUTES), None when unset."""
    explicit = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if explicit:
        return explicit
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == semconv.SERVICE_NAME and value.strip():
            return value.strip()
    return None


@functools.lru_cache(maxsize=1)
def current_identity() -> ProcessIdentity:
    job_id = resolve_job_id()
    local_rank = _int_env("LOCAL_RANK")
    gpu_index = _gpu_index(local_rank)
    return ProcessIdentity(
        rank=_int_env("RANK", local_rank if started_by_its_rank_zero() else 0),
        local_rank=local_rank,
        world_size=_int_env("WORLD_SIZE", 1),
        node_rank=_int_env("GROUP_RANK", _int_env("NODE_RANK", _int_env("SLURM_NODEID"))),
        restart_count=_int_env("TORCHELASTIC_RESTART_COUNT"),
        job_id=job_id,
        # Unset, the service is the job: Jaeger and Tempo list jobs by service, and two
        # jobs must not merge under the SDK's `unknown_service:python3`.
        service_name=explicit_service_name() or job_id,
        host_name=socket.gethostname(),
        pid=os.getpid(),
        gpu_index=gpu_index,
        gpu_uuid=_gpu_uuid(gpu_index),
        command=_command(),
    )


def _command() -> str:
    """The script's file name (`train.py`; `-m pkg.mod` runs give the module's file):
    what `flare diagnose --baseline-job auto` matches earlier jobs by, with the world
    size. No path and no arguments: those change from run to run."""
    argv = getattr(sys, "argv", None) or [""]
    return os.path.basename(str(argv[0])) if argv[0] not in ("", "-c", "-") else ""
