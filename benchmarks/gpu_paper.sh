#!/usr/bin/env bash
# The paper-scale evidence on one GPU, in one call of at most ~9 minutes: (1) the paper preset's training step
# (benchmarks/paper_step.py: ms per model-step alone and with 3 seeds stacked, float32, compile seconds, a
# jax.profiler trace of each step), then (2) the Table 3 sweep (benchmarks/paper_sweep_gpu.sh) for the time left,
# 3 variables first. Each stage has its own time limit; everything lands in DEST (default results/paper_gpu), which
# a later call reuses to go on with the sweep. Needs jax with CUDA (and jax-triton for the native kernels).
# Usage: bash benchmarks/gpu_paper.sh [DEST]     (STEP_S, SWEEP_S: seconds per stage, default 180 and 330)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=$(mkdir -p "${1:-results/paper_gpu}" && cd "${1:-results/paper_gpu}" && pwd)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
log="$DEST/gpu_paper.log"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } 2>&1 | tee -a "$log"
SECONDS=0
timeout -k 20 "${STEP_S:-180}" $PYTHON benchmarks/paper_step.py --pe cope,relative,learned,corope --dtype float32 \
  --steps-per-dispatch 50 --repeats 2 --profile "$DEST/profile" --out "$DEST/paper_step.json" 2>&1 | grep -v "^INFO" | tee -a "$log"
echo "step: exit ${PIPESTATUS[0]} in $SECONDS s" | tee -a "$log"
SECONDS=0
PYTHON=$PYTHON benchmarks/paper_sweep_gpu.sh "$DEST/sweep" --time-limit "${SWEEP_S:-330}" 2>&1 | grep -v "^INFO" |
  tee -a "$log"
echo "sweep: exit ${PIPESTATUS[0]} in $SECONDS s" | tee -a "$log"
