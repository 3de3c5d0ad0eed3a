#!/usr/bin/env bash
# Reproduces results/counting_curves/: learning curves that choose the converged counting sweep's step budget.
# CoPE, relative and learned at the cpu-medium preset (programs of up to 64 statements in 128-token blocks, 10k
# training programs), 3 and 5 variables, seed 0, each trained STEPS steps at a constant learning rate after warmup
# (optim.min_lr_ratio=1, so that every point of the curve is a model one could stop at) and evaluated on the valid and
# len_x2 splits every EVAL steps: results/run_cpu_medium.sh's runs with these overrides, in runs/counting_curves/.
# The two variable counts run side by side, one core each; every run resumes from its checkpoint, so the script can
# be stopped and started again.
# Usage: bash results/run_counting_curves.sh [counting_3var|counting_5var ...]   (STEPS=..., EVAL=..., PES=... narrow it)
# Then: .venv/bin/python -m jaxpe.train.curves runs/counting_curves --out results/counting_curves
set -euo pipefail
NAME=counting_curves PES=${PES:-cope,relative,learned} SEEDS=0 COPY=0 \
  OVERRIDES="run.steps=${STEPS:-20000} run.eval_every=${EVAL:-250} run.checkpoint_every=1000 \
run.eval_splits=valid,len_x2 optim.min_lr_ratio=1.0" exec bash "$(dirname "$0")/run_cpu_medium.sh" "$@"
