#!/usr/bin/env bash
# Reproduces results/cpu_small/: every encoding x 3 seeds at the cpu-small preset (evaluation sets of 1000 sequences
# per split; language modelling scores 65536 bytes per split), one jaxpe-compare per task setting.
# Time: the first sweep (205 runs, no fox or stickbreaking) took 62 minutes on this 2-core machine, two settings at a
# time (JOBS=2) with one XLA thread each; fox and stickbreaking (30 runs: PES=fox,stickbreaking JOBS=1 over
# selective_copy flipflop counting_1var counting_3var counting_5var, 50 steps a dispatch) took 21 minutes more on the
# same machine shared with other work. Their lm runs are not committed yet (lm's table lacks them).
# Usage: bash results/run_cpu_small.sh [setting ...]   (default: all settings; each resumes if interrupted and
#        reuses runs that finished; COMPARE=path/to/jaxpe-compare to use another entry point, PES=... SEEDS=... to
#        narrow the sweep, JOBS=1 for one setting at a time with XLA's default threads; a setting's own --pe wins)
# Tables: each setting's runs are merged into results/cpu_small/<setting>/compare.json (python -m jaxpe.train.report
# --merge-into: encodings run again replace theirs, the others stay), so PES=fox,stickbreaking adds two encodings to
# the committed tables; `bash results/tables.sh` prints docs/reports/results.md's tables from them. Fifty steps a dispatch
# give the results of one step a dispatch (tests/test_seeds_together.py), sooner.
set -euo pipefail
cd "$(dirname "$0")/.."
PES=${PES:-none,learned,sinusoidal,amspe,rope,alibi,relative,cope,cope_gated,corope,fox,stickbreaking}
SEEDS=${SEEDS:-0,1,2}
JOBS=${JOBS:-2}
# Counting programs of up to 16 statements in 64-token blocks (OOD: 17-32 statements at 128).
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
# Longest first, so that two at a time finish together.
ORDER=(lm counting_5var counting_3var counting_1var selective_copy flipflop flipflop_1500steps flipflop_cope_npos8
       flipflop_cope_npos16)
if [ "$JOBS" -gt 1 ]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false" JAXPE_CPU_DEVICES=1  # a core each
fi
mkdir -p runs/cpu_small
run_setting() {
  local name=$1
  # shellcheck disable=SC2086
  ${COMPARE:-.venv/bin/jaxpe-compare} --preset cpu-small --pe "$PES" --seeds "$SEEDS" --workdir "runs/cpu_small/$name" \
    ${SETTINGS[$name]} run.progress=false run.steps_per_dispatch=50 > "runs/cpu_small/$name.log" 2>&1 || {
    echo "$name failed: runs/cpu_small/$name.log"; tail -20 "runs/cpu_small/$name.log"; touch "runs/cpu_small/$name.failed"
    return 1; }
  ${PY:-.venv/bin/python} -m jaxpe.train.report --merge-into "results/cpu_small/$name" "runs/cpu_small/$name"
  echo "$name done ($SECONDS s)"
}
names=("${@:-${ORDER[@]}}")
for name in "${names[@]}"; do
  [ -n "${SETTINGS[$name]+x}" ] || { echo "unknown setting $name (known: ${ORDER[*]})"; exit 2; }
  rm -f "runs/cpu_small/$name.failed"
done
for name in "${names[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  run_setting "$name" &
done
wait
for name in "${names[@]}"; do [ ! -e "runs/cpu_small/$name.failed" ] || exit 1; done
