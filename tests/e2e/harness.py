"""What the end-to-end tests share: `flare run` of a real torchrun job into a real store,
with its live alerts timestamped on arrival, and the store read back.

Used by test_fault_injection.py and test_groups_and_stalls.py (importlib mode: the
conftest beside them puts this folder on sys.path).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from flare.exporters import store as flare_store

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TRAIN_DDP = ROOT / "examples" / "train_ddp.py"
TRAIN_PIPELINE = ROOT / "examples" / "train_pipeline.py"


def torchrun(script: Path, *args: object, nproc: int = 4) -> list[str]:
    """One single-node torchrun of an example."""
    return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), str(script), *map(str, args)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes(script: Path, *args: object, nproc_per_node: int = 2) -> list[str]:
    """Two torchrun "nodes" on this machine, one job: `flare run` hosts one command, so
    a shell starts both agents (node_rank 0 in the background), which meet in a c10d
    rendezvous; its status is the first failure of the two. Global rank = group rank ×
    nproc_per_node + local rank, so node 1 holds ranks nproc_per_node.. on."""
    common = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", str(nproc_per_node),
              "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv_id", "flare-e2e"]
    node = [shlex.join([*common, "--node_rank", str(n), str(script), *map(str, args)]) for n in (0, 1)]
    script_text = f"{node[0]} & first=$!; {node[1]}; status=$?; wait $first || status=$?; exit $status"
    return ["bash", "-c", script_text]


def run_plain(command: list[str], cwd: Path, timeout_s: float = 240) -> None:
    """`command` as it runs without Flare (no OTEL_ or FLARE_ settings reach it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLARE_"))}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert done.returncode == 0 or _gloo_exit_abort(done.stderr), done.stderr[-3000:]


def _gloo_exit_abort(stderr: str) -> bool:
    """torch 2.13's gloo can abort a rank at interpreter exit, after its group is
    destroyed ("terminate called without an active exception", SIGABRT; also without
    Flare, pytorch/pytorch#179291): a plain run whose ranks failed only so has done its
    work — what it wrote is checked by its test."""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)
    return ("terminate called without an active exception" in stderr and bool(codes)
            and all(code == "-6" for code in codes))


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+')


def flare_tracebacks(lines: list[str]) -> list[str]:
    """The tracebacks raised in Flare's own code among a job's stderr lines: those whose
    innermost frame is in a `flare` package and is not a wrapper handing the call on
    to the function it wraps (a collective that fails under Flare's hook is the job's
    error, not Flare's). The ranks, torchrun and flare run share one pipe, so each
    process's lines are followed by their [rankN] prefix, and a traceback that starts
    mid-line (another process's text before it) still counts."""
    blocks: dict[str, list[str]] = {}
    done: list[list[str]] = []
    for raw in lines:
        line = raw.rstrip("\n")
        at = line.find("Traceback (most recent call last)")
        if at >= 0:
            before = re.search(r"\[(?:rank|default)\d+\]:\s?$", line[:at])
            prefix = before.group(0) if before else ""
            if prefix in blocks:
                done.append(blocks.pop(prefix))
            blocks[prefix] = [line]
            continue
        match = _RANK_PREFIX.match(line)
        prefix = match.group(0) if match else ""
        if prefix in blocks:
            body = line[len(prefix):]
            blocks[prefix].append(line)
            if body and not body.startswith((" ", "\t")):  # the exception line ends it
                done.append(blocks.pop(prefix))
    done.extend(blocks.values())
    ours = []
    for block in done:
        frames = [(i, m.group(1)) for i, text in enumerate(block)
                  if (m := _FRAME.match(_RANK_PREFIX.sub("", text)))]
        if not frames:
            continue
        index, path = frames[-1]
        code = _RANK_PREFIX.sub("", block[index + 1]).strip() if index + 1 < len(block) else ""
        if "/flare/" in path and not re.search(r"\boriginal\w*\(", code):
            ours.append("\n".join(block))
    return ours


# The FlareRuns started by the test now running: stopped at its teardown (conftest), so a
# test that fails while its job runs leaves nothing behind. A job left running held the
# store's write-ahead log, and every later scenario of the module failed on it ("in use
# by another collector"; 7 failures from one, on a host under 1.5 busy processes per core).
RUNNING: list[FlareRun] = []


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (the job runs in a process group of its own, which a
    SIGKILL of `flare run` does not reach)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


