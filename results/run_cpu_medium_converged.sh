#!/usr/bin/env bash
# Reproduces results/cpu_medium_converged/: the counting comparison at the cpu-medium preset (programs of up to 64
# statements in 128-token blocks, 10k training programs) trained until it stops improving: CoPE, relative, learned,
# RoPE, no positions and Co-RoPE x 3 and 5 variables x seeds 0, 1, 2, each 20000 steps at a constant learning rate
# of 3e-4 after warmup (optim.min_lr_ratio=1), evaluated on the valid and len_x2 splits every 250 steps, so that every
# run is also a learning curve. The budget and the rate were chosen from learning curves (docs/reports/results.md,
# "Counting trained until it stops improving"), results/cpu_medium_converged/lr_curves/, which these commands reproduce:
#   LR=3e-3 ROOT=runs NAME=cpu_medium_lr3e-3 PES=cope,relative,learned SEEDS=0 bash results/run_cpu_medium_converged.sh
#   for LR in 1e-2 1e-3 3e-4 1e-4; do LR=$LR ROOT=runs NAME=cpu_medium_lr$LR STEPS=10000 PES=cope,relative SEEDS=0 \
#     bash results/run_cpu_medium_converged.sh counting_5var; done      (1e-2 was stopped at step 4250)
#   .venv/bin/python -m jaxpe.train.curves runs/cpu_medium_lr{3e-3,1e-2,1e-3,3e-4,1e-4} --window 5000:10000 \
#     --out results/cpu_medium_converged/lr_curves
# results/run_cpu_medium.sh's runs with these overrides, the two variable counts side by side, a core each, in
# results/cpu_medium_converged/counting_<N>var/<pe>/seed<k>/ itself (ROOT=runs NAME=...: runs/NAME/ instead), so that
# the committed tree carries the sweep from one machine to the next: each run's config.json, metrics.jsonl (its
# learning curve) and, once it has finished, result.json are committed; checkpoints/ (one each 1000 steps) is ignored
# by git, and an unfinished run's is committed by `bash results/stage_sweep.sh` (about 1.4 MB) to carry it on.
# A run resumes from its checkpoint and a finished run is read back, so the sweep can be stopped and started again,
# in parts, on any machine:
#   nohup bash results/run_cpu_medium_converged.sh &     (or: ... counting_5var, PES=..., SEEDS=...)
# Then: .venv/bin/python -m jaxpe.train.curves results/cpu_medium_converged --out results/cpu_medium_converged/curves
set -euo pipefail
ROOT=${ROOT:-results} NAME=${NAME:-cpu_medium_converged} COPY=0 \
  OVERRIDES="run.steps=${STEPS:-20000} run.eval_every=${EVAL:-250} run.checkpoint_every=1000 \
run.eval_splits=valid,len_x2 optim.min_lr_ratio=1.0 optim.learning_rate=${LR:-3e-4}" \
  exec bash "$(dirname "$0")/run_cpu_medium.sh" "$@"
