#!/usr/bin/env bash
# Reproduces results/counting_curves/: learning curves that choose the converged counting sweep's step budget.
# CoPE, relative and learned at the cpu-medium preset (programs of up to 64 statements in 128-token blocks, 10k
# training programs), 3 and 5 variables, seed 0, each trained STEPS steps at a constant learning rate after warmup
# (optim.min_lr_ratio=1, so that every point of the curve is a model one could stop at) and evaluated on the valid and
# len_x2 splits every EVAL steps. The two variable counts run side by side, one core each; every run resumes from its
# checkpoint, so the script can be stopped and started again.
# Usage: bash results/run_counting_curves.sh [counting_3var|counting_5var ...]   (STEPS=..., EVAL=..., PES=... narrow it)
# Then: .venv/bin/python -m jaxpe.train.curves runs/counting_curves --out results/counting_curves
set -euo pipefail
cd "$(dirname "$0")/.."
PES=${PES:-cope,relative,learned}
STEPS=${STEPS:-20000}
EVAL=${EVAL:-250}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false" JAXPE_CPU_DEVICES=1  # a core each
mkdir -p runs/counting_curves
DEFAULT=(counting_3var counting_5var)
for one in "${@:-${DEFAULT[@]}}"; do
  nvars=${one#counting_}; nvars=${nvars%var}
  case $nvars in ''|*[!0-9]*) echo "unknown setting $one (counting_<N>var)"; exit 2;; esac
  ( ${COMPARE:-.venv/bin/jaxpe-compare} --preset cpu-medium --pe "$PES" --seeds 0 \
      --workdir "runs/counting_curves/$one" task.nvars="$nvars" run.progress=false run.steps="$STEPS" \
      run.eval_every="$EVAL" run.checkpoint_every=1000 run.eval_splits=valid,len_x2 optim.min_lr_ratio=1.0 \
      > "runs/counting_curves/$one.log" 2>&1 && echo "$one done ($SECONDS s)" ) &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
