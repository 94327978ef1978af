"""Flare semantic conventions: the one symbol table for span names and attribute keys.

Every component (instrumentation, correlator, store, detectors) takes names from here
rather than spelling strings; `docs/semantic-conventions.md` is the prose version.
This module must stay import-light (stdlib only): it is loaded inside every training
process and on collector hosts that have no torch.
"""

from __future__ import annotations

import hashlib

# ---------------------------------------------------------------- resource attributes
SERVICE_NAME = "service.name"
JOB_ID = "flare.job.id"
RANK = "flare.rank"
LOCAL_RANK = "flare.local_rank"
WORLD_SIZE = "flare.world_size"
NODE_RANK = "flare.node_rank"
RESTART_COUNT = "flare.restart_count"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"
PROCESS_COMMAND = "process.command"  # the script a rank runs (its file name): a job's signature
GPU_INDEX = "flare.gpu.index"
GPU_UUID = "flare.gpu.uuid"
GPU_MODEL = "flare.gpu.model"
# Added: where a job's spans came from when they are not a live job's telemetry. Absent on
# live jobs; "kineto" on spans `flare import-kineto` wrote (no heartbeats, not running).
JOB_SOURCE = "flare.source"
JOB_SOURCE_KINETO = "kineto"

# ---------------------------------------------------------------- span names
SPAN_STEP = "train.step"
SPAN_DATALOADER = "dataloader.next"
SPAN_COLLECTIVE_PREFIX = "collective."  # collective.<op>, e.g. collective.all_reduce
SPAN_KERNEL = "kernel"
SPAN_GC = "gc.collect"
SPAN_PYTHON_CALL = "python.call"
SPAN_HANG = "flare.hang"
SPAN_HEARTBEAT = "flare.heartbeat"
SPAN_ERROR = "flare.error"  # an error outside any step (e.g. during init)
SPAN_STEP_RANKS = "train.step.ranks"  # emitted by the correlator
SPAN_CAPTURE = "flare.capture"  # a captured step's sampled stack (stack_capture.py)
CAPTURE_FRAMES = "flare.capture.frames"  # string[]: "file:line in function"
CAPTURE_SAMPLES = "flare.capture.samples"  # int[]: samples per frame
CAPTURE_STACKS = "flare.capture.stacks"  # string[]: the user's frames, root first, ";"-joined
CAPTURE_STACK_SAMPLES = "flare.capture.stack_samples"  # int[]: samples per stack
CAPTURE_TOTAL = "flare.capture.total"  # int: samples in the step
CAPTURE_INTERVAL_MS = "flare.capture.interval_ms"  # double
# A capture of the rank's DataLoader workers (not of a step): which processes, and how
# many steps the recording spanned (each worker's recorded time over the captured steps'
# mean length: the diagnosis puts its lines per step).
CAPTURE_PROCESS = "flare.capture.process"  # string: "dataloader_worker"
CAPTURE_PROCESS_DATALOADER_WORKER = "dataloader_worker"
CAPTURE_PIDS = "flare.capture.pids"  # int[]
CAPTURE_WINDOW_STEPS = "flare.capture.window_steps"  # double
# On a captured step: the rank's DataLoader workers being recorded meanwhile (their
# capture comes when the capture ends: a line read before it is not the final one).
CAPTURE_WORKERS = "flare.capture.workers"  # int
# The prefix of a captured line the training thread was blocked on (a collective, a
# queue, a lock, sleep or I/O: neither running nor waiting for a CPU), in frames and
# as the innermost element of stacks: "waiting in file:line in function".
CAPTURE_WAITING = "waiting in "
SPAN_COLLECTIVE_RANKS = "collective.ranks"  # emitted by the correlator per (pg, seq)
# service.name of the anomaly spans `flare diagnose` writes back: not a job
DIAGNOSTICS_SERVICE = "flare-diagnostics"
SPAN_ANOMALY = "flare.anomaly"  # written back by diagnostics
SPAN_RUN_STOP = "flare.run.stop"  # `flare run` stopped the job at its user's signal
RUN_STOP_SIGNAL = "flare.run.signal"  # SIGINT, SIGTERM: the first one it passed on

