"""glibc malloc settings for a training process: freed memory stays with the process for the next step.

XLA's CPU runtime allocates a step's buffers afresh each step and frees them at its end. With glibc's defaults a
block over 128 KiB is its own mmap and free memory at the top of the heap goes back to the kernel, so every step
touches fresh pages: ~30 000 page faults (and a quarter of the CPU time in the kernel) per counting step of
benchmarks/train_step.py, which `keep_freed_memory` cuts to ~10 000 and the 2-device step by ~25 %. The price is a
resident set that stays at its peak; the process gives memory back only when over 1 GiB is free at the heap's top.
"""
from __future__ import annotations

import ctypes
import os

# mallopt's parameter numbers (glibc's malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    M_TRIM_THRESHOLD: 1 << 30,  # give memory back only when 1 GiB is free at the heap's top
    M_TOP_PAD: 64 << 20,  # grow (and keep) the heap by 64 MiB more than asked
    M_MMAP_THRESHOLD: 32 << 20,  # blocks up to 32 MiB (glibc's largest threshold) come from the heap, not an mmap
}
# a user's own malloc settings win: then nothing is changed
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")
OPT_OUT = "JAXPE_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Set glibc's trim threshold, top pad and mmap threshold (`SETTINGS`) so that a step reuses the pages the last
    one freed. Returns whether they were set: not off glibc, not when $JAXPE_KEEP_FREED_MEMORY is "0", not when the
    environment sets its own (`USER_SETTINGS` or glibc.malloc tunables). Call it once, before training; the entry
    points do."""
    if os.environ.get(OPT_OUT, "1") == "0" or not _glibc():
        return False
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in SETTINGS.items()])


def _glibc() -> bool:
    """Whether this process runs on glibc (its confstr names it; other C libraries do not know the name)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False
