#!/usr/bin/env bash
# Flare's GPU checks: one script, one GPU (an H200 is the reference), under 8 minutes.
#
#   tests/gpu/run_gpu_checks.sh            results under $OUT (default ./gpu-results)
#
# 1. a 2-process DDP job (tests/gpu/train_gpu.py) under `flare run`, rank 1 doing extra
#    bf16 GEMMs from step 60; kernel windows every 20th step, NVML every second;
# 2. tests/gpu/check_gpu_results.py checks the store and the diagnosis: kernel spans,
#    issue latency, GEMM TFLOPS, void share, device-timed NCCL collectives, NVML metrics
#    and step clock state, and the slowdown labelled on rank 1;
# 3. FSDP2 and FSDP2 + tensor parallel (train_gpu.py --parallel) on NCCL, the last rank
#    slowed when there are 2 GPUs or more: tests/gpu/check_parallel.py checks the groups,
#    their waits and device times, nothing untimed, and the slow rank named;
# 4. Lightning's FSDPStrategy and DeepSpeed on CUDA, where installed (one GPU: one rank):
#    steps counted, checkpoints a phase, a healthy run unlabelled;
# 5. benchmarks/kernel_window_overhead.py on the GPU.
#
# Environment: PYTHON (default python3, whose torch must see the GPU). If Flare is not
# importable there, a venv with --system-site-packages is made and the six Flare
# folders are installed into it editable; FLARE_WHEELS=DIR installs the missing
# dependencies (opentelemetry-*, duckdb, …) from wheels in DIR instead of an index.
# NCCL refuses two ranks on one GPU, so with a single GPU the job uses gloo on CUDA
# tensors and the NCCL check reports N/A; a 1-rank NCCL job then covers NCCL kernels.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu-results}
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
PY=${PYTHON:-python3}
exec > >(tee -a "$LOG") 2>&1
echo "== flare GPU checks $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true