# ---------------------------------------------------------------- train.step
STEP = "flare.step"
STEP_DATALOADER_MS = "flare.step.dataloader_ms"
STEP_DATALOADER_COUNT = "flare.step.dataloader_count"
STEP_COLLECTIVE_WAIT_MS = "flare.step.collective_wait_ms"
STEP_COLLECTIVE_COUNT = "flare.step.collective_count"
STEP_COLLECTIVE_BYTES = "flare.step.collective_bytes"
# Per process group breakdown: parallel arrays, one entry per PG seen in the step.
STEP_PG_NAMES = "flare.step.pg.names"
STEP_PG_WAIT_MS = "flare.step.pg.wait_ms"
STEP_PG_COUNTS = "flare.step.pg.counts"
STEP_PG_BYTES = "flare.step.pg.bytes"
STEP_PG_LAST_SEQ = "flare.step.pg.last_seq"
# Present only when some role is known / some wait was not seen (see the conventions)
STEP_PG_ROLES = "flare.step.pg.roles"
STEP_PG_UNTIMED = "flare.step.pg.untimed"
STEP_COLLECTIVE_UNTIMED = "flare.step.collective_untimed"
# Process-group roles (`flare.step.pg.roles`)
ROLE_WORLD = "world"
ROLE_DATA = "data_parallel"
ROLE_TENSOR = "tensor_parallel"
ROLE_PIPELINE = "pipeline_parallel"
ROLE_CONTEXT = "context_parallel"
ROLE_EXPERT = "expert_parallel"
STEP_GC_MS = "flare.step.gc_ms"
STEP_GC_COUNT = "flare.step.gc_count"
STEP_PYCALL_MS = "flare.step.python_call_ms"
STEP_PYCALL_COUNT = "flare.step.python_call_count"
STEP_COMPUTE_MS = "flare.step.compute_ms"
# The framework's phases inside the step (a checkpoint save, an evaluation): the phase's
# own time, less what it waited in collectives, for data or in garbage collection, and
# outside compute_ms. Always sent (0.0), so that a bucket of steps averages them right.
STEP_CHECKPOINT_MS = "flare.step.checkpoint_ms"
STEP_EVALUATION_MS = "flare.step.evaluation_ms"
# On the `python.call` span of a phase's outermost function.
PHASE = "flare.phase"
PHASE_CHECKPOINT = "checkpoint"
PHASE_EVALUATION = "evaluation"
# CPU time the rank's other threads burnt during the step (process CPU minus the CPU
# of the thread that runs the steps): a GIL-holding or busy thread shows up here.
STEP_OTHER_THREADS_CPU_MS = "flare.step.cpu.other_threads_ms"
# Time the thread that runs the steps was runnable but waiting for a CPU (Linux
# schedstat run_delay): a host busy with other work, not the rank's own threads.
STEP_RUNQUEUE_MS = "flare.step.cpu.runqueue_ms"
# CPU time of the thread that runs the steps, during the step: slower compute burns more
# of it; a rank the host starves (or a GIL holder's victim) waits without burning it.
STEP_THREAD_CPU_MS = "flare.step.cpu.thread_ms"
STEP_DETAIL = "flare.step.detail"  # bool: children were recorded for this step
STEP_GPU_SM_CLOCK_MHZ = "flare.step.gpu.clock.sm"
STEP_GPU_THROTTLE = "flare.step.gpu.throttle_reasons"
STEP_GPU_TEMPERATURE_C = "flare.step.gpu.temperature"
STEP_GPU_POWER_W = "flare.step.gpu.power"

# ---------------------------------------------------------------- NVML metrics
# OTel hardware semantic conventions (hw.gpu.*) plus Flare's own; every data point
# carries flare.rank (the rank owning the GPU) and hw.id / flare.gpu.index.
METRIC_GPU_UTILIZATION = "hw.gpu.utilization"  # ratio 0..1, attr hw.gpu.task=general
METRIC_GPU_MEMORY_USAGE = "hw.gpu.memory.usage"  # By
METRIC_GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"  # By
METRIC_GPU_MEMORY_UTILIZATION = "hw.gpu.memory.utilization"  # ratio
METRIC_GPU_POWER = "hw.power"  # W, hw.type=gpu
METRIC_GPU_TEMPERATURE = "hw.temperature"  # Cel, hw.type=gpu
METRIC_GPU_ERRORS = "hw.errors"  # {error}, attr error.type (ecc_corrected, xid, nvlink_crc...)
METRIC_GPU_CLOCK_SM = "flare.gpu.clock.sm"  # MHz
METRIC_GPU_CLOCK_SM_MAX = "flare.gpu.clock.sm.max"  # MHz
METRIC_GPU_THROTTLE = "flare.gpu.throttle_reasons"  # NVML clocks-event bitmask
METRIC_GPU_XID = "flare.gpu.xid"  # last XID event code seen
METRIC_GPU_PCIE_REPLAY = "flare.gpu.pcie.replay_errors"
HW_ID = "hw.id"
HW_TYPE = "hw.type"
HW_GPU_TASK = "hw.gpu.task"
ERROR_TYPE_ATTR = "error.type"

