#!/usr/bin/env bash
# Reproduces results/cpu_small/: every encoding x 2 seeds at the cpu-small preset, one jaxpe-compare per task setting.
# Usage: bash results/run_cpu_small.sh [setting ...]   (default: all settings; each resumes if interrupted and
#        reuses runs that finished; COMPARE=path/to/jaxpe-compare to use another entry point, PES=... SEEDS=... to
#        narrow the sweep; a setting's own --pe wins)
set -euo pipefail
cd "$(dirname "$0")/.."
PES=${PES:-none,learned,sinusoidal,amspe,rope,alibi,relative,cope,cope_gated,corope}
SEEDS=${SEEDS:-0,1}
# Counting programs of up to 16 statements in 64-token blocks (OOD: 17-32 statements at 128), so that the 60 runs of
# the three variable counts fit in well under an hour on 2 cores.
COUNTING="task.max_steps=16 task.seq_len=64"
declare -A SETTINGS=(
  [selective_copy]="--task selective_copy"
  [flipflop]="--task flipflop"
  [counting_1var]="--task counting task.nvars=1 $COUNTING"
  [counting_3var]="--task counting task.nvars=3 $COUNTING"
  [counting_5var]="--task counting task.nvars=5 $COUNTING"
  [lm]="--task lm task.seq_len=64"
  # CoPE alone with smaller position tables: does flip-flop at length 64 need fewer than 64 rows?
  [flipflop_cope_npos8]="--task flipflop --pe cope model.pe_options.npos=8"
  [flipflop_cope_npos16]="--task flipflop --pe cope model.pe_options.npos=16"
  # ... or more steps? CoPE and NoPE trained 3x longer.
  [flipflop_1500steps]="--task flipflop --pe cope,none run.steps=1500"
)
ORDER=(selective_copy flipflop counting_1var counting_3var counting_5var lm flipflop_cope_npos8 flipflop_cope_npos16
       flipflop_1500steps)
for name in "${@:-${ORDER[@]}}"; do
  # shellcheck disable=SC2086
  ${COMPARE:-.venv/bin/jaxpe-compare} --preset cpu-small --pe "$PES" --seeds "$SEEDS" --workdir "runs/cpu_small/$name" \
    ${SETTINGS[$name]} run.progress=false
  mkdir -p "results/cpu_small/$name"
  cp "runs/cpu_small/$name"/compare.{json,md,png} "results/cpu_small/$name/"
done
