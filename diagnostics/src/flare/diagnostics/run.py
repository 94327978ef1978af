"""`flare run [options] -- CMD …`: run a training command under Flare and diagnose it.

An embedded collector listens on free loopback ports and writes the store; CMD runs
under `opentelemetry-instrument` with the OTLP environment pointing at it (every
rank torchrun starts inherits that environment and is instrumented too). While CMD
runs, the detectors re-read the store every couple of seconds and print a one-line
alert for each new anomaly; when CMD ends (or on Ctrl-C) the collector drains, the
anomalies are written back as `flare.anomaly` spans (into the store and the forward
path) and the report is printed. The exit status is CMD's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

from flare.diagnostics import pipeline, report_text, writeback
from flare.diagnostics.backends import BackendError
from flare.diagnostics.hotspots import CaptureRequests
from flare.diagnostics.model import DiagnosisConfig
from flare.diagnostics.output import DEFAULT_STORE, UserError, check_output, emit
from flare.instrumentation import opamp_agent
from flare.wire import semconv as sc

LIVE_INTERVAL_S = 2.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.print_usage(sys.stderr)
        raise SystemExit(_usage_error(message))


def _usage_error(message: str) -> int:
    print(f"flare run: error: {message}", file=sys.stderr)
    return 2


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flare run", description="Run CMD under Flare and print its diagnosis.",
                usage="flare run [-h] [--store PATH] [--job NAME] [--otlp-forward URL] "
                      "[--otlp-forward-protocol grpc|http] [--no-diagnose] "
                      "[--format text|json|html] [-o FILE] -- CMD …")
    p.add_argument("--store", default=DEFAULT_STORE, metavar="PATH",
                   help=f"DuckDB store the job's spans go to, created if missing, appended to "
                        f"if not (default {DEFAULT_STORE})")
    p.add_argument("--job", metavar="NAME", help="job id (default: a generated one)")
    p.add_argument("--otlp-forward", metavar="URL",
                   help="also forward everything to this OTLP endpoint (Jaeger, Tempo, a collector)")
    p.add_argument("--otlp-forward-protocol", choices=("grpc", "http"),
                   help="protocol of --otlp-forward (default: http for port 4318 or a target that "
                        "answers HTTP/1.1, else grpc)")
    p.add_argument("--no-diagnose", action="store_true", help="collect only; no alerts, no report")
    p.add_argument("--format", choices=("text", "json", "html"), default="text",
                   help="format of the final report (default text)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the final report here")
    return p


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    args = parser().parse_args(own)
    if not command:
        return _usage_error("no command to run (put it after --)")
    if args.job is not None and not args.job.strip():
        # (seen: `--job ""` ran under a generated name, not the one the user meant to give)
        raise UserError(f"--job {args.job!r} is empty: name the job, or leave --job out "
                        "for a generated name")
    _check_command(command[0])
    if args.output:  # found out before the job runs, not after it (the report is lost)
        check_output(args.output, store=args.store)
    _check_store_directory(args.store)
    _check_existing_store(args.store, args.job)
    job = args.job or f"run-{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    forward_protocol = None
    if args.otlp_forward:
        forward_protocol = _forward_protocol(args.otlp_forward, args.otlp_forward_protocol)
    # This run's ranks, and no one else's, register as its agents: they get the job's
    # token (an HMAC of a secret that never leaves this process).
    from flare.collector.opamp import job_token

    job_secret = secrets.token_urlsafe(32)
    collector = _start_collector(args.store, args.otlp_forward, forward_protocol, job_secret)
    _create_store(collector, args.store)
    # Ranks send over OTLP/HTTP: a gRPC channel would keep threads in every rank that
    # cost CPU even between exports (docs/instrumentation.md). Written-back anomalies
    # go over gRPC, from this process.
    endpoint = _url(collector.http_endpoint or "")
    writeback_endpoint = _url(collector.grpc_endpoint or "")
    print(f"flare: job {job}: collecting into {args.store} (OTLP/HTTP {endpoint})",
          file=sys.stderr)
    capture = None if args.no_diagnose else CaptureRequests(collector.opamp.request_capture, job)
    monitor = None if args.no_diagnose else LiveMonitor(args.store, job, on_alert=capture.on_alert)
    child = None
    stopped: list[int] = []  # the signal flare run got and passed on (Ctrl-C, SIGTERM), its time
    try:
        # A JSON or HTML report on stdout stays parseable: the job's own stdout goes to
        # stderr then.
        machine_report = args.format != "text" and not args.output
        child = _launch(command, job, endpoint, stdout=sys.stderr if machine_report else None,
                        opamp=capture is not None,
                        job_token=job_token(job_secret.encode(), job))
        if monitor:
            monitor.start()
        status = _wait(child, on_interrupt=monitor.mute if monitor else None, stopped=stopped)
    finally:
        if monitor:
            monitor.stop()
        if child is not None and child.poll() is None:
            child.kill()
    collector.flush()
    if stopped:
        _record_stop(collector, args.store, job, writeback_endpoint, stopped[0], stopped[1])
    if not args.no_diagnose:
        _final_report(args, collector, job, writeback_endpoint,
                      stopped_by_user=bool(stopped), status=status,
                      alerted=monitor.alerted if monitor else (), capture=capture)
    if not collector.stop(30.0):
        print("flare: the collector could not drain everything in time; the rest is kept "
              "in its write-ahead log for the next start", file=sys.stderr)
    _report_forwarding(collector, args.otlp_forward)
    return status


def _report_forwarding(collector, target: str | None) -> None:
    """One line when the forward target did not take everything (forwarding is best
    effort and never stops the job, but a silent loss would look like success)."""
    if not target:
        return
    from flare.exporters.otlp import OtlpExporter

    for exporter in collector.exporters.values():
        if not isinstance(exporter, OtlpExporter):
            continue  # the store
        counters = exporter.metrics()
        lost = int(counters.get("dropped_items", 0))
        failing = exporter.failing_for_s()
        if lost or failing is not None:
            failed = int(counters.get("failed_requests", 0))
            reason = exporter.last_error or "the target did not take them"
            still = f", still failing after {failing:.0f} s" if failing is not None else ""
            print(f"flare: forwarding to {target} lost {lost} spans and points "
                  f"({failed} requests failed{still}; last error: {reason}); the store has "
                  "them all", file=sys.stderr)


def _url(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def _forward_target(url: str) -> tuple[object, int]:
    """The parsed --otlp-forward URL and its port (4317, or 443 for https, when none)."""
    try:
        parsed = urlparse(url if "://" in url else f"http://{url}")
        port = parsed.port  # raises on a port that is not a number in 0-65535
    except ValueError as exc:
        raise UserError(f"--otlp-forward {url!r} is not a URL ({str(exc).lower()})") from None
    if not parsed.hostname:
        raise UserError(f"--otlp-forward {url!r} is not a URL")
    return parsed, port or (443 if parsed.scheme == "https" else 4317)


def _forward_protocol(url: str, chosen: str | None) -> str:
    """Check that the forward target answers, and pick its protocol unless `chosen`:
    OTLP/HTTP for port 4318 or a /v1/traces path; otherwise whatever the target
    speaks, asked on the same connection: an OTLP/HTTP receiver answers an HTTP/1.1
    request with an HTTP/1.1 status line, a gRPC one with HTTP/2 frames (plain http://
    only; https:// stays gRPC)."""
    parsed, port = _forward_target(url)
    if chosen is None and (port == 4318 or parsed.path.rstrip("/").endswith("/v1/traces")):
        chosen = "http"
    ask = chosen is None and parsed.scheme == "http"
    try:
        with socket.create_connection((parsed.hostname, port), timeout=3) as connection:
            if ask and _speaks_http1(connection, parsed.hostname, port):
                chosen = "http"
    except OSError as exc:
        raise UserError(f"forward target {url} is unreachable: {exc.strerror or exc}") from None
    return chosen or "grpc"


def _speaks_http1(connection: socket.socket, host: str, port: int) -> bool:
    request = (f"POST /v1/traces HTTP/1.1\r\nHost: {host}:{port}\r\n"
               "Content-Type: application/x-protobuf\r\nContent-Length: 0\r\n"
               "Connection: close\r\n\r\n").encode()
    try:  # an empty export request: an OTLP/HTTP receiver accepts it and stores nothing
        connection.sendall(request)
        return connection.recv(8).startswith(b"HTTP/1.")
    except OSError:  # reachable, but it did not answer that: not OTLP/HTTP
        return False


def _check_command(name: str) -> None:
    """CMD can be run: a file that exists but is not executable is said as such (seen:
    `./train.py` without its x bit read "command not found")."""
    if shutil.which(name) is not None:
        return
    if os.sep in name and os.path.isdir(name):
        raise UserError(f"cannot run {name}: it is a directory")
    if shutil.which(name, mode=os.F_OK) is not None:  # there, but without the x bit
        raise UserError(f"cannot run {name}: permission denied (it is not executable: "
                        f"chmod +x it, or run it with its interpreter)")
    raise UserError(f"command not found: {name}")


def _check_store_directory(path: str) -> None:
    """A --store whose directory is missing is refused, as `flare diagnose` and `flare
    import-kineto` refuse it: the collector would make the directory (seen: a mistyped
    path left a new directory behind). Only the default store's (.flare) is made."""
    if path == DEFAULT_STORE:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise UserError(f"the directory {directory} of store {path} {what}")


def _check_existing_store(store_path: str, job: str | None) -> None:
    """A store that exists is a store, before the collector starts (which leaves its
    write-ahead log folder beside whatever file it was given, seen); and `job` is not in
    it: a second run under the name of a job already in the store would mix the two
    runs' steps (step numbers start at 0 again) into one job, its diagnosis, and any
    later --baseline-job against it, would read averages of both."""
    if not os.path.exists(store_path):
        return
    from flare.diagnostics.backends.store import StoreBackend

    try:
        backend = StoreBackend(store_path)
    except BackendError as exc:  # not a store, a directory (seen: a traceback): one line
        raise UserError(str(exc)) from None
    try:
        found = job is not None and job in backend.jobs()
    except Exception:  # damaged past its header: the collector's start says so
        found = False
    finally:
        backend.close()
    if found:
        raise UserError(f"job {job!r} is already in {store_path}; its steps would mix with "
                        "this run's: choose another --job (or another --store)")


def _start_collector(store_path: str, forward: str | None, protocol: str | None,
                     job_secret: str | None = None):
    from flare.collector.config import embedded_config
    from flare.collector.service import Collector

    try:
        config = embedded_config(store_path, forward_endpoint=forward, forward_protocol=protocol or "grpc",
                                 job_secret=job_secret)
        collector = Collector(config)
        collector.start()
    except Exception as exc:  # config, port, store problems: all one line for the user
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"cannot start the embedded collector: {text}") from None
    return collector


