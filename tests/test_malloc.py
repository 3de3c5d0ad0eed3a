"""The glibc malloc settings of the entry points (jaxpe.train._malloc), seen through glibc's own mallinfo2: with them
a large block comes from the heap, not an mmap of its own, the heap grows by the top pad and keeps the block's memory
once it is freed; with glibc's defaults the same block is its own mmap, handed back when freed. A user's own
malloc settings, the opt-out variable and other C libraries leave the allocator alone."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxpe.train import _malloc

GLIBC = _malloc._glibc()
HAS_MALLINFO2 = GLIBC and hasattr(ctypes.CDLL(None), "mallinfo2")  # glibc >= 2.33
MIB = 1 << 20

BLOCK = 24 * MIB  # under the 32 MiB mmap threshold the settings make, over glibc's default 128 KiB

# In a fresh process: the settings made or not (argv[1]), then one BLOCK allocated, written and freed; prints as JSON
# whether the settings were made and glibc's mallinfo2 before, with the block live and after its free.
ONE_BLOCK = textwrap.dedent(f"""
    import ctypes, json, sys
    made = False
    if sys.argv[1] == "1":  # only then jaxpe (and jax) is imported: glibc's defaults see a bare interpreter's heap
        from jaxpe.train import _malloc
        made = _malloc.keep_freed_memory()
    FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    info = lambda: dict((name, getattr(libc.mallinfo2(), name)) for name in FIELDS)
    before = info()
    block = libc.malloc({BLOCK})
    ctypes.memset(block, 1, {BLOCK})
    live = info()
    libc.free(block)
    print(json.dumps(dict(made=made, before=before, live=live, freed=info())))
""")


def one_block(keep: bool) -> dict:
    """{made: settings made, before/live/freed: mallinfo2 before the block, with it live, after its free}."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("MALLOC_") and name not in ("GLIBC_TUNABLES", _malloc.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", ONE_BLOCK, "1" if keep else "0"], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout)


@pytest.mark.skipif(not HAS_MALLINFO2, reason="glibc's mallopt and mallinfo2")
def test_a_large_block_comes_from_the_heap_and_stays_there_when_freed():
    got = one_block(True)
    before, live, freed = got["before"], got["live"], got["freed"]
    assert got["made"]
    assert live["hblks"] == before["hblks"]  # under the mmap threshold: served by the heap, no mapping of its own
    assert before["fordblks"] < BLOCK  # the heap must grow for it: by the block and the top pad, less its free top
    assert live["arena"] - before["arena"] >= BLOCK + _malloc.SETTINGS[_malloc.M_TOP_PAD] - before["fordblks"]
    assert freed["arena"] == live["arena"]  # under the 1 GiB trim threshold: nothing handed back
    assert freed["fordblks"] >= BLOCK  # the freed block waits in the heap for the next step


@pytest.mark.skipif(not HAS_MALLINFO2, reason="glibc's mallopt and mallinfo2")
def test_glibc_defaults_map_the_same_block_on_its_own_and_hand_it_back():
    got = one_block(False)
    before, live, freed = got["before"], got["live"], got["freed"]
    assert not got["made"]
    assert live["hblks"] == before["hblks"] + 1 and live["hblkhd"] - before["hblkhd"] >= BLOCK  # its own mapping
    assert freed["hblks"] == before["hblks"] and freed["hblkhd"] == before["hblkhd"]  # unmapped when freed


@pytest.mark.parametrize("name, value", [("JAXPE_KEEP_FREED_MEMORY", "0"), ("MALLOC_TOP_PAD_", "0"),
                                         ("MALLOC_TRIM_THRESHOLD_", "131072"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_user_settings_win(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert _malloc.keep_freed_memory() is False


def test_other_c_libraries_are_left_alone(monkeypatch):
    def confstr(name: str) -> str:  # as on musl or macOS: the name is unknown there
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(_malloc.os, "confstr", confstr)
    assert _malloc._glibc() is False
    assert _malloc.keep_freed_memory() is False
