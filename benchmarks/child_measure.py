"""Run a command as its own child and report that child's wait4 figures (used by the
benchmarks that compare wall time, CPU seconds and peak RSS of separate processes).

A launcher process forks the command: Linux starts a child's peak-RSS count from its
parent's resident set at fork, so measured straight from a large benchmark process every
child would inherit that size.
"""

from __future__ import annotations

import subprocess
import sys

_LAUNCHER = r"""
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\n@@measured {time.perf_counter() - start} "
                 f"{usage.ru_utime + usage.ru_stime} {usage.ru_maxrss}\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, peak RSS KiB, stdout) of `cmd`; exits with one line
    naming the command if it fails."""
    wall, cpu, peak_kb, status, stdout, stderr = run_measured_status(cmd, env)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}… failed ({status}): {stderr.strip()[-400:]}")
    return wall, cpu, peak_kb, stdout


def run_measured_status(cmd: list[str], env: dict | None = None
                        ) -> tuple[float, float, int, int, str, str]:
    """(wall s, CPU s, peak RSS KiB, exit status, stdout, stderr) of `cmd`, whatever its
    status; exits with one line if the launcher itself fails."""
    proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *cmd], capture_output=True,
                          text=True, env=env)
    lines = proc.stderr.rstrip().splitlines()
    if not lines or not lines[-1].startswith("@@measured"):
        raise SystemExit(f"{' '.join(cmd[:4])}… the launcher failed ({proc.returncode}): "
                         f"{proc.stderr.strip()[-400:]}")
    _, wall, cpu, peak_kb = lines[-1].split()
    return (float(wall), float(cpu), int(peak_kb), proc.returncode, proc.stdout,
            "\n".join(lines[:-1]))