def _create_store(collector, path: str) -> None:
    """The store file exists from the start: `flare diagnose` on it during the job's
    first seconds (before the first flush) then finds a store with no jobs yet."""
    from flare.exporters import store as flare_store

    try:
        with flare_store.writer(path):
            pass
    except flare_store.StoreError as exc:
        collector.stop(5.0)
        raise UserError(str(exc)) from None


def _instrument_command() -> list[str]:
    local = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    found = local if os.access(local, os.X_OK) else shutil.which("opentelemetry-instrument")
    if not found:
        raise UserError("opentelemetry-instrument is not installed (pip install opentelemetry-distro)")
    return [found]


def child_environment(job: str, endpoint: str, base: dict[str, str] | None = None,
                      opamp: bool = False, job_token: str | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({
        "OTEL_SERVICE_NAME": env.get("OTEL_SERVICE_NAME") or job,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "flare_otlp",  # the SDK's OTLP exporter, cheaper encoding
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,flare",
        sc.ENV_JOB_ID: job,
        # A command that is not a launcher (`flare run -- python train.py`) is a job of
        # one process: the instrumentation knows it by its parent, this process.
        sc.ENV_RUN_PID: str(os.getpid()),
    })
    if opamp:  # live labels ask their ranks for a capture there (CaptureRequests)
        from flare.collector.opamp import PATH

        env.setdefault(opamp_agent.ENV_ENDPOINT, endpoint.rstrip("/") + PATH)
    if job_token:
        env[sc.ENV_JOB_TOKEN] = job_token
    # Alerts are only as fresh as the batches ranks send: each rank's finisher hands its
    # step spans over and exports them every max(2 s, this delay). The SDK's default of
    # 5 s, set here so that the instrumentation overhead benchmark runs what flare run
    # runs: against 2 s it halves each span's cost to the finisher (more spans share a
    # cold wake-up) and the requests per step; the finisher's CPU per rank-step fell
    # from 153-205 to 93-124 us (80 ms steps, in situ), for alerts ~3 s later.
    env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "5000")
    env.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "5000")
    return env