if ! "$PY" -c "import flare.diagnostics.cli, flare.instrumentation.kernels" 2>/dev/null; then
  VENV=${FLARE_GPU_VENV:-/tmp/flare-gpu-venv}
  "$PY" -m venv --system-site-packages "$VENV" || exit 2
  PIP=("$VENV/bin/python" -m pip install -q --no-cache-dir)
  if [ -n "${FLARE_WHEELS:-}" ]; then
    "${PIP[@]}" --no-index --no-deps "$FLARE_WHEELS"/*.whl || exit 2
  fi
  "${PIP[@]}" --no-deps --no-build-isolation -e wire -e instrumentation -e processors -e exporters \
    -e otel-collector -e diagnostics || exit 2
  PY="$VENV/bin/python"
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 2

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
BACKEND=gloo
[ "$GPUS" -ge 2 ] && BACKEND=nccl
export FLARE_DETAIL_EVERY=20 FLARE_NVML_INTERVAL_S=1 OTEL_METRIC_EXPORT_INTERVAL=2000
STORE="$OUT/gpu.duckdb"
rm -f "$STORE"
echo "== 2-rank DDP job, backend $BACKEND"
timeout 300 "$PY" -m flare.diagnostics.cli run --store "$STORE" --job gpu-check --format json \
  -o "$OUT/diagnosis.json" -- "$PY" -m torch.distributed.run --nproc_per_node 2 \
  tests/gpu/train_gpu.py --steps 300 --slow-rank 1 --slow-from 60 --backend "$BACKEND" \
  > "$OUT/run.log" 2>&1
echo "flare run exit status $?"
tail -5 "$OUT/run.log"

STATUS=0
"$PY" tests/gpu/check_gpu_results.py --store "$STORE" --diagnosis "$OUT/diagnosis.json" \
  --slow-rank 1 --backend "$BACKEND" --out "$OUT" || STATUS=1

if [ "$BACKEND" = gloo ]; then
  echo "== 1-rank NCCL job: NCCL kernels in windows, device-timed collectives"
  NSTORE=/tmp/flare-gpu-nccl.duckdb
  rm -f "$NSTORE"
  timeout 120 "$PY" -m flare.diagnostics.cli run --store "$NSTORE" --job gpu-nccl --no-diagnose \
    -- "$PY" -m torch.distributed.run --nproc_per_node 1 tests/gpu/train_gpu.py --steps 60 \
    --slow-rank -1 --backend nccl > "$OUT/run_nccl.log" 2>&1
  echo "flare run (nccl) exit status $?"
  "$PY" - "$NSTORE" <<'PY' || STATUS=1
import sys
from flare.diagnostics.backends.store import StoreBackend
from flare.wire import semconv as sc
job = StoreBackend(sys.argv[1]).job_data("gpu-nccl")
kernels = job.spans([sc.SPAN_KERNEL], attributes=[sc.KERNEL_CATEGORY, sc.KERNEL_NAME])
comm = [n for n, c in zip(kernels.column(sc.KERNEL_NAME).to_pylist(),
                          kernels.column(sc.KERNEL_CATEGORY).to_pylist()) if c == "communication"]
coll = job.spans([sc.SPAN_COLLECTIVE_PREFIX + "*"], attributes=[sc.COLL_DEVICE_START_NS])
timed = sum(v is not None for v in coll.column(sc.COLL_DEVICE_START_NS).to_pylist())
print(f"{'PASS' if comm else 'FAIL'} NCCL kernels in kernel windows {{'count': {len(comm)}, 'names': {sorted(set(comm))[:3]}}}")
print(f"{'PASS' if timed else 'FAIL'} NCCL collectives timed on the device {{'spans': {coll.num_rows}, 'device_timed': {timed}}}")
sys.exit(0 if comm and timed else 1)
PY
fi

echo "== FSDP2 and FSDP2 + tensor parallel on NCCL (one GPU per rank)"
for PAR in fsdp2 fsdp2_tp; do
  N=$(( GPUS >= 4 ? 4 : GPUS ))
  NGROUPS=1
  if [ "$PAR" = fsdp2_tp ]; then
    N=$(( N / 2 * 2 )); NGROUPS=2
    if [ "$N" -lt 2 ]; then echo "N/A  $PAR: needs 2 GPUs, this host has $GPUS"; continue; fi
  fi
  SLOW=$(( N >= 2 ? N - 1 : -1 ))  # one rank: a healthy run, the groups and timings still checked
  PSTORE="$OUT/gpu-$PAR.duckdb"
  rm -f "$PSTORE"
  timeout 240 "$PY" -m flare.diagnostics.cli run --store "$PSTORE" --job "gpu-$PAR" --format json \
    -o "$OUT/diagnosis-$PAR.json" -- "$PY" -m torch.distributed.run --nproc_per_node "$N" \
    tests/gpu/train_gpu.py --parallel "$PAR" --steps 150 --slow-rank "$SLOW" --slow-from 50 \
    --batch 2048 --backend nccl > "$OUT/run-$PAR.log" 2>&1
  echo "flare run ($PAR, $N ranks) exit status $?"
  "$PY" tests/gpu/check_parallel.py --store "$PSTORE" --job "gpu-$PAR" \
    --diagnosis "$OUT/diagnosis-$PAR.json" --slow-rank "$SLOW" --slow-from 50 --groups "$NGROUPS" \
    || STATUS=1
done

echo "== Lightning's FSDPStrategy (FSDP1, which Lightning allows on a GPU only) and DeepSpeed on CUDA"
# Where lightning / deepspeed are importable (installed, or from FLARE_WHEELS): each job's
# optimizer steps all counted, its checkpoints a phase, and no label on a healthy run.
for FW in lightning deepspeed; do
  if ! "$PY" -c "import $FW" 2>/dev/null; then echo "N/A  $FW: not installed on this host"; continue; fi
  FSTORE="$OUT/gpu-$FW.duckdb"
  rm -f "$FSTORE"
  if [ "$FW" = lightning ]; then
    CMD=("$PY" examples/train_lightning.py --strategy fsdp --accelerator gpu --devices 1 --steps 60
         --save-every 20)
  else
    CMD=(env DS_ACCELERATOR=cuda "$PY" -m torch.distributed.run --nproc_per_node 1
         examples/train_deepspeed.py --steps 60 --save-every 20)
  fi
  timeout 240 "$PY" -m flare.diagnostics.cli run --store "$FSTORE" --job "gpu-$FW" --format json \
    -o "$OUT/diagnosis-$FW.json" -- "${CMD[@]}" > "$OUT/run-$FW.log" 2>&1
  echo "flare run ($FW) exit status $?"
  "$PY" - "$FSTORE" "gpu-$FW" "$OUT/diagnosis-$FW.json" <<'PY' || STATUS=1
import json, sys
from flare.diagnostics.backends.store import StoreBackend
from flare.wire import semconv as sc
job = StoreBackend(sys.argv[1]).job_data(sys.argv[2])
steps = sorted(set(job.spans([sc.SPAN_STEP], columns=["step"]).column("step").to_pylist()))
calls = job.spans([sc.SPAN_PYTHON_CALL], attributes=[sc.PHASE]).column(sc.PHASE).to_pylist()
labels = json.load(open(sys.argv[3]))["anomalies"]
ok = steps == list(range(60)) and sc.PHASE_CHECKPOINT in calls and not labels
print(f"{'PASS' if ok else 'FAIL'} {sys.argv[2]}: steps {steps[:1]}..{steps[-1:]} ({len(steps)}), "
      f"checkpoint phases {calls.count(sc.PHASE_CHECKPOINT)}, labels {[a['kind'] for a in labels]}")
sys.exit(0 if ok else 1)
PY
done

echo "== kernel window overhead on the GPU"
timeout 240 "$PY" benchmarks/kernel_window_overhead.py --steps 300 \
  > "$OUT/kernel_window_overhead.txt" 2>&1 || STATUS=1
cat "$OUT/kernel_window_overhead.txt"
echo "== done, status $STATUS"
exit $STATUS
