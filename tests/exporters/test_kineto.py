"""Kineto import on every real trace in ../shared/data/kineto and on traces made here."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flare.diagnostics import gpu_metrics as gm
from flare.diagnostics.backends.store import StoreBackend
from flare.importers import kineto
from flare.importers.kineto import json_stream, load
from flare.wire import semconv as sc

DATA = Path(os.environ.get("FLARE_KINETO_DATA", Path(__file__).resolve().parents[3] / "shared/data/kineto"))
REAL = sorted(DATA.glob("*.json.gz")) if DATA.is_dir() else []
# Holistic Trace Analysis 0.5.0, get_temporal_breakdown, idle_time_pctg on these files.
HTA_IDLE_PCT = {
    "ws16_rank0": 69.44,
    "dp128_rank0_steps551-552": 53.56,
    "dp128_rank1_steps551-552": 54.72,
    "nccl2ranks_rank0": 77.78,
}
needs_data = pytest.mark.skipif(not REAL, reason=f"no Kineto traces under {DATA} (shared data absent)")


def _job(path: Path) -> str:
    return path.name.split(".")[0]


def _raw_counts(path: Path) -> dict[str, int]:
    """Independent count with the stdlib json module (the importer streams instead)."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launched = {e["args"]["correlation"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    return {
        "joined": sum(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                      and e["args"].get("correlation") in launched for e in events),
        "gpu": sum(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") for e in events),
        "nccl": sum(e.get("cat") == "kernel" and "nccl" in e["name"].lower() for e in events),
        "steps": sum(e["name"].startswith("ProfilerStep#") for e in events),
        "rank": trace.get("distributedInfo", {}).get("rank"),
    }


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, dict[str, kineto.ImportResult]]:
    store_path = tmp_path_factory.mktemp("kineto") / "store.duckdb"
    results = {_job(p): kineto.import_directory(p, store_path, job=_job(p)) for p in REAL}
    return store_path, results


@needs_data
@pytest.mark.parametrize("path", REAL, ids=_job)
def test_every_real_trace_imports_all_gpu_activity(path, imported):
    store_path, results = imported
    result = results[_job(path)]
    assert result.errors == [] and result.files_imported == 1
    expected = _raw_counts(path)
    job = StoreBackend(store_path).job_data(_job(path))
    kernels = job.spans([sc.SPAN_KERNEL], attributes=list(gm.KERNEL_ATTRIBUTES))
    assert kernels.num_rows == expected["gpu"]
    assert set(kernels.column(sc.KERNEL_CATEGORY).to_pylist()) <= set(sc.KERNEL_CATEGORIES)
    assert job.ranks() == [expected["rank"]]
    steps = job.spans([sc.SPAN_STEP], attributes=[sc.STEP])
    assert steps.num_rows == expected["steps"]
    assert steps.column("step").to_pylist() == steps.column(sc.STEP).to_pylist()
    # Every activity launched inside a ProfilerStep is parented to that step's span.
    step_ids = dict(zip(steps.column("step").to_pylist(), steps.column("span_id").to_pylist(), strict=True))
    stepped = [(s, p) for s, p in zip(kernels.column("step").to_pylist(),
                                      kernels.column("parent_span_id").to_pylist(), strict=True) if s is not None]
    assert stepped and all(step_ids[s] == p for s, p in stepped)
    latency = kernels.column(sc.KERNEL_ISSUE_LATENCY_US).to_numpy(zero_copy_only=False)
    # Every activity whose launch call is in the trace is joined to it.
    assert int(np.sum(~np.isnan(latency))) == expected["joined"] > 0.85 * expected["gpu"]
    assert np.nanmin(latency) >= 0  # the GPU never starts before the CPU launched
    collectives = job.spans([sc.SPAN_COLLECTIVE_PREFIX + "*"], attributes=[sc.COLL_OP, sc.COLL_BYTES])
    assert collectives.num_rows == expected["nccl"] > 0
    assert "unknown" not in collectives.column(sc.COLL_OP).to_pylist()
    if _job(path) == "nccl2ranks_rank0":  # new format: the kernel carries its PG metadata
        meta = job.spans([sc.SPAN_COLLECTIVE_PREFIX + "*"], attributes=[
            sc.COLL_PG_DESC, sc.COLL_GROUP_RANKS, sc.COLL_GROUP_SIZE, sc.COLL_BUSBW_GBPS]).to_pylist()[0]
        assert meta[sc.COLL_PG_DESC] == "default_pg" and meta[sc.COLL_GROUP_RANKS] == [0, 1]
        assert meta[sc.COLL_GROUP_SIZE] == 2 and meta[sc.COLL_BUSBW_GBPS] > 0
    # Timestamps are exact epoch nanoseconds (no float rounding of 1.7e18).
    assert kernels.column("start_ns")[0].as_py() > 1_600_000_000 * 10**9