class FlareRun:
    """One `flare run --format json -o JOB.json` of `command` (what follows `--`), with
    its live alerts timestamped on arrival."""

    def __init__(self, store: Path, job: str, command: list[str], env: dict[str, str] | None = None):
        # A rerun (pytest-rerunfailures) is a new job: flare run refuses a job name the
        # store already holds, and the first attempt's report must not be read again.
        attempt, name = 1, job
        while (store.parent / f"{name}.json").exists():
            attempt += 1
            name = f"{job}-try{attempt}"
        job = name
        self.store, self.job, self.report_path = store, job, store.parent / f"{job}.json"
        full = [str(BIN / "flare"), "run", "--store", str(store), "--job", job, "--format", "json",
                "-o", str(self.report_path), "--", *command]
        self.alerts: list[tuple[int, str]] = []
        self.stderr: list[str] = []
        self.process = subprocess.Popen(full, cwd=store.parent, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        RUNNING.append(self)

    def stop(self) -> None:
        """End `flare run` and its job if still running: Ctrl-C (flare run stops the job
        and drains), then SIGKILL of both."""
        if self.process.poll() is not None:
            return
        family = _descendants(self.process.pid)
        self.interrupt()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._kill(family)

    def _kill(self, family: list[int]) -> None:
        """SIGKILL `flare run` and `family`, the processes it had started."""
        self.process.kill()
        self.process.wait()
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _read(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line)
            if "flare: [" in line:
                self.alerts.append((time.time_ns(), line.strip()))

    def wait_for_alert(self, text: str, timeout_s: float) -> tuple[int, str] | None:
        self.wait_until(lambda alerts: any(text in line for _, line in alerts), timeout_s)
        return next((a for a in self.alerts if text in a[1]), None)

    def wait_until(self, said, timeout_s: float) -> bool:
        """Wait until `said(alerts)` holds of the live alerts so far, the job ends, or
        `timeout_s` passes; whether it held."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if said(list(self.alerts)):
                return True
            time.sleep(0.2)
        return bool(said(list(self.alerts)))

    def finish(self, timeout_s: float = 240) -> dict:
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill(_descendants(self.process.pid))
            raise
        self._reader.join(timeout=10)
        # beside its report: what flare run said (live alerts, lines), to read a failure later
        self.report_path.with_suffix(".stderr").write_text("".join(self.stderr))
        assert self.report_path.exists(), "".join(self.stderr[-30:])
        ours = flare_tracebacks(self.stderr)
        assert not ours, "\n\n".join(ours)
        return json.loads(self.report_path.read_text())

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    def query(self, sql: str, params: list) -> list[tuple]:
        # (the job's collector writes meanwhile; on a busy host a flush can hold the
        # store longer than a user's 10 s)
        con = flare_store.open_reader(self.store, timeout_s=60)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def onset_ns(self, rank: int, step: int, end_of_previous: bool = False) -> int:
        column, at = ("end_ns", step - 1) if end_of_previous else ("start_ns", step)
        row = self.query(f"SELECT max({column}) FROM spans WHERE job = ? AND name = 'train.step' "
                         "AND rank = ? AND step = ?", [self.job, rank, at])[0]
        assert row[0] is not None
        return int(row[0])

    def step_ms(self) -> dict[int, dict[int, float]]:
        """{step: {rank: train.step duration in ms}} from the store."""
        steps: dict[int, dict[int, float]] = {}
        for rank, step, ns in self.query("SELECT rank, step, end_ns - start_ns FROM spans WHERE job = ? "
                                         "AND name = 'train.step'", [self.job]):
            steps.setdefault(int(step), {})[int(rank)] = ns / 1e6
        return steps

    def resources(self) -> dict[int, dict]:
        """{rank: resource attributes} of the ranks' train.step spans."""
        rows = self.query("SELECT rank, any_value(resource) FROM spans WHERE job = ? "
                          "AND name = 'train.step' GROUP BY rank", [self.job])
        return {int(rank): json.loads(resource) for rank, resource in rows}


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (torchrun's workers leave its process
    group, so killing the group would leave them training): the whole tree is read from
    /proc first, then killed at once, silently."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stall_share(steps: dict[int, dict[int, float]], stall_steps: list[int]) -> float:
    """The share of the job's time its stalls cost, from its own step times: per step the
    median over ranks of the step's duration; share = sum over the stall steps of (that
    step's median - the median step) / the sum of every step's median."""
    medians = {step: statistics.median(by_rank.values()) for step, by_rank in steps.items()}
    usual = statistics.median(medians.values())
    lost = sum(medians[step] - usual for step in stall_steps if step in medians)
    return lost / sum(medians.values())


@contextmanager
def busy_host(per_core: int = 1):
    """`per_core` processes per core of the host burning CPU for as long as the block
    runs, beside the job itself: the loaded host every diagnosis scenario must hold on
    (users' nodes run dataloader workers, checkpoint writers and neighbours' jobs)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(per_core * (os.cpu_count() or 1))]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(timeout=10)


# Every diagnosis scenario runs on a quiet host and on a loaded one (busy_host) and must
# give the same answer on both: {scenario: {host: Verdict}}, compared as each loaded
# variant finishes (agree()) and printed as one table at the end (tests/conftest.py).
# With --verdicts DIR each verdict is also kept in DIR, where a later session (CI's
# loaded tier, its xdist workers) finds the quiet variant's.
VERDICTS: dict[str, dict[str, Verdict]] = {}
VERDICTS_DIR: Path | None = None
ONSET_SLACK = 3  # steps a loaded variant's onset may differ from the quiet one's
# Scenarios whose loaded answer is known to differ from the quiet one at times: their
# difference is reported as an expected failure with its figures, not hidden; their
# other assertions still hold when they agree. None now: every scenario must agree.
KNOWN_LOADED_DIFFERENCES: dict[str, str] = {}


@dataclass(frozen=True)
class Verdict:
    """What a scenario's diagnosis said: each label's kind, ranks, cause and onset, and
    the line (the function of the first label's call site), if the scenario has one."""

    labels: tuple[tuple[str, tuple[int, ...], str, int | None], ...]
    line: str | None = None

    @classmethod
    def of(cls, report: dict, line: str | None = None) -> Verdict:
        """A fail-slow of the same ranks and cause as a straggler is that straggler's
        finding seen job-wide (the job slowed because the rank did): one answer, whether
        the change point cleared its threshold or not on that run."""
        anomalies = report["anomalies"]
        stragglers = {(tuple(a["ranks"]), a["cause"]) for a in anomalies if a["kind"] == "straggler"}
        labels = sorted((a["kind"], tuple(a["ranks"]), a["cause"], a["first_step"]) for a in anomalies
                        if not (a["kind"] == "fail_slow" and (tuple(a["ranks"]), a["cause"]) in stragglers))
        return cls(tuple(labels), line)

    @classmethod
    def from_json(cls, data: dict) -> Verdict:
        return cls(tuple((k, tuple(r), c, o) for k, r, c, o in data["labels"]), data["line"])

    def to_json(self, scenario: str, host: str, differences: list[str] | None = None) -> dict:
        return {"scenario": scenario, "host": host, "labels": [list(label) for label in self.labels],
                "line": self.line, "text": self.text(), "differences": differences or []}

    def text(self) -> str:
        said = ", ".join(f"{kind} {list(ranks)} {cause}" + ("" if onset is None else f" @{onset}")
                         for kind, ranks, cause, onset in self.labels) or "no anomalies"
        return said + (f" · {self.line}" if self.line else "")

    def differences(self, other: Verdict) -> list[str]:
        """How `other` (the loaded variant) differs from this one (the quiet variant)."""
        mine = [label[:3] for label in self.labels]
        theirs = [label[:3] for label in other.labels]
        if mine != theirs:
            return [f"labels {self.text()} -> {other.text()}"]
        out = [f"{kind} {list(ranks)} onset {a} -> {b}"
               for (kind, ranks, _cause, a), (*_, b) in zip(self.labels, other.labels, strict=True)
               if (a is None) != (b is None) or (a is not None and abs(a - b) > ONSET_SLACK)]
        if self.line != other.line:
            out.append(f"line {self.line} -> {other.line}")
        return out


def job_name(job: str, host: str) -> str:
    """A scenario's job name on `host`: the quiet variant keeps the plain name."""
    return job if host == "quiet" else f"{job}_{host}"


def _verdict_path(scenario: str, host: str) -> Path | None:
    if VERDICTS_DIR is None:
        return None
    return VERDICTS_DIR / f"{re.sub(r'[^A-Za-z0-9]+', '_', scenario).strip('_')}.{host}.json"


def agree(scenario: str, host: str, report: dict, line: str | None = None) -> Verdict:
    """Record `scenario`'s verdict on `host`; a loaded variant must say what the quiet
    one said (same labels and causes, onsets within ONSET_SLACK steps, same line)."""
    verdict = Verdict.of(report, line)
    VERDICTS.setdefault(scenario, {})[host] = verdict
    quiet = VERDICTS[scenario].get("quiet")
    kept = _verdict_path(scenario, "quiet")
    if quiet is None and host == "loaded" and kept is not None and kept.exists():
        quiet = Verdict.from_json(json.loads(kept.read_text()))
    differences = quiet.differences(verdict) if host == "loaded" and quiet is not None else []
    path = _verdict_path(scenario, host)
    if path is not None:
        path.write_text(json.dumps(verdict.to_json(scenario, host, differences)))
    if differences and scenario in KNOWN_LOADED_DIFFERENCES:
        import pytest

        pytest.xfail(f"{KNOWN_LOADED_DIFFERENCES[scenario]}: {'; '.join(differences)}")
    assert not differences, f"{scenario}: loaded differs from quiet: {'; '.join(differences)}"
    return verdict


def describe(report: dict) -> str:
    """One line per label: what the scenarios print (run with -s) and show on failure."""
    lines = []
    for a in report["anomalies"]:
        lines.append(f"{a['kind']} ranks {a['ranks']} cause {a['cause']} steps {a['first_step']}-"
                     f"{a['last_step']} impact {a['impact']} evidence "
                     f"{ {k: a['evidence'][k] for k in ('group', 'pattern', 'period_steps') if k in a['evidence']} }"
                     f" keys {sorted(a['evidence'])}")
    for row in report.get("host_contention", []):
        lines.append(f"host contention ranks {row['ranks']} steps {row['first_step']}-{row['last_step']} "
                     f"runqueue +{row['runqueue_delta_ms']} ms/step share {row['share']}")
    return "\n".join(lines) or "no anomalies"