def _launch(command: list[str], job: str, endpoint: str, stdout=None,
            opamp: bool = False, job_token: str | None = None) -> subprocess.Popen:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started with SIGINT ignored (in the background of a script, under nohup): the
        # job would inherit that and ignore the SIGINT Flare passes on to stop it, until
        # the escalation's SIGTERM. A handler of Flare's own is reset to the default in
        # the child at exec; Flare still ignores it until `_wait` forwards it.
        signal.signal(signal.SIGINT, _ignore)
    try:
        # Its own process group: Ctrl-C reaches Flare, which passes it on and still
        # gets to drain the collector and print the report.
        return subprocess.Popen(_instrument_command() + command,
                                env=child_environment(job, endpoint, opamp=opamp, job_token=job_token),
                                process_group=0, stdout=stdout)
    except OSError as exc:
        raise UserError(f"cannot run {command[0]}: {exc.strerror or exc}") from None


def _ignore(_signum: int, _frame) -> None:
    pass


def _wait(child: subprocess.Popen, on_interrupt=None, escalate_after_s: float = 15.0,
          stopped: list | None = None) -> int:
    """Wait for the job. Ctrl-C passes SIGINT to its process group, a second SIGTERM, a
    third SIGKILL; a job still running `escalate_after_s` after a signal gets the next
    one anyway (a SIGINT that reached a process between its Python handler and an exec,
    as `opentelemetry-instrument` does at start, is lost)."""
    interrupts = [0]
    last_signal = [0.0]
    stopped = [] if stopped is None else stopped  # the signal that stopped the job, its time

    def send_next() -> None:
        interrupts[0] += 1
        sig = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[min(interrupts[0], 3) - 1]
        last_signal[0] = time.monotonic()
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass

    def forward(signum: int, _frame) -> None:
        if interrupts[0] == 0:
            stopped.extend((signum, time.time_ns()))  # (the caller's to know: the job
            # did not end on its own, and when it was stopped)
            what = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
            # (a new line first on a terminal: the shell has echoed ^C on this one)
            print(f"{chr(10) if sys.stderr.isatty() else ''}flare: {what}; stopping the job "
                  "(Ctrl-C again to force)", file=sys.stderr)
            if on_interrupt is not None:
                on_interrupt()
        send_next()

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if interrupts[0] and time.monotonic() - last_signal[0] >= escalate_after_s:
                    send_next()
            except InterruptedError:
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if interrupts[0]:
        return 128 + stopped[0]  # 130 after Ctrl-C, 143 after SIGTERM, as a shell reports
    return code if code >= 0 else 128 - code


