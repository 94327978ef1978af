"""Import PyTorch profiler (Kineto) traces into the Flare store as ordinary Flare spans.

    result = import_directory("traces/", "store.duckdb", job="llama-run-7")
    result.files_imported, result.spans, result.errors  # per-file errors, never raised

What becomes what (span names and attributes from `flare.wire.semconv`):
- `ProfilerStep#N`          → `train.step` with `flare.step` = N
- GPU kernel/memcpy/memset  → `kernel` (category, stream, device, issue latency = GPU
                              start − CPU launch via the correlation id, launch time,
                              FLOPs from the launching operator's shapes, achieved TFLOPS
                              or GB/s), parent = the step whose CPU side launched it
- NCCL kernels              → also `collective.<op>` with PG, group size, bytes, dtype
                              from the kernel's own metadata (new traces) or the enclosing
                              `nccl:<op>` / `record_param_comms` operator (old traces)
- CPU-only traces           → top-level CPU operators become `kernel` spans on device
                              "cpu", the same shape as Flare's live CPU kernel windows
Traces without `ProfilerStep` import with NULL steps. One rank per file: the rank comes
from `distributedInfo.rank`, else a `rank<N>` in the file name, else 0.

The parser streams, in time linear in the text: it walks the top-level JSON object
itself and decodes the trace events a chunk holds with the C decoder of `json`, a value
spanning chunks with a scan that never rereads text, keeping only the few fields Flare
needs, so memory grows with the number of kernels, not with the file's text. Gzip or
plain. `Limits` bounds each file: decompressed bytes (2 GiB), one string (1 MiB), one
event (16 MiB), the memory its spans keep (2 × the bytes).

Errors: a missing, corrupt, truncated, too deep or too large file, or one whose rank is
outside INTEGER, becomes one `FileResult.error` sentence naming the file; the other
files still import. An event with a NaN, infinite or absurd time, a field of the wrong
type or a string past the limit is skipped and counted (`FileResult.skipped_events`).
A file's spans are written in one transaction that first deletes what an earlier import
of the same (job, rank) wrote, so importing twice does not double the data and a failure
leaves the store as it was.
"""

from flare.importers.kineto.limits import (
           FileResult,
           ImportResult,
           Limits,
           TraceError,
           format_size,
           parse_size,
)
from flare.importers.kineto.load import TRACE_SUFFIXES, import_directory, trace_files
from flare.importers.kineto.trace import TraceSpans, read_trace

__all__ = ["TRACE_SUFFIXES", "FileResult", "ImportResult", "Limits", "TraceError", "TraceSpans",
           "format_size", "import_directory", "parse_size", "read_trace", "trace_files"]
