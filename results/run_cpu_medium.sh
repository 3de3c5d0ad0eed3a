#!/usr/bin/env bash
# Reproduces results/cpu_medium/: the paper's counting comparison (Table 3: 3 and 5 variables) at the cpu-medium
# preset — programs of up to 64 statements in 128-token blocks, 10k training / 1k evaluation programs per split —
# for CoPE, relative, learned, RoPE, no positions and Co-RoPE, 3 seeds: 36 runs, the two variable counts side by side
# with one XLA thread and one device each (53 minutes in all on this 2-core machine).
# Usage: bash results/run_cpu_medium.sh [counting_3var|counting_5var ...]   (resumes; PES=... SEEDS=... narrow it)
# Tables: compare.json goes to results/cpu_medium/<setting>/; `bash results/tables.sh` prints docs/reports/results.md's
# tables.
# The same runs at other settings: NAME=... runs in runs/NAME/ and copies to results/NAME/ (COPY=0: no copy; ROOT=...
# runs in ROOT/NAME/ instead of runs/NAME/), OVERRIDES="key=value ..." adds configuration overrides
# (results/run_cpu_medium_converged.sh is one such).
set -euo pipefail
cd "$(dirname "$0")/.."
PES=${PES:-cope,relative,learned,rope,none,corope}
SEEDS=${SEEDS:-0,1,2}
NAME=${NAME:-cpu_medium}
ROOT=${ROOT:-runs}
read -r -a EXTRA <<< "${OVERRIDES:-}"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false" JAXPE_CPU_DEVICES=1  # a core each
mkdir -p "$ROOT/$NAME"
DEFAULT=(counting_3var counting_5var)
for one in "${@:-${DEFAULT[@]}}"; do
  nvars=${one#counting_}; nvars=${nvars%var}
  case $nvars in ''|*[!0-9]*) echo "unknown setting $one (counting_<N>var)"; exit 2;; esac
  ( ${COMPARE:-.venv/bin/jaxpe-compare} --preset cpu-medium --pe "$PES" --seeds "$SEEDS" \
      --workdir "$ROOT/$NAME/$one" task.nvars="$nvars" run.progress=false "${EXTRA[@]}" > "$ROOT/$NAME/$one.log" 2>&1 &&
    if [ "${COPY:-1}" != 0 ]; then
      mkdir -p "results/$NAME/$one" && cp "$ROOT/$NAME/$one"/compare.{json,md,png} "results/$NAME/$one/"
    fi &&
    echo "$one done ($SECONDS s)" ) &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
