#!/usr/bin/env bash
# Prints docs/reports/results.md's tables from the committed compare.json files (python -m jaxpe.train.report); paste
# its output there after a rerun (tests/test_readme_results.py compares the two).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
R=results/cpu_small
echo "**Selective copy** (token error %, 8 symbols among 16 blanks; dense 8, sparse 32 blanks):"; echo
$PY -m jaxpe.train.report $R/selective_copy --labels copy
echo; echo "**Flip-flop** (error % on read bits; length 64; train p(i)=0.8, sparse 0.98, dense 0.1):"; echo
$PY -m jaxpe.train.report $R/flipflop --labels flip-flop
echo; echo "CoPE alone on the same flip-flop with smaller position tables (npos 8, 16; the table above uses 64):"; echo
$PY -m jaxpe.train.report $R/flipflop_cope_npos8 $R/flipflop_cope_npos16 --labels "npos 8,npos 16"
echo; echo "CoPE and no positions on the same flip-flop trained 3× longer (1500 steps):"; echo
$PY -m jaxpe.train.report $R/flipflop_1500steps --labels "1500 steps"
echo; echo "**Counting** (answer error %, programs of 3–16 statements in 64-token blocks; len_x2: 17–32 statements):"; echo
$PY -m jaxpe.train.report $R/counting_1var $R/counting_3var $R/counting_5var --splits test,len_x2 --labels "1 var,3 vars,5 vars"
echo; echo "**Language modelling** (bits per byte, standard-library Python bytes, trained at 64, evaluated at 64/128/256):"; echo
$PY -m jaxpe.train.report $R/lm --labels lm
M=results/cpu_medium
echo; echo "**Counting at cpu-medium** (answer error %, programs of 3–64 statements in 128-token blocks, 10k training programs, 1000 steps; len_x2: 65–128 statements at 256):"; echo
$PY -m jaxpe.train.report $M/counting_3var $M/counting_5var --splits test,len_x2 --labels "3 vars,5 vars"
C=results/cpu_medium_converged
echo; echo "**Counting at cpu-medium trained until it stops improving** (the same programs and model, 20000 steps at a constant learning rate of 3e-4 after warmup):"; echo
$PY -m jaxpe.train.report $C/counting_3var $C/counting_5var --splits test,len_x2 --labels "3 vars,5 vars"