# ---------------------------------------------------------------- dataloader.next
DATALOADER_WAIT_MS = "flare.dataloader.wait_ms"
DATALOADER_WORKERS = "flare.dataloader.workers"

# ---------------------------------------------------------------- collective.<op>
COLL_OP = "flare.collective.op"
COLL_PG = "flare.collective.pg"
COLL_PG_DESC = "flare.collective.pg_desc"
COLL_SEQ = "flare.collective.seq"
COLL_GROUP_SIZE = "flare.collective.group_size"
COLL_GROUP_RANKS = "flare.collective.group_ranks"
COLL_BYTES = "flare.collective.bytes"
COLL_DTYPE = "flare.collective.dtype"
COLL_BACKEND = "flare.collective.backend"
COLL_SOURCE = "flare.collective.source"  # "python" | "flight_recorder"
COLL_ASYNC = "flare.collective.async"
COLL_DEVICE_START_NS = "flare.collective.device_start_ns"
COLL_DEVICE_END_NS = "flare.collective.device_end_ns"
COLL_BUSBW_GBPS = "flare.collective.busbw_gbps"
COLL_WAIT_MS = "flare.collective.wait_ms"

# ---------------------------------------------------------------- kernel
KERNEL_NAME = "flare.kernel.name"
KERNEL_CATEGORY = "flare.kernel.category"
KERNEL_STREAM = "flare.kernel.stream"
KERNEL_DEVICE = "flare.kernel.device"
KERNEL_ISSUE_LATENCY_US = "flare.kernel.issue_latency_us"
KERNEL_FLOPS = "flare.kernel.flops"
KERNEL_BYTES = "flare.kernel.bytes"
KERNEL_ACHIEVED_TFLOPS = "flare.kernel.achieved_tflops"
KERNEL_ACHIEVED_GBPS = "flare.kernel.achieved_gbps"
KERNEL_SHAPE = "flare.kernel.shape"
KERNEL_DTYPE = "flare.kernel.dtype"
KERNEL_CORRELATION = "flare.kernel.correlation"
KERNEL_LAUNCH_NS = "flare.kernel.launch_ns"  # CPU launch (cudaLaunchKernel start), epoch ns
KERNEL_LAUNCH_DUR_US = "flare.kernel.launch_dur_us"  # how long the launch call took
KERNEL_SOURCE = "flare.kernel.source"  # "profiler" (live sampled window) | "kineto" (import)

KERNEL_DEVICE_HOST = -1  # flare.kernel.device of a CPU operator (CPU-only windows/traces)

KERNEL_CATEGORIES = (
    "gemm", "attention", "communication", "elementwise", "reduction",
    "memcpy", "memset", "other",
)

# ---------------------------------------------------------------- gc.collect
GC_GENERATION = "flare.gc.generation"
GC_COLLECTED = "flare.gc.collected"
GC_UNCOLLECTABLE = "flare.gc.uncollectable"

# ---------------------------------------------------------------- python.call
CODE_FUNCTION = "code.function"
CODE_FILEPATH = "code.filepath"
CODE_LINENO = "code.lineno"
CODE_CALLSITE = "flare.callsite"  # "path:line in function" of the user's frame

# ---------------------------------------------------------------- flare.hang
HANG_OPERATION = "flare.hang.operation"  # "train.step" | "collective.all_reduce" | ...
HANG_ELAPSED_S = "flare.hang.elapsed_s"
HANG_TIMEOUT_S = "flare.hang.timeout_s"
HANG_STACKS = "flare.hang.stacks"
HANG_NATIVE_STACKS = "flare.hang.native_stacks"  # py-spy dump --native, where it may run
HANG_PG = "flare.hang.pg"
HANG_SEQ = "flare.hang.seq"
HANG_COLL_OP = "flare.hang.collective_op"
# The training thread waits on its DataLoader worker processes: their pids, and their
# Python stacks (py-spy, where it may run), "most recent call first" per worker
HANG_LOADER_WORKERS = "flare.hang.loader_workers"
HANG_LOADER_STACKS = "flare.hang.loader_stacks"