@needs_data
@pytest.mark.parametrize("path", REAL, ids=_job)
def test_gpu_idle_share_agrees_with_holistic_trace_analysis(path, imported):
    store_path, _ = imported
    job = StoreBackend(store_path).job_data(_job(path))
    kernels = gm.gpu_activities(job)
    steps = job.spans([sc.SPAN_STEP], columns=["start_ns"])
    last_start = max(steps.column("start_ns").to_pylist()) if steps.num_rows >= 2 else None
    starts = kernels.column("start_ns").to_numpy()
    ends = kernels.column("end_ns").to_numpy()
    launches = kernels.column(sc.KERNEL_LAUNCH_NS).to_numpy(zero_copy_only=False).astype(float)
    if _job(path) == "nccl2ranks_rank0":
        # This trace has nanosecond timestamps; HTA rounds each event inwards to whole
        # microseconds (start up, end down). Do the same to compare like with like.
        starts = -(-starts // 1000) * 1000  # integer ceil: epoch ns exceed float precision
        ends = ends // 1000 * 1000
    share, _, _ = gm.trace_idle_share(starts, ends, launches, last_start)
    assert round(100 * share, 2) == pytest.approx(HTA_IDLE_PCT[_job(path)], abs=0.011)


_HTA_LAUNCH_DELAYS = """
import json, logging, sys, warnings
logging.disable(logging.CRITICAL); warnings.filterwarnings("ignore")
from hta.trace_analysis import TraceAnalysis
stats = TraceAnalysis(trace_dir=sys.argv[1]).get_cuda_kernel_launch_stats(ranks=[0], visualize=False)[0]
print(json.dumps({str(int(c)): float(d) for c, d in zip(stats["correlation"], stats["launch_delay"])}))
"""


def _hta_python() -> str | None:
    """HTA lives in its own environment: it needs pandas, Flare does not."""
    for python in (os.environ.get("FLARE_HTA_PYTHON"), "/tmp/hta-venv/bin/python", sys.executable):
        if python and Path(python).exists() and subprocess.run(
                [python, "-c", "import hta"], capture_output=True).returncode == 0:
            return python
    return None


@needs_data
def test_issue_latency_matches_hta_launch_delay(imported, tmp_path):
    """HTA's launch delay = GPU start − end of the launch call (clipped at 0)."""
    python = _hta_python()
    if python is None:
        pytest.skip("holistictraceanalysis not installed (set FLARE_HTA_PYTHON to a Python with it)")
    path = next((p for p in REAL if _job(p).startswith("dp128_rank0")), None)
    if path is None:
        pytest.skip("dp128_rank0 trace absent")
    store_path, _ = imported
    (tmp_path / path.name).symlink_to(path)
    out = subprocess.run([python, "-c", _HTA_LAUNCH_DELAYS, str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    theirs = {int(c): d for c, d in json.loads(out.strip().splitlines()[-1]).items()}
    kernels = StoreBackend(store_path).job_data(_job(path)).spans(
        [sc.SPAN_KERNEL], attributes=[sc.KERNEL_CORRELATION, sc.KERNEL_ISSUE_LATENCY_US,
                                      sc.KERNEL_LAUNCH_DUR_US])
    ours = {c: max(0.0, lat - dur) for c, lat, dur in zip(
        kernels.column(sc.KERNEL_CORRELATION).to_pylist(),
        kernels.column(sc.KERNEL_ISSUE_LATENCY_US).to_pylist(),
        kernels.column(sc.KERNEL_LAUNCH_DUR_US).to_pylist(), strict=True)}
    common = set(theirs) & set(ours)
    assert len(common) >= 0.9 * len(theirs) > 100
    assert all(math.isclose(ours[c], theirs[c], abs_tol=1.0) for c in common)


def _profile_cpu(path: Path, steps: int) -> None:
    """A real CPU-only PyTorch profiler trace (no CUDA here)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    x = torch.randn(32, 64)
    kwargs = {"record_shapes": True, "activities": [torch.profiler.ProfilerActivity.CPU]}
    if steps:  # ProfilerStep#N annotations exist only under a schedule
        kwargs["schedule"] = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
        kwargs["on_trace_ready"] = lambda prof: prof.export_chrome_trace(str(path))
    with torch.profiler.profile(**kwargs) as prof:
        for _ in range(steps + 2):
            model(x).sum().backward()
            prof.step()
    if not steps:
        prof.export_chrome_trace(str(path))


def test_cpu_only_traces_with_and_without_profiler_steps(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    _profile_cpu(traces / "with_steps_rank0.json", steps=3)
    _profile_cpu(traces / "no_steps_rank1.json", steps=0)
    store_path = tmp_path / "store.duckdb"
    result = kineto.import_directory(traces, store_path, job="cpu")
    assert result.errors == [] and result.files_imported == 2
    job = StoreBackend(store_path).job_data("cpu")
    assert job.ranks() == [0, 1]  # ranks from the file names: no distributedInfo
    kernels = job.spans([sc.SPAN_KERNEL], attributes=[sc.KERNEL_NAME, sc.KERNEL_DEVICE,
                                                      sc.KERNEL_CATEGORY, sc.KERNEL_FLOPS])
    assert set(kernels.column(sc.KERNEL_DEVICE).to_pylist()) == {sc.KERNEL_DEVICE_HOST}
    rows = kernels.to_pylist()
    assert {r["step"] for r in rows if r["rank"] == 1} == {None}
    assert {r["step"] for r in rows if r["rank"] == 0} >= {1, 2, 3}
    linear = [r for r in rows if r[sc.KERNEL_NAME] == "aten::linear"]
    assert linear and linear[0][sc.KERNEL_CATEGORY] == "gemm"
    assert linear[0][sc.KERNEL_FLOPS] in (2 * 32 * 128 * 64, 2 * 32 * 8 * 128)
    assert gm.gpu_activities(job).num_rows == 0  # CPU operators are not GPU activity


def test_bad_files_are_one_error_each_and_the_rest_import(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    _profile_cpu(traces / "good_rank0.json", steps=2)
    text = (traces / "good_rank0.json").read_text()
    with gzip.open(traces / "truncated_rank1.json.gz", "wt") as f:
        f.write(text[: len(text) // 2])
    full = gzip.compress(text.encode())
    (traces / "cut_gzip_rank2.json.gz").write_bytes(full[: len(full) // 2])
    (traces / "garbage_rank3.json").write_text('{"traceEvents": [{"ph": "X",,}]}')
    (traces / "not_json_rank4.json").write_text("hello")
    store_path = tmp_path / "store.duckdb"
    result = kineto.import_directory(traces, store_path, job="mixed")
    assert result.files_imported == 1
    errors = {Path(f.path).name: f.error for f in result.files if f.error}
    assert set(errors) == {"truncated_rank1.json.gz", "cut_gzip_rank2.json.gz",
                           "garbage_rank3.json", "not_json_rank4.json"}
    for name, error in errors.items():
        assert name in error and "\n" not in error
    assert "truncated" in errors["truncated_rank1.json.gz"]
    # Importing again replaces rank 0's spans instead of doubling them.
    before = StoreBackend(store_path).job_data("mixed").count(["*"])
    kineto.import_directory(traces / "good_rank0.json", store_path, job="mixed")
    assert StoreBackend(store_path).job_data("mixed").count(["*"]) == before > 0
    with pytest.raises(kineto.TraceError, match="no such file"):
        kineto.import_directory(tmp_path / "missing", store_path)


def test_legacy_array_format(tmp_path):
    """torch < 1.8 wrote the Chrome trace as a bare JSON array of events."""
    path = tmp_path / "modern_rank0.json"
    _profile_cpu(path, steps=2)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "old_rank0.json").write_text(json.dumps(events, indent=1))
    store_path = tmp_path / "store.duckdb"
    result = kineto.import_directory(legacy, store_path, job="legacy")
    assert result.errors == [] and result.spans > 0
    names = StoreBackend(store_path).job_data("legacy").spans([sc.SPAN_STEP], attributes=[sc.STEP])
    assert names.column(sc.STEP).to_pylist() == [1, 2]


def test_streaming_parser_handles_chunk_boundaries(tmp_path, monkeypatch):
    """Events split across read chunks decode exactly as json.load sees them."""
    monkeypatch.setattr(json_stream, "_CHUNK", 7)
    path = tmp_path / "t_rank0.json"
    _profile_cpu(path, steps=2)
    with open(path) as f:
        expected = json.load(f)
    with open(path) as f:
        trace = json_stream.StreamingTrace(f, str(path))
        events = list(trace.events())
    assert events == expected["traceEvents"]
    assert trace.meta.get("schemaVersion") == expected.get("schemaVersion")


def _events_of(text: str, name: str = "t.json") -> list:
    import io

    return list(json_stream.StreamingTrace(io.StringIO(text), name).events())


@pytest.mark.parametrize("chunk", [64, 300, 4096, 1 << 20])
def test_chunk_batches_decode_like_json_load(tmp_path, monkeypatch, chunk):
    """Whole elements of a chunk decode in one call; the result is still json.load's,
    including where `}, {` appears inside a string or a nested object (a wrong guess at
    the last element's end) and in both compact and indented layouts."""
    monkeypatch.setattr(json_stream, "_CHUNK", chunk)
    path = tmp_path / "t_rank0.json"
    _profile_cpu(path, steps=2)
    expected = json.loads(path.read_text())
    tricky = [{"ph": "X", "name": 'a}, {"b', "args": {"s": "}, {", "n": [{"x": 1}, {"y": 2}]}},
              {"ph": "X", "name": "}", "args": {"k": "}  ,\n  {"}}]
    expected["traceEvents"] = tricky + expected["traceEvents"] + tricky
    for layout in ({"indent": 2}, {"separators": (",", ":")}):
        text = json.dumps(expected, **layout)
        assert _events_of(text) == expected["traceEvents"]


def test_corrupt_element_inside_a_batch_names_its_offset(monkeypatch):
    monkeypatch.setattr(json_stream, "_CHUNK", 1 << 20)
    events = [{"ph": "X", "name": f"op{i}", "ts": i, "dur": 1} for i in range(2000)]
    text = json.dumps({"traceEvents": events})
    broken = text.replace('"name": "op1000"', '"name": "op1000" "oops"', 1)
    with pytest.raises(kineto.TraceError, match=r"t\.json: corrupt JSON .*offset \d+"):
        _events_of(broken)
    # A cut in the middle still reads as truncated, whatever the batch held.
    with pytest.raises(kineto.TraceError, match="truncated"):
        _events_of(text[: len(text) // 2])


@pytest.mark.parametrize("chunk", [1 << 12, 1 << 18, 1 << 20])
def test_corrupt_element_offset_is_the_files_whatever_the_chunk(monkeypatch, chunk):
    monkeypatch.setattr(json_stream, "_CHUNK", chunk)
    events = [{"ph": "X", "name": f"op{i}", "ts": i, "dur": 1} for i in range(20000)]
    text = json.dumps({"traceEvents": events})
    broken = text.replace('"name": "op15000"', '"name": "op15000" "oops"', 1)
    at = broken.index('"oops"')
    with pytest.raises(kineto.TraceError, match=r"offset (\d+)") as caught:
        _events_of(broken)
    offset = int(re.search(r"offset (\d+)", str(caught.value)).group(1))
    assert at - 2 <= offset <= at + 1  # where the scanner stopped, not where its buffer began


def test_garbage_after_the_event_list_names_its_offset():
    # "]]]{{" inside traceEvents ends the list early; what follows is not a key: it
    # used to say only "corrupt JSON between top-level keys", with no offset.
    events = [{"ph": "X", "name": f"op{i}", "ts": i, "dur": 1} for i in range(50)]
    text = json.dumps({"traceEvents": events, "deviceProperties": []})
    at = text.index("]")  # the event list's end (no event holds a list)
    broken = text[:at] + "]]]{{" + text[at:]
    with pytest.raises(kineto.TraceError, match=r"t\.json: corrupt JSON at offset (\d+): "
                       r"expected ',' or '}' after a top-level value, found ']'") as caught:
        _events_of(broken)
    assert int(re.search(r"offset (\d+)", str(caught.value)).group(1)) == at + 1


def test_parse_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    import gc

    bad = tmp_path / "bad_rank0.json"
    bad.write_text('{"traceEvents": [{"ph": "X",,}]}')
    assert gc.isenabled()
    with pytest.raises(kineto.TraceError):
        kineto.read_trace(bad, "j")
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(kineto.TraceError):
            kineto.read_trace(bad, "j")
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("job", ["plain", 'we"ird, job\nname ü \\ \'x\'', 'tab\there,"",\r\n'])
def test_rows_reach_the_store_exactly(tmp_path, job):
    """What `read_trace` built is what the store holds, value for value: text through
    the CSV file with quotes, commas, newlines and non-ASCII; '' stays '' and None NULL."""
    import duckdb

    traces = tmp_path / "traces"
    traces.mkdir()
    _profile_cpu(traces / "steps_rank0.json", steps=2)
    _profile_cpu(traces / "no_steps_rank1.json", steps=0)
    expected = []
    for path in sorted(traces.iterdir()):
        columns = kineto.read_trace(path, job).columns
        names = list(columns)
        expected += [tuple(row) for row in zip(*(columns[n] for n in names), strict=True)]
    store_path = tmp_path / "store.duckdb"
    result = kineto.import_directory(traces, store_path, job=job)
    assert result.errors == [] and result.spans == len(expected)
    con = duckdb.connect(str(store_path), read_only=True)
    try:
        stored = con.execute(f"SELECT {', '.join(names)} FROM spans").fetchall()
    finally:
        con.close()
    key = lambda row: (row[names.index("span_id")], row[names.index("rank")])  # noqa: E731
    assert sorted(stored, key=key) == sorted(expected, key=key)
    # Not vacuous: both kinds of emptiness are there.
    parents = {row[names.index("parent_span_id")] for row in stored}
    assert "" in parents
    assert any(row[names.index("step")] is None for row in stored)
    assert all(row[names.index("host")] is None for row in stored)


def test_long_and_multibyte_rows_reach_the_store(tmp_path):
    """A row far past the reader's default line size, in 4-byte characters, still reads."""
    import duckdb

    from flare.exporters import store

    names = [name for name, *_ in load.SPAN_SQL_COLUMNS]
    huge = json.dumps({"flare.kernel.name": "k" * 300_000, "note": "𝔣" * 50_000}, ensure_ascii=False)
    row = {name: None for name in names} | {
        "job": "j", "service": "j", "trace_id": "0" * 32, "span_id": "1" * 16,
        "parent_span_id": "", "name": "kernel", "kind": 1, "start_ns": 1, "end_ns": 2,
        "duration_ns": 1, "status_code": 0, "status_message": "", "rank": 0,
        "attributes": huge, "resource": "{}", "events": "[]", "links": "[]"}
    columns = {name: [row[name], row[name]] for name in names}
    rows = load.RowFile(columns)
    try:
        with store.writer(tmp_path / "s.duckdb") as con:
            assert rows.insert_into(con) == 2
    finally:
        rows.remove()
    assert not os.path.exists(rows.path)
    con = duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True)
    try:
        stored = con.execute(f"SELECT {', '.join(names)} FROM spans").fetchall()
    finally:
        con.close()
    assert stored == [tuple(row[n] for n in names)] * 2


def test_a_binary_file_is_named_with_escaped_bytes(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_bytes(b"KVL\x03\xe9\x1el\x00\xff" * 8)
    with pytest.raises(kineto.TraceError, match="not a Kineto trace") as caught:
        kineto.read_trace(path, "j")
    message = str(caught.value)
    assert message.isascii() and message.isprintable(), message