def _record_stop(collector, store_path: str, job: str, endpoint: str, signum: int,
                 time_ns: int) -> None:
    """Store that the user stopped the job (a `flare.run.stop` span): `flare diagnose`
    later reads it as this run's report does (seen: a job stopped with Ctrl-C twice read
    clean here, and "rank 0 died without an error ... SIGKILL" from the store). Only for
    a job the store holds: the span alone would make a job that sent nothing one."""
    from flare.diagnostics.backends.store import StoreBackend

    try:
        backend = StoreBackend(store_path)
        try:
            if job not in backend.jobs():
                return
        finally:
            backend.close()
    except BackendError:
        return
    try:
        writeback.send_otlp(endpoint, writeback.stop_span(job, signal.Signals(signum).name, time_ns))
        collector.flush()
    except writeback.WritebackError as exc:
        print(f"flare: the stop was not recorded in the store: {exc}", file=sys.stderr)


def _final_report(args: argparse.Namespace, collector, job: str, endpoint: str,
                  stopped_by_user: bool = False, status: int = 0, alerted=(),
                  capture: CaptureRequests | None = None) -> None:
    from flare.diagnostics.backends.store import StoreBackend

    backend = None
    try:
        backend = StoreBackend(args.store) if os.path.exists(args.store) else None
        if backend is None or job not in backend.jobs():
            # the likelier cause first: a command that failed before training started
            why = (f"the command exited with status {status} before sending any"
                   if status != 0 and not stopped_by_user else
                   "is the instrumentation installed in the command's Python?")
            print(f"flare: job {job} sent no spans; nothing to diagnose ({why})",
                  file=sys.stderr)
            return
        job_data = backend.job_data(job)
        config = DiagnosisConfig(stopped_by_user=stopped_by_user)
        diagnosis = pipeline.diagnose(job_data, config)
        diagnosis.withdrawn = pipeline.withdrawn(alerted, diagnosis.anomalies, diagnosis.job_data, config,
                                                 diagnosis.blips)
        diagnosis.live_alerts = pipeline.live_alerts(alerted, diagnosis.anomalies)
        if capture is not None:
            capture.unanswered(diagnosis.anomalies, diagnosis.steps)
    except BackendError as exc:
        print(f"flare: cannot diagnose: {exc}", file=sys.stderr)
        return
    finally:
        if backend is not None:
            backend.close()  # the collector flushes the written-back anomalies next
    if diagnosis.anomalies:
        try:
            writeback.send_otlp(endpoint, writeback.anomaly_spans(job, diagnosis.anomalies,
                                                                   diagnosis.evidence_links))
            collector.flush()
        except writeback.WritebackError as exc:
            print(f"flare: anomalies not written back: {exc}", file=sys.stderr)
    emit(diagnosis, job_data, config, args.format, args.output)


