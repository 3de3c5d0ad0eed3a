"""The CUDA command-line tools that compile and read the fused kernels for an H100 on a machine without a GPU: where
ptxas and nvdisasm are, and their versions. tools/compile_report.py and benchmarks/kernel_cost.py import it (a module
beside them, not part of the wheel).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Sequence


class ToolchainMissing(RuntimeError):
    """The CUDA plugin of jax (XLA's Triton compiler), ptxas or nvdisasm is not installed."""


def find_cuda_tool(name: str, explicit: str | None, wheel_dirs: Sequence[str]) -> str | None:
    """An executable `name` ("ptxas", "nvdisasm"): `explicit` or $NAME when given (None when not executable), else the
    first of `wheel_dirs` (relative to the `nvidia` wheels' namespace package, e.g. "cu13/bin") that has it, else
    PATH; None when none has it."""
    chosen = explicit or os.environ.get(name.upper())
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in wheel_dirs:
            path = os.path.join(root, sub, name)
            if os.access(path, os.X_OK):
                return path
    return shutil.which(name)


def cuda_tool_version(path: str) -> str:
    """The version `path --version` prints ("13.0.88" of "V13.0.88"), or ToolchainMissing when it fails."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True)
    version = re.search(r"V(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or version is None:
        raise ToolchainMissing(f"{path} --version failed: {out.stderr.strip() or out.stdout.strip()}")
    return version.group(1)
