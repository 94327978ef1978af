"""Launch `opentelemetry-instrument torchrun --nproc_per_node N examples/train_ddp.py`
with real OTLP/gRPC export to an OtlpSink on loopback (test helper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TRAIN_SCRIPT = REPO / "examples" / "train_ddp.py"


def otel_env(endpoint: str, **flare) -> dict:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("OTEL_", "FLARE_", "TORCH_FR")):
            del env[key]
    env.update({
        "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_SERVICE_NAME": "train_ddp_test",
    })
    env.update({key: str(value) for key, value in flare.items()})
    return env


class TorchrunJob:
    def __init__(self, endpoint: str, script_args: list[str], nproc: int = 4, **env):
        self.command = [str(VENV_BIN / "opentelemetry-instrument"), str(VENV_BIN / "torchrun"),
                        "--nproc_per_node", str(nproc), str(TRAIN_SCRIPT), *script_args]
        self.env = otel_env(endpoint, **env)
        self.process: subprocess.Popen | None = None
        self.output = ""

    def start(self) -> TorchrunJob:
        self.process = subprocess.Popen(self.command, env=self.env, cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        return self

    def wait(self, timeout: float) -> int:
        try:
            self.output = self.process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            self.stop()
        return self.process.returncode

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM the launcher's process group (torchrun forwards it to the ranks)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.output = self.process.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.output = self.process.communicate()[0]


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