_REPORTED_KINDS = ("hang", "error")
INTERRUPTED_STATUS = 128 + signal.SIGINT  # the shell's status for a command stopped by Ctrl-C


class LiveMonitor:
    """Re-diagnoses what has been stored so far and prints each new anomaly once."""

    def __init__(self, store_path: str, job: str, interval_s: float = LIVE_INTERVAL_S,
                 out=None, on_alert=None) -> None:
        self.store_path = store_path
        self.job = job
        self.interval_s = interval_s
        self.out = out or sys.stderr
        self.seen: set[tuple] = set()
        self.alerted: list = []  # the anomalies announced, in order (the final report
        # lists those it does not keep as withdrawn)
        # what the last pass found: an anomaly is announced once two passes in a row
        # find it, so a label that one pass's partial data produced (and the next drops)
        # never reaches the user
        self._previous: set[tuple] = set()
        self.on_alert = on_alert  # (anomaly, diagnosis) for each alert, after it is printed
        self.located: dict[tuple, str] = {}  # alerted label -> the line it was given
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flare-live", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def mute(self) -> None:
        """The user stopped the job: what its ranks report while they stop (signals,
        interrupted calls) is not news."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception as exc:  # the job must run on even if a pass fails
                print(f"flare: live diagnosis pass failed: {type(exc).__name__}: {exc}", file=self.out)

    def check_once(self) -> list:
        from flare.diagnostics.backends.store import StoreBackend
        from flare.diagnostics.complete import CompleteSteps

        if not os.path.exists(self.store_path):
            return []
        backend = None
        try:
            backend = StoreBackend(self.store_path, open_timeout_s=5.0)
            if self.job not in backend.jobs():
                return []
            # only the steps every rank has sent: a late rank's missing steps would
            # otherwise read as its peers' problem (CompleteSteps)
            diagnosis = pipeline.diagnose(CompleteSteps.of(backend.job_data(self.job)),
                                          DiagnosisConfig(live=True), warn=lambda _line: None)
        except BackendError:
            return []  # the collector is mid-flush; the next pass will see it
        finally:
            if backend is not None:
                backend.close()  # the embedded collector's next flush needs the file
        fresh = []
        found = {(a.kind, tuple(a.ranks), a.cause) for a in diagnosis.anomalies}
        confirmed, self._previous = found & self._previous, found
        # a hang or an error is a report from a rank, not a statistic: at once
        confirmed |= {identity for identity in found if identity[0] in _REPORTED_KINDS}
        for anomaly in diagnosis.anomalies:
            identity = (anomaly.kind, tuple(anomaly.ranks), anomaly.cause)
            if identity in confirmed and identity not in self.seen:
                self.seen.add(identity)
                self.alerted.append(anomaly)
                fresh.append(anomaly)
                print(report_text.live_alert_line(self.job, anomaly),
                      file=self.out, flush=True)
                if self.on_alert is not None:
                    try:
                        self.on_alert(anomaly, diagnosis)
                    except OSError as exc:  # a capture request that cannot be written
                        print(f"flare: capture request failed: {exc}", file=self.out)
        for anomaly in diagnosis.anomalies:  # an alerted label a capture has located since
            identity = (anomaly.kind, tuple(anomaly.ranks), anomaly.cause)
            # (a line read while its workers' capture is still coming is not the final one)
            if (identity in self.seen and identity not in self.located
                    and anomaly.evidence.get("hotspots") and anomaly.callsite
                    and not anomaly.evidence.get("capture_pending")):
                self.located[identity] = anomaly.callsite
                print(f"{time.strftime('%H:%M:%S')} flare: [{anomaly.kind}] ranks "
                      f"{','.join(map(str, anomaly.ranks))} {report_text.at(anomaly.callsite)}",
                      file=self.out, flush=True)
        return fresh
