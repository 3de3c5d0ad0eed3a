#!/usr/bin/env bash
# Stages results/run_cpu_medium_converged.sh's sweep for a commit, so that a clone carries it on where this machine
# left it: every run's config.json and metrics.jsonl, result.json where it has finished, and the checkpoints (git
# ignores them) of the runs that have not (about 1.4 MB each); a finished run's checkpoints leave the index.
# Usage: bash results/stage_sweep.sh && git commit -m "..."     (NAME=...: results/NAME/ instead)
set -euo pipefail
cd "$(dirname "$0")/.."
root=results/${NAME:-cpu_medium_converged}
git rm -r -q --cached --ignore-unmatch -- "$root"/counting_*var/*/seed*/checkpoints
git add -- "$root"
for run in "$root"/counting_*var/*/seed*; do
  if [ ! -e "$run/result.json" ] && [ -d "$run/checkpoints" ]; then git add -f -- "$run/checkpoints"; fi
done
git diff --cached --stat -- "$root" | tail -1 >&2
