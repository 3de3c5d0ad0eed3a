#!/usr/bin/env bash
# On a machine with a CUDA GPU, in one go and in order of what matters most: (1) the GPU tests of the native Triton
# kernels (every interpret-mode sweep, compiled now) and of both fused paths at long lengths, (2) the native kernels'
# tile and warp variants (benchmarks/tiles.py), (3) the attention benchmark at training shapes (B 4, 16 query heads,
# GQA 4) of the Pallas and native paths beside cuDNN's flash attention at L 4096 (Pallas too) and 32768, and of
# forgetting attention's Pallas kernels and stick-breaking attention's Pallas and native ones at L 4096. Each stage
# has a time limit, so a slow one cannot starve the next; every stage's JSON and log land in DEST (default
# results/bench). Needs jax with CUDA,
# triton and the jax-triton release of the installed jax (`pip install 'jaxpe[gpu,triton]'`).
# Usage: bash benchmarks/gpu_check.sh [DEST]     (TESTS_S, TILES_S, BENCH_S: seconds per stage; STAGES=tests,tiles
# or STAGES=bench runs some of them, e.g. to split the list over two calls of a machine with a time limit per call;
# IMPLS_4096=triton,anchor leaves Pallas out of the L 4096 benchmark; PYTEST_ARGS adds to the tests' pytest line)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=$(mkdir -p "${1:-results/bench}" && cd "${1:-results/bench}" && pwd)
WORK=$(mktemp -d)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
log="$DEST/gpu_check.log"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
  $PYTHON -c "import jax, triton; from jaxpe.kernels._triton_launch import unavailable
print(jax.devices(), 'jax', jax.__version__, 'triton', triton.__version__, 'native path:', unavailable() or 'ok')"
} 2>&1 | tee "$log"

STAGES=",${STAGES:-tests,tiles,bench},"
if [[ $STAGES == *,tests,* ]]; then
  echo "== tests" | tee -a "$log"
  SECONDS=0
  # -v with xdist names each test as it ends ("[gw1] PASSED tests/..."), and a plugin writes each failure's report
  # to gpu_failures.log as it comes: a stage cut short still names its failures and says why. SIGINT first, so that
  # pytest prints its summary and slowest tests before it stops.
  cat > "$WORK/gpu_failures_plugin.py" <<'PLUGIN'
import os


def pytest_runtest_logreport(report):
    if report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.environ["GPU_FAILURES_LOG"], "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
PLUGIN
  : > "$DEST/gpu_failures.log"
  GPU_FAILURES_LOG="$DEST/gpu_failures.log" PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}" \
    timeout -s INT -k 30 "${TESTS_S:-300}" $PYTHON -m pytest -v -rfE -n 8 -p no:cacheprovider \
    -p gpu_failures_plugin --durations=20 ${PYTEST_ARGS:-} tests/test_kernels_cope_triton.py \
    tests/test_kernels_corope_triton.py tests/test_kernels_stickbreaking_triton.py tests/test_gpu_long.py \
    > "$DEST/gpu_tests.log" 2>&1
  echo "tests: exit $? in $SECONDS s" | tee -a "$log"
  grep -E "^\[gw[0-9]+\].*(FAILED|ERROR)|^(FAILED|ERROR) | passed| failed" "$DEST/gpu_tests.log" | tail -40 |
    tee -a "$log"
  pkill -f "pytest.*gpu_long" 2>/dev/null  # xdist workers a timeout left behind would share the GPU with the timings
fi

if [[ $STAGES == *,tiles,* ]]; then
  echo "== tiles" | tee -a "$log"
  SECONDS=0
  timeout "${TILES_S:-100}" $PYTHON benchmarks/tiles.py --out "$WORK" > "$WORK/tiles.log" 2>&1
  echo "tiles: exit $? in $SECONDS s" | tee -a "$log"
  cp "$WORK"/tiles_*.json "$DEST"/ 2>/dev/null || cp "$WORK/tiles.log" "$DEST/tiles.log"
  cat "$WORK"/tiles_*.md 2>/dev/null | tee -a "$log"
fi

if [[ $STAGES == *,bench,* ]]; then
  echo "== attention" | tee -a "$log"
  SECONDS=0
  timeout "${BENCH_S:-300}" bash -c "
    $PYTHON benchmarks/attention.py --out '$WORK' --name bench_gpu_native_4096 --lengths 4096 --groups 4 \
      --impls ${IMPLS_4096:-pallas,triton,anchor} --repeats 5 &&
    $PYTHON benchmarks/attention.py --out '$WORK' --name bench_gpu_native_32768 --lengths 32768 --groups 4 \
      --impls triton,anchor --repeats 3 &&
    $PYTHON benchmarks/attention.py --out '$WORK' --name bench_gpu_native_fox_sb --lengths 4096 --groups 4 \
      --ops fox,stickbreaking --impls pallas,triton,anchor --repeats 5" > "$WORK/bench.log" 2>&1
  echo "attention: exit $? in $SECONDS s" | tee -a "$log"
  cp "$WORK"/bench_gpu_native_*.json "$DEST"/ 2>/dev/null
  grep '^{' "$WORK/bench.log" > "$DEST/bench_rows.jsonl"
  cat "$WORK"/bench_gpu_native_*.md 2>/dev/null | tee -a "$log"
fi