# ---------------------------------------------------------------- heartbeat
HEARTBEAT_LAST_STEP = "flare.heartbeat.last_step"
HEARTBEAT_INTERVAL_S = "flare.heartbeat.interval_s"
# A rank that trains (batches, backward passes) and has ended no step: its optimizer is
# not one Flare times. Seconds it has trained so far, and the batches it loaded.
HEARTBEAT_NO_STEP_S = "flare.heartbeat.no_step_s"
HEARTBEAT_NO_STEP_BATCHES = "flare.heartbeat.no_step_batches"

# ---------------------------------------------------------------- errors
ERROR_SIGNAL = "flare.error.signal"
ERROR_TYPE = "exception.type"
ERROR_MESSAGE = "exception.message"
ERROR_STACKTRACE = "exception.stacktrace"

# ---------------------------------------------------------------- correlator output
RANKS_COUNT = "flare.ranks.count"
RANKS_EXPECTED = "flare.ranks.expected"
RANKS_MISSING = "flare.ranks.missing"
RANKS_SPREAD_MS = "flare.ranks.spread_ms"
RANKS_SLOWEST = "flare.ranks.slowest"
RANKS_CULPRIT = "flare.ranks.culprit"
RANKS_ARRIVAL_SKEW_MS = "flare.ranks.arrival_skew_ms"
RANKS_LAST_ARRIVAL = "flare.ranks.last_arrival"
RANKS_END_SPREAD_MS = "flare.ranks.end_spread_ms"  # spread of step end times
RANKS_CULPRIT_BASIS = "flare.ranks.culprit_basis"  # "collective_wait" | "arrival" | "duration"
RANKS_CULPRIT_WAIT_MS = "flare.ranks.culprit_wait_ms"  # the culprit's own collective wait
RANKS_MEDIAN_WAIT_MS = "flare.ranks.median_wait_ms"  # median collective wait of all ranks
RANKS_CLOSED_BY = "flare.ranks.closed_by"  # "complete" | "grace" | "hung_elsewhere" | "budget" | "shutdown"
RANKS_HANGING = "flare.ranks.hanging"  # ranks whose watchdog reports a hang (int array)
RANKS_HANG_OPERATIONS = "flare.ranks.hang_operations"  # parallel to RANKS_HANGING
RANKS_PG_COUNT = "flare.ranks.pg.count"  # process groups seen in the step
# Per-PG parallel arrays on train.step.ranks: the PGs with the largest skew or missing ranks.
RANKS_PG_NAMES = "flare.ranks.pg.names"
RANKS_PG_ARRIVAL_SKEW_MS = "flare.ranks.pg.arrival_skew_ms"
RANKS_PG_LAST_ARRIVAL = "flare.ranks.pg.last_arrival"
RANKS_PG_LAST_SEQ = "flare.ranks.pg.last_seq"
RANKS_PG_MISSING_COUNT = "flare.ranks.pg.missing_count"

# ---------------------------------------------------------------- anomaly write-back
ANOMALY_KIND = "flare.anomaly.kind"
ANOMALY_RANKS = "flare.anomaly.ranks"
ANOMALY_CAUSE = "flare.anomaly.cause"
ANOMALY_FIRST_STEP = "flare.anomaly.first_step"
ANOMALY_LAST_STEP = "flare.anomaly.last_step"
ANOMALY_IMPACT = "flare.anomaly.impact"
ANOMALY_CONFIDENCE = "flare.anomaly.confidence"
ANOMALY_CALLSITE = "flare.anomaly.callsite"
ANOMALY_SUMMARY = "flare.anomaly.summary"
ANOMALY_EVIDENCE = "flare.anomaly.evidence"  # JSON text
ANOMALY_ID = "flare.anomaly.id"

ANOMALY_KINDS = (
    "straggler", "fail_slow", "regression", "dataloader_stall", "gc_pause",
    "collective_slow", "hang", "error", "rank_missing", "gpu_throttle",
    "launch_bound", "gpu_idle", "kernel_slow",
)
# (checkpoint, evaluation: a framework phase that one rank runs while the others wait)
CAUSES = ("compute", "input", "communication", "cpu", "gc", "hardware", "software", "checkpoint",
          "evaluation", "unknown")

