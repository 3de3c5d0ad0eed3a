"""keep_freed_memory: with it, glibc serves the next round of large allocations from the pages the last round freed
(no fresh page faults); without it the same rounds fault every page again. A user's own malloc settings, the
opt-out variable and other C libraries leave the allocator alone."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxpe.train import _malloc as malloc

GLIBC = malloc._glibc()

# Rounds of large blocks (1–7 MiB, 32 MiB together) written and freed, as a training step's buffers are; prints
# whether the settings were made and the page faults of rounds 2..11.
ROUNDS = textwrap.dedent("""
    import ctypes, resource, sys
    from jaxpe.train import _malloc as malloc
    made = malloc.keep_freed_memory() if sys.argv[1] == "1" else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    sizes = [s << 20 for s in (1, 2, 3, 5, 7, 7, 7)]
    def one_round():
        blocks = [libc.malloc(size) for size in sizes]
        for block, size in zip(blocks, sizes):
            ctypes.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        one_round()
    print(made, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def page_faults(keep: bool) -> tuple[bool, int]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("MALLOC_") and name not in ("GLIBC_TUNABLES", malloc.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", ROUNDS, "1" if keep else "0"], capture_output=True, text=True,
                         check=True, env=env)
    made, faults = out.stdout.split()
    return made == "True", int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_pages_are_reused():
    made, kept = page_faults(True)
    _, default = page_faults(False)
    assert made
    # 10 rounds of 32 MiB are ~80 000 pages: glibc's defaults give most of them back and fault them in again
    assert default > 20_000, default
    assert kept < default / 20, (kept, default)


@pytest.mark.parametrize("name, value", [("JAXPE_KEEP_FREED_MEMORY", "0"), ("MALLOC_TOP_PAD_", "0"),
                                         ("MALLOC_TRIM_THRESHOLD_", "131072"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_user_settings_win(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert malloc.keep_freed_memory() is False


def test_other_c_libraries_are_left_alone(monkeypatch):
    def confstr(name: str) -> str:  # as on musl or macOS: the name is unknown there
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(malloc.os, "confstr", confstr)
    assert malloc._glibc() is False
    assert malloc.keep_freed_memory() is False
