"""A rank's last moments, with real OTLP to a loopback receiver: exit against an
unreachable collector is bounded (FLARE_EXIT_FLUSH_TIMEOUT_S), a healthy exit loses
nothing, and SIGABRT / SIGSEGV leave what the design promises (docs/instrumentation.md:
an ERROR step span for a signal Python can handle, the faulthandler stacks on stderr
where Python cannot run)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from otlp_sink import OtlpSink

from flare.instrumentation.config import DEFAULT_EXIT_FLUSH_TIMEOUT_S
from flare.wire import semconv

JOB_SCRIPT = Path(__file__).with_name("exit_job.py")
INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")


def rank_env(endpoint: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "FLARE_", "TORCHELASTIC", "SLURM"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", FLARE_JOB_ID="exit-job",
               OTEL_SERVICE_NAME="exit_job", OTEL_TRACES_EXPORTER="otlp",
               OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
               OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
               OTEL_BSP_SCHEDULE_DELAY="200", FLARE_HEARTBEAT_S="0")
    env.update(extra)
    return env


def run_rank(endpoint: str, steps: int, ending: str, **extra):
    """(completed process, seconds from the last step to the process being gone)."""
    process = subprocess.Popen([str(INSTRUMENT), sys.executable, str(JOB_SCRIPT), str(steps),
                                ending], env=rank_env(endpoint, **extra),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=180)
    gone = time.time()
    last = [line for line in stdout.splitlines() if line.startswith("LAST_STEP_DONE")]
    assert last, stderr[-3000:]
    return process, stdout, stderr, gone - float(last[0].split()[1])


def dead_endpoint() -> str:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def step_spans(sink: OtlpSink) -> dict[int, dict]:
    return {s["attributes"][semconv.STEP]: s for s in sink.spans()
            if s["name"] == semconv.SPAN_STEP}


@pytest.mark.e2e
@pytest.mark.parametrize("exporter, protocol", [("otlp", "grpc"),
                                                ("flare_otlp", "http/protobuf")])
def test_rank_exits_within_the_deadline_when_the_collector_is_unreachable(exporter, protocol):
    # enough steps to overflow the SDK's bounded queue (2,048 spans): memory stays
    # bounded by dropping, and the exit flush has several batches to retry; over HTTP
    # with flare_otlp (what `flare run` uses) the finisher thread is the one exporting
    process, _, stderr, linger_s = run_rank(dead_endpoint(), 2500, "exit",
                                            OTEL_TRACES_EXPORTER=exporter,
                                            OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
    assert process.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    # without the deadline the SDK's retries held the process ~30 s after its last step
    assert linger_s < DEFAULT_EXIT_FLUSH_TIMEOUT_S + 5, f"lingered {linger_s:.1f} s"
    assert "exit flush did not finish in time" in stderr


@pytest.mark.e2e
@pytest.mark.parametrize("exporter, protocol", [("otlp", "grpc"),
                                                ("flare_otlp", "http/protobuf")])
def test_a_healthy_exit_still_delivers_every_step(exporter, protocol):
    with OtlpSink(protocol="grpc" if protocol == "grpc" else "http") as sink:
        process, _, stderr, linger_s = run_rank(sink.endpoint, 300, "exit",
                                                OTEL_TRACES_EXPORTER=exporter,
                                                OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
        assert process.returncode == 0, stderr[-3000:]
        steps = step_spans(sink)
    assert sorted(steps) == list(range(300))
    assert "exit flush did not finish" not in stderr
    assert "no training step ended" not in stderr
    assert linger_s < DEFAULT_EXIT_FLUSH_TIMEOUT_S


def test_a_process_that_never_ends_a_step_says_so_at_exit():
    # An inference loop (no optimizer, no step()) sends no step at all: from the
    # outside that looked the same as instrumentation that never loaded.
    with OtlpSink(protocol="http") as sink:
        process, _, stderr, _ = run_rank(sink.endpoint, 0, "exit",
                                         OTEL_TRACES_EXPORTER="flare_otlp",
                                         OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    assert process.returncode == 0, stderr[-3000:]
    assert stderr.count("flare: no training step ended in this process") == 1, stderr[-3000:]


@pytest.mark.e2e
def test_sigabrt_marks_the_step_error_and_reaches_the_collector_before_death():
    with OtlpSink() as sink:
        process, _, stderr, _ = run_rank(sink.endpoint, 5, "sigabrt")
        steps = step_spans(sink)
    assert process.returncode == -signal.SIGABRT, stderr[-3000:]
    assert sorted(steps) == list(range(6)), "steps before the crash, and the crashed one"
    crashed = steps[5]
    assert crashed["status_code"] == 2  # STATUS_CODE_ERROR
    assert crashed["status_message"] == "killed by SIGABRT"
    assert crashed["attributes"][semconv.ERROR_SIGNAL] == "SIGABRT"
    assert crashed["attributes"][semconv.CODE_CALLSITE].endswith("in crash_in_step")
    assert "crash_in_step" in crashed["attributes"][semconv.ERROR_STACKTRACE]


@pytest.mark.e2e
@pytest.mark.parametrize("ending, signum, fatal_error", [
    ("abort", signal.SIGABRT, "Fatal Python error: Aborted"),
    ("segv", signal.SIGSEGV, "Fatal Python error: Segmentation fault")])
def test_native_crash_dumps_every_threads_stack_through_faulthandler(ending, signum,
                                                                     fatal_error):
    """abort() and a segfault with the GIL held: no Python code can run after them, so
    the design's promise is faulthandler's dump of every thread on stderr (which the
    launcher's log keeps), naming the crashing function."""
    with OtlpSink() as sink:
        process, _, stderr, _ = run_rank(sink.endpoint, 5, ending)
    assert process.returncode == -signum
    assert fatal_error in stderr, stderr[-3000:]
    current = stderr[stderr.index("Current thread"):]
    assert "in crash_in_step" in current.split("\n\n")[0]
    assert stderr.count("Thread 0x") >= 2  # the other threads too (exporter, watchdog)


def test_flare_flush_returns_on_time_against_a_dead_collector(caplog):
    """The SDK's force_flush ignores its timeout (each batch retries for up to 10 s);
    Flare's hang/error/signal flushes must not."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from flare.instrumentation.flush_deadline import FlushDeadline

    provider = TracerProvider(shutdown_on_exit=False)
    exporter = OTLPSpanExporter(endpoint=dead_endpoint().removeprefix("http://"),
                                insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    provider.get_tracer("t").start_span("s").end()
    deadline = FlushDeadline(provider)
    started = time.monotonic()
    assert deadline.flush(0.5) is False  # not delivered, but back on time
    assert deadline.flush(0.2) is False  # joins the flush under way, starts no other
    assert time.monotonic() - started < 2.0
    deadline.stop_exporters()  # ends the retrying at once
    assert deadline.exporters_stopped
    started = time.monotonic()
    provider.shutdown()
    assert time.monotonic() - started < 3.0
    # an export the stop made raise is not logged with a traceback; other lines still are
    import logging

    sdk = logging.getLogger("opentelemetry.sdk._shared_internal")
    with caplog.at_level(logging.INFO):
        try:
            raise ValueError("Cannot invoke RPC on closed channel!")
        except ValueError:
            sdk.exception("Exception while exporting %s.", "Span")
        sdk.warning("something else")
    assert "Exception while exporting" not in caplog.text and "something else" in caplog.text


def test_ctrl_c_while_a_rank_imports_torch_is_one_line():
    """Ctrl-C in a rank's first second, while the instrumentation imports torch inside
    Python's start-up (sitecustomize): one line and a SIGINT's exit status, not Python's
    "Fatal Python error: init_import_site" and its list of extension modules (84-115
    lines for a 2-rank job stopped while starting, seen). The signal goes once torch's
    library is mapped; on a busy host it can land after the import: tried again then."""
    for _attempt in range(5):
        process = subprocess.Popen(
            [str(INSTRUMENT), sys.executable, "-c", "print('the script ran', flush=True)"],
            env=rank_env(dead_endpoint(), FLARE_RUN_PID=str(os.getpid())),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # as a rank has it: a suite started in the background of a script runs with
            # SIGINT ignored (POSIX shells start background jobs so), and a child started
            # with it ignored never sees the Ctrl-C (a fresh clone's tier 1, twice)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:  # torch is being loaded
            try:
                if "libtorch" in Path(f"/proc/{process.pid}/maps").read_text():
                    break
            except OSError:
                break
            time.sleep(0.002)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
        if "the script ran" not in stdout:
            break
    else:
        pytest.fail("the signal came after start-up five times: nothing tested")
    assert stderr.strip().splitlines() == ["flare: rank 0 stopped by Ctrl-C while starting"], stderr[-2000:]
    assert process.returncode == 128 + signal.SIGINT