# ---------------------------------------------------------------- configuration
ENV_JOB_ID = "FLARE_JOB_ID"
ENV_DETAIL_EVERY = "FLARE_DETAIL_EVERY"
ENV_TRACED_FUNCTIONS = "FLARE_TRACED_FUNCTIONS"
ENV_HANG_TIMEOUT_S = "FLARE_HANG_TIMEOUT_S"
ENV_HEARTBEAT_S = "FLARE_HEARTBEAT_S"
# seconds the exit-time flush may take before the exporters are stopped (default 5)
ENV_EXIT_FLUSH_TIMEOUT_S = "FLARE_EXIT_FLUSH_TIMEOUT_S"
ENV_DETAIL_FLAG_FILE = "FLARE_DETAIL_FLAG_FILE"
ENV_KERNEL_WINDOWS = "FLARE_KERNEL_WINDOWS"  # auto (default: with CUDA only), 1 (also CPU-only), 0 (off)
ENV_NVML_INTERVAL_S = "FLARE_NVML_INTERVAL_S"  # NVML poll period; "0" turns NVML off
# Client credentials for `flare diagnose --backend jaeger+https://…|tempo+https://…`
# (and --follow) when no option is given: a CA bundle, a client certificate and key
# for mutual TLS, and a bearer token (kept out of command lines and shell history).
ENV_BACKEND_CA_FILE = "FLARE_BACKEND_CA_FILE"
ENV_BACKEND_CERT_FILE = "FLARE_BACKEND_CERT_FILE"
ENV_BACKEND_KEY_FILE = "FLARE_BACKEND_KEY_FILE"
ENV_BACKEND_TOKEN = "FLARE_BACKEND_TOKEN"
ENV_BACKEND_USER = "FLARE_BACKEND_USER"  # ClickHouse: user and password (else from the URL)
ENV_BACKEND_PASSWORD = "FLARE_BACKEND_PASSWORD"
# The control channel's credentials (docs/collector.md, "The control channel"): a job's
# token (HMAC of the collector's job secret; flare run makes one per run and gives it to
# the ranks) admits its ranks as agents and scopes `flare capture` to the job; an
# operator's token covers every job. Sent as the headers below (the collector's
# flare.collector.opamp spells the same names).
ENV_JOB_TOKEN = "FLARE_JOB_TOKEN"
ENV_OPERATOR_TOKEN = "FLARE_OPERATOR_TOKEN"
HEADER_AGENT_KEY = "X-Flare-Agent-Key"
HEADER_JOB_TOKEN = "X-Flare-Job-Token"
HEADER_OPERATOR_TOKEN = "X-Flare-Operator-Token"
DEFAULT_DETAIL_EVERY = 100


def step_trace_id(job_id: str, step: int) -> int:
    """The trace id every rank uses for step `step` of job `job_id`.

    Derived, not negotiated: each rank computes the same 128-bit id with no
    communication, so one trace in Jaeger/Tempo shows a step across all ranks.
    """
    digest = hashlib.blake2b(f"{job_id}\x00{step}".encode(), digest_size=16).digest()
    value = int.from_bytes(digest, "big")
    return value or 1  # the all-zero id is invalid in OTel


def collective_span_name(op: str) -> str:
    return SPAN_COLLECTIVE_PREFIX + op


def step_root_span_id(job_id: str, step: int) -> int:
    """The span id of the (virtual) root that every rank's `train.step` of step `step`
    names as its parent. No rank emits it; the correlator may emit its cross-rank
    `train.step.ranks` span with exactly this id so that the trace has a real root."""
    digest = hashlib.blake2b(f"{job_id}\x00{step}\x00root".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1

# ---------------------------------------------------------------- added by the instrumentation
STEP_BACKWARD_MS = "flare.step.backward_ms"  # wall time inside autograd backward
DATALOADER_INDEX = "flare.dataloader.index"  # fetch number within the step
COLL_P2P_PEER = "flare.collective.peer"
COLL_DEVICE_MS = "flare.collective.device_ms"  # CUDA: device time between pooled events
STEP_PG_DEVICE_MS = "flare.step.pg.device_ms"  # CUDA: device time per group (parallel)
HANG_THREAD = "flare.hang.thread"
HEARTBEAT_STEP_OPEN_S = "flare.heartbeat.step_open_s"
ENV_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
ENV_RANK_PID = "FLARE_RANK_PID"  # set by an instrumented rank; its child processes stay quiet
# Set by `flare run` to its own pid: a process it started directly, with no RANK and not
# a launcher, is a single-process job (rank 0 of 1).
ENV_RUN_PID = "FLARE_RUN_PID"
