#!/usr/bin/env bash
# The CoPE paper's Table 3 at its scale on one GPU, in resumable slices (benchmarks/paper_sweep.py says how):
#   benchmarks/paper_sweep_gpu.sh DEST              # as many cells as --time-limit (default 540 s) allows; again to go on
#   benchmarks/paper_sweep_gpu.sh --dry-run DEST    # a tiny scale on CPU (CI runs it)
# Extra flags pass through (--time-limit S, --nvars 3,1,5, --pe ..., --plan-only, key=value overrides).
# $PYTHON is the interpreter with jaxpe installed (default: python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [[ " $* " == *" --dry-run "* ]]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fi
exec "${PYTHON:-python3}" "$here/paper_sweep.py" "$@"
