"""A cost model of the fused GPU kernels for an H100, read from their machine code (SASS), on a machine without a GPU.

    python benchmarks/kernel_cost.py --out results/cost                 # kernel_cost.json and kernel_cost.md there
    python benchmarks/kernel_cost.py --out /tmp/cost --quick            # D 64, GQA 8/2, npos 64 only
    python benchmarks/kernel_cost.py --no-write --ops corope            # print the table only
    python benchmarks/kernel_cost.py --out results/cost --authors-file PATH   # also the Co-RoPE authors' forward
    python benchmarks/kernel_cost.py --out results/cost --authors-from results/cost/kernel_cost.json  # keep theirs

Every kernel of tools/compile_report.py's grid (CoPE and Co-RoPE on both GPU paths, forgetting and stick-breaking
attention on the Pallas one; f32/bf16, D 64/128/256, GQA 8/2 and MHA 8/8, CoPE npos 64/513, L 1024) is compiled as the
compile report does (the Pallas kernels lowered and compiled by
XLA's Triton compiler from jax's CUDA plugin; the native Triton kernels' launches recorded and compiled by Triton's own
compiler as jax-triton compiles them; then `ptxas -arch=sm_90a`), and its cubin disassembled with nvdisasm (the
`nvidia-cuda-nvdisasm` wheel of the ptxas version). From the SASS control flow (backward branches; natural loops) the
tool finds the kernel's outermost loops, which walk the key blocks, and counts the instructions one iteration issues per
warp, by class, each inner loop (rotary chunks, head-dim column slices) times its trip count read from its counter
(start, step and bound in the SASS). Per logit: count × warps / (BQ·BK·H), H query heads per program. The throughput
bound per logit, in SM clocks, is the largest over the SM's pipes (issue, FP32, integer ALU, MUFU/conversions, shuffles,
shared memory, tensor cores) of the work per logit over the pipe's rate (RATES: NVIDIA's numbers, with their sources).
jax's own Pallas flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`, MHA: it has no GQA) compiled the same
way at the same tiles, and at its defaults, is the plain attention the kernels are compared with. TARGETS are the costs
the kernels are held to, checked per path (`targets`). docs/reports/kernel_cost.md explains the method and reads the
table.

A benchmark script beside the library (not in the wheel); it needs what tools/compile_report.py needs (.venv-compile:
jax 0.10 with jax-cuda13-plugin, nvidia-cuda-nvcc, triton and jax-triton 0.3.1 for the native path) and
nvidia-cuda-nvdisasm (`make test-compile` builds that venv); pip `triton` for --authors-file.
"""
from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import dataclasses
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


# The compile report's grid, lowering and compilers (tools/compile_report.py) and the CUDA tools they both find
# (tools/cuda_tools.py): modules beside the library, not in the wheel, on the path from tools/.
sys.path.insert(0, str(ROOT / "tools"))
import compile_report as cr  # noqa: E402
from cuda_tools import ToolchainMissing, cuda_tool_version, find_cuda_tool  # noqa: E402
from jaxpe.kernels import cope_pallas, corope_pallas, fox_pallas, stickbreaking_pallas  # noqa: E402
from jaxpe.kernels._common import tile_extent  # noqa: E402

# ------------------------------------------------------------------------------------------------- the device

GUIDE = "NVIDIA CUDA C++ Programming Guide"
DEVICE = {
    "name": "NVIDIA H100 SXM5",
    "sm": "sm_90a",
    "sms": 132,
    "boost_clock_mhz": 1830,
    "source": "NVIDIA H100 Tensor Core GPU Architecture (whitepaper): 132 SMs; with the tensor rate below, "
              "132 × 2048 × 2 FLOP × 1.83 GHz = 989 TFLOPS, its dense BF16 peak",
}
# Per SM per clock. Lanes: thread operations (32 per warp-instruction); bytes: shared memory data path.
RATES = {
    "issue": {"value": 4, "unit": "warp-instructions/clk",
              "source": f"{GUIDE}, Compute Capability 9.0 (as 8.x): 4 warp schedulers per SM, each issuing one "
                        "instruction per clock"},
    "fp32": {"value": 128, "unit": "lanes/clk",
             "source": f"{GUIDE}, Arithmetic Instructions, Throughput of Native Arithmetic Instructions, cc 9.0: "
                       "32-bit floating-point add, multiply, multiply-add"},
    "imad": {"value": 64, "unit": "lanes/clk",
             "source": f"{GUIDE}, same table: 32-bit integer multiply, multiply-add; on the FMA pipe's heavy half "
                       "(NVIDIA Nsight Compute Kernel Profiling Guide, pipelines fmaheavy/fmalite)"},
    "alu": {"value": 64, "unit": "lanes/clk",
            "source": f"{GUIDE}, same table: 32-bit integer add, shift, bitwise, compare/minimum/maximum; the ALU "
                      "pipe also runs FP32 compare/select and FP32-to-16-bit packing (Nsight Compute Kernel "
                      "Profiling Guide, pipeline alu)"},
    "xu": {"value": 16, "unit": "lanes/clk",
           "source": f"{GUIDE}, same table: 32-bit floating-point reciprocal, reciprocal square root, log2, exp2, "
                     "sine, cosine (MUFU) and 'all other type conversions'; one pipe (Nsight Compute Kernel "
                     "Profiling Guide, pipeline xu: transcendentals and int/float conversions)"},
    "shfl": {"value": 32, "unit": "lanes/clk", "source": f"{GUIDE}, same table: warp shuffle"},
    "shared": {"value": 128, "unit": "bytes/clk",
               "source": f"{GUIDE}, Compute Capability 5.x+ Shared Memory: 32 banks, each 32 bits per clock "
                         "(bank conflicts not modelled: a lower bound)"},
    "tensor_bf16": {"value": 2048, "unit": "dense MAC/clk",
                    "source": "NVIDIA H100 Tensor Core GPU Architecture (whitepaper): twice the A100 SM's dense "
                              "FP16/BF16 rate clock for clock; NVIDIA A100 Tensor Core GPU Architecture "
                              "(whitepaper): 256 FP16 FMA/clk per tensor core, 4 per SM"},
    "tensor_tf32": {"value": 1024, "unit": "dense MAC/clk",
                    "source": "NVIDIA H100 Tensor Core GPU Architecture (whitepaper): dense TF32 at half the "
                              "BF16 rate"},
}

# ------------------------------------------------------------------------------------------------------- SASS

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Za-z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^\s*([.$\w]+):\s*$")
_SECTION = re.compile(r"^\s*\.section\s+\.text\.([\w$.]+)")
_TARGET = re.compile(r"`\(([^)]+)\)")
_REGISTER = re.compile(r"^-?\|?(U?R(?:\d+|Z))\|?(?:\.reuse)?$")
_PREDICATE = re.compile(r"!?U?P(?:\d|T)")


class SassError(ValueError):
    """SASS the cost model cannot read: an unknown control transfer, a loop without a readable trip count."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One SASS instruction: address, guard predicate ("@P0", "@!PT", None), opcode with modifiers, operand text."""

    address: int
    predicate: str | None
    opcode: str
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def args(self) -> list[str]:
        return [a.strip() for a in self.operands.split(",")] if self.operands else []

    @property
    def target(self) -> str | None:
        m = _TARGET.search(self.operands)
        return m.group(1) if m else None

    @property
    def never(self) -> bool:
        """Guarded by a false predicate: issued, never executed (padding in fence sequences)."""
        return self.predicate in ("@!PT", "@!UPT")


@dataclasses.dataclass(frozen=True)
class Function:
    """A function's instructions in address order and its labels (label -> instruction index)."""

    name: str
    instructions: tuple[Instruction, ...]
    labels: dict[str, int]


def parse_sass(text: str) -> dict[str, Function]:
    """nvdisasm's listing: one Function per .text section."""
    functions, name, instructions, labels, pending = {}, None, [], {}, []

    def close() -> None:
        if name is not None:
            functions[name] = Function(name, tuple(instructions), dict(labels))

    for line in text.splitlines():
        if m := _SECTION.match(line):
            close()
            name, instructions, labels, pending = m.group(1), [], {}, []
        elif m := _INSTRUCTION.match(line):
            for label in pending:
                labels[label] = len(instructions)
            pending = []
            instructions.append(Instruction(int(m.group(1), 16), m.group(2), m.group(3), m.group(4)))
        elif m := _LABEL.match(line):
            pending.append(m.group(1))
    close()
    return functions


_CONTROL = {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "KILL", "CALL"}


def _conditional(inst: Instruction) -> bool:
    """A branch that may fall through: guarded, on a uniform predicate operand, or on divergence."""
    guarded = inst.predicate not in (None, "@PT", "@UPT")
    on_operand = any(re.fullmatch(r"!?U?P\d", a) for a in inst.args[:-1])
    return guarded or on_operand or bool({"DIV", "CONV"} & set(inst.opcode.split(".")[1:]))


@dataclasses.dataclass(frozen=True)
class Block:
    """Instructions [start, end) of a function, and the blocks control may go to next."""

    start: int
    end: int
    successors: tuple[int, ...]


def basic_blocks(fn: Function) -> list[Block]:
    """The control-flow graph: leaders are the entry, every label and every instruction after a control transfer."""
    n = len(fn.instructions)
    leaders = {0, *fn.labels.values()}
    leaders |= {i + 1 for i, inst in enumerate(fn.instructions) if inst.base in _CONTROL}
    starts = sorted(s for s in leaders if s < n)
    block_of = {s: b for b, s in enumerate(starts)}
    blocks = []
    for b, start in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else n
        last = fn.instructions[end - 1]
        falls = [b + 1] if b + 1 < len(starts) else []
        if last.base in ("BRX", "JMX", "JMP"):
            raise SassError(f"{fn.name}: indirect or absolute jump at {last.address:#x}: {last.opcode}")
        if last.base == "BRA":
            if last.target not in fn.labels:
                raise SassError(f"{fn.name}: branch at {last.address:#x} to unknown label {last.target!r}")
            successors = [block_of[fn.labels[last.target]]] + (falls if _conditional(last) else [])
        elif last.base in ("EXIT", "RET", "KILL"):
            successors = falls if _conditional(last) else []
        else:
            successors = falls
        blocks.append(Block(start, end, tuple(dict.fromkeys(successors))))
    return blocks


@dataclasses.dataclass
class Loop:
    """A natural loop: its header block, its blocks (header included), latches, and the loops nested in it."""

    header: int
    blocks: frozenset[int]
    latches: tuple[int, ...]
    children: list[Loop] = dataclasses.field(default_factory=list)


def find_loops(blocks: Sequence[Block]) -> list[Loop]:
    """The outermost loops of the reachable graph, in address order, children nested. A loop is closed by a backward
    branch (target at or before the branch); its body is every block that reaches the branch without passing the
    header."""
    reachable, todo = set(), [0]
    while todo:
        b = todo.pop()
        if b not in reachable:
            reachable.add(b)
            todo.extend(blocks[b].successors)
    predecessors = collections.defaultdict(set)
    for b in reachable:
        for s in blocks[b].successors:
            predecessors[s].add(b)
    latches = collections.defaultdict(list)
    for b in sorted(reachable):
        for s in blocks[b].successors:
            if s <= b:
                latches[s].append(b)
    loops = []
    for header, ends in sorted(latches.items()):
        body, todo = {header}, list(ends)
        while todo:
            b = todo.pop()
            if b not in body:
                body.add(b)
                todo.extend(predecessors[b])
        loops.append(Loop(header, frozenset(body), tuple(ends)))
    outermost = []
    for loop in sorted(loops, key=lambda x: (len(x.blocks), x.header)):  # smallest first: each joins its parent
        parents = [p for p in loops if p is not loop and loop.header in p.blocks and len(p.blocks) > len(loop.blocks)]
        if parents:
            min(parents, key=lambda p: len(p.blocks)).children.append(loop)
        else:
            outermost.append(loop)
    for loop in loops:
        loop.children.sort(key=lambda x: x.header)
    return sorted(outermost, key=lambda x: x.header)


# ------------------------------------------------------------------------------------------------ trip counts

Value = tuple  # ("const", v) or ("entry", register, offset): the register's value at the loop's entry, plus offset


def _immediate(text: str) -> int | None:
    text = text.strip()
    try:
        return int(text, 16) if text.lower().startswith(("0x", "-0x")) else int(text)
    except ValueError:
        return None


def _written(inst: Instruction) -> list[str]:
    """The general or uniform registers an instruction writes: its first operand (its second after a predicate
    output, as in `LOP3.LUT P5, R49, ...`), as many as the write is wide."""
    a = inst.args
    first = 1 if a and re.fullmatch(r"U?P(?:\d|T)", a[0]) and len(a) > 1 else 0
    m = _REGISTER.match(a[first]) if a else None
    if m is None or m.group(1) in ("RZ", "URZ") or a[first].startswith(("-", "|")):
        return []
    prefix, number = re.fullmatch(r"(U?R)(\d+)", m.group(1)).groups()
    mods = set(inst.opcode.split(".")[1:])
    wide_ldsm = inst.base in ("LDSM", "LDTM")
    width = (4 if inst.base in ("HMMA", "HGMMA") or "128" in mods or wide_ldsm and "4" in mods
             else 2 if inst.base == "CS2R" or mods & {"64", "WIDE"} or wide_ldsm and "2" in mods else 1)
    return [f"{prefix}{int(number) + i}" for i in range(width)]


def _half_pair(high: str, low: str) -> int | None:
    """The 32-bit value HFMA2 -RZ, RZ, high, low writes (a constant-materialising idiom)."""
    try:
        halves = np.array([float(low), float(high)], np.float16)
    except ValueError:
        return None
    return int(halves.view(np.uint32)[0])


def _constant_write(inst: Instruction) -> int | None:
    """The constant an instruction writes to its destination, when it is one of the constant idioms."""
    a = inst.args
    if inst.predicate is not None or not a:
        return None
    operand = None
    if inst.base in ("MOV", "MOV32I", "UMOV") and len(a) == 2:
        operand = a[1]
    elif inst.opcode.startswith("IMAD.MOV") and len(a) == 4 and a[1] in ("RZ", "URZ") and a[2] in ("RZ", "URZ"):
        operand = a[3]
    elif inst.base == "CS2R" and a[1] == "SRZ":
        return 0
    elif inst.base == "HFMA2" and len(a) == 5 and a[1] == "-RZ" and a[2] == "RZ":
        return _half_pair(a[3], a[4])
    if operand in ("RZ", "URZ"):
        return 0
    return None if operand is None else _immediate(operand)


def _operand_value(text: str, state: dict[str, Value]) -> Value | None:
    negate = text.startswith("-")
    text = text.lstrip("-").removesuffix(".reuse")
    if text in ("RZ", "URZ"):
        return ("const", 0)
    if (imm := _immediate(text)) is not None:
        return ("const", -imm if negate else imm)
    if re.fullmatch(r"U?R\d+", text):
        value = state.get(text, ("entry", text, 0))
        if value is None or negate and value[0] != "const":
            return None
        return ("const", -value[1]) if negate else value
    return None


def _sum(values: Iterable[Value | None]) -> Value | None:
    """Sum of values with at most one register term."""
    total, register = 0, None
    for v in values:
        if v is None:
            return None
        if v[0] == "const":
            total += v[1]
        elif register is None:
            register, total = v[1], total + v[2]
        else:
            return None
    return ("const", total) if register is None else ("entry", register, total)


def _step(inst: Instruction, state: dict[str, Value]) -> None:
    """Track a register's value through one instruction (sums and moves of constants and one register)."""
    written = _written(inst)
    if not written:
        return
    a, value, mods = inst.args, None, inst.opcode.split(".")[1:]
    if inst.predicate is None:
        if inst.base in ("IADD3", "UIADD3", "VIADD", "IADD", "UIADD") and len(a) >= 3 and "X" not in mods:
            value = _sum(_operand_value(x, state) for x in a[1:] if not _PREDICATE.fullmatch(x))  # carry-outs
        elif inst.opcode in ("IMAD.IADD", "UIMAD.IADD") and len(a) == 4 and _immediate(a[2]) == 1:
            value = _sum(_operand_value(x, state) for x in (a[1], a[3]))
        elif (c := _constant_write(inst)) is not None:
            value = ("const", c)
        elif inst.base in ("MOV", "UMOV") and len(a) == 2 or inst.opcode.startswith("IMAD.MOV") and len(a) == 4:
            value = _operand_value(a[-1], state)
    for i, register in enumerate(written):
        state[register] = value if i == 0 or inst.base == "CS2R" else None


_COMPARE = {"LT": lambda x, y: x < y, "LE": lambda x, y: x <= y, "GT": lambda x, y: x > y,
            "GE": lambda x, y: x >= y, "EQ": lambda x, y: x == y, "NE": lambda x, y: x != y}


def _entry_value(fn: Function, blocks: Sequence[Block], block: int, register: str) -> int | None:
    """The constant `register` holds when control leaves `block`, if every path to it through earlier blocks sets the
    same constant (the last write on each path)."""
    values, seen, todo = set(), set(), [block]
    while todo:
        b = todo.pop()
        if b in seen:
            continue
        seen.add(b)
        for inst in reversed(fn.instructions[blocks[b].start:blocks[b].end]):
            if register in (written := _written(inst)):
                values.add(_constant_write(inst) if written[0] == register or inst.base == "CS2R" else None)
                break
        else:
            earlier = [p for p in range(b) if b in blocks[p].successors]
            values.update([] if earlier else [None])  # the entry reached without a write: unknown
            todo.extend(earlier)
    return values.pop() if len(values) == 1 else None


def trip_count(fn: Function, blocks: Sequence[Block], loop: Loop, limit: int = 4096) -> int:
    """How often a loop with a constant trip count runs: its counter's start (a constant set before the loop), step
    (a constant added in the loop) and the compare that guards the backward branch."""
    where = f"{fn.name}: loop at {fn.instructions[blocks[loop.header].start].address:#x}"
    if len(loop.latches) != 1:
        raise SassError(f"{where}: {len(loop.latches)} backward branches")
    branch = fn.instructions[blocks[loop.latches[0]].end - 1]
    guard = branch.predicate or (branch.args[0] if len(branch.args) > 1 else None)  # BRA.U !UP0, `(label)
    if branch.base != "BRA" or guard in (None, "@PT", "@UPT"):
        raise SassError(f"{where}: the backward branch at {branch.address:#x} has no guard predicate")
    inner = set().union(*(c.blocks for c in loop.children)) if loop.children else set()
    state: dict[str, Value] = {}
    compares: dict[str, tuple | None] = {}  # predicate -> (operator, left, right, negated)
    for b in sorted(loop.blocks):
        for inst in fn.instructions[blocks[b].start:blocks[b].end]:
            if b in inner:
                for register in _written(inst):
                    state[register] = None
                compares.update(dict.fromkeys(x for x in inst.args[:2] if re.fullmatch(r"U?P\d", x)))
                continue
            a, mods = inst.args, inst.opcode.split(".")
            chained = compares.get(a[5]) if len(a) == 6 else None  # read before the outputs are reset
            compares.update(dict.fromkeys(x for x in a[:2] if re.fullmatch(r"U?P\d", x)))  # predicate outputs
            if inst.base in ("ISETP", "UISETP") and len(a) == 6 and "EX" in mods and a[3] in ("RZ", "URZ"):
                # the high words of a 64-bit compare against a bound below 2**32: the low words' compare decides
                # while the counter stays below 2**32 (trip counts here are far smaller)
                compares[a[0]] = chained if inst.predicate is None and a[4] in ("PT", "UPT") else None
            elif inst.base in ("ISETP", "UISETP") and len(a) == 5:
                plain = inst.predicate is None and a[4] in ("PT", "UPT") and mods[-1] == "AND"
                compares[a[0]] = (mods[1], _operand_value(a[2], state), _operand_value(a[3], state), False) if (
                    plain) else None
            elif inst.base in ("PLOP3", "UPLOP3") and len(a) == 7 and _immediate(a[5]) in (0x80, 0x40):
                # the AND of two trues and one predicate (LUT 0x80), or of its negation (0x40)
                sources = [x for x in a[2:5] if x not in ("PT", "UPT")]
                copied = compares.get(sources[0].lstrip("!")) if len(sources) == 1 and a[4] == sources[0] else None
                flip = sources[0].startswith("!") != (_immediate(a[5]) == 0x40) if copied else False
                compares[a[0]] = copied and (*copied[:3], copied[3] != flip)
            else:
                _step(inst, state)
    compare = compares.get(guard.lstrip("@!"))
    if compare is None or None in compare[1:3]:
        raise SassError(f"{where}: no readable compare guards the backward branch at {branch.address:#x}")
    operator, left, right, flipped = compare
    negated = guard.lstrip("@").startswith("!") != flipped
    stepped = {v[1] for v in (left, right) if v[0] == "entry" and (s := state.get(v[1])) is not None
               and s[0] == "entry" and s[1] == v[1] and s[2] != 0}
    if len(stepped) != 1:
        raise SassError(f"{where}: the guard compares {left} with {right}: not one counter stepped by a constant")
    counter = stepped.pop()
    preheaders = [p for p in range(len(blocks)) if loop.header in blocks[p].successors and p not in loop.blocks]

    def start(register: str) -> int:  # signed: a 64-bit counter from -4 is 0xfffffffc in its low word
        values = {_entry_value(fn, blocks, p, register) for p in preheaders}
        if len(values) != 1 or None in values:
            raise SassError(f"{where}: {register} holds no known constant before the loop")
        value = values.pop()
        return value - 2 ** 32 if 2 ** 31 <= value < 2 ** 32 else value

    def fixed(v: Value) -> Value:  # a loop-invariant register as the constant it holds
        if v[0] == "entry" and v[1] != counter:
            if v[1] in state:
                raise SassError(f"{where}: the guard's bound {v[1]} changes in the loop")
            return ("const", start(v[1]) + v[2])
        return v

    left, right, value, step = fixed(left), fixed(right), start(counter), state[counter][2]
    at = lambda v: v[1] if v[0] == "const" else value + v[2]  # noqa: E731
    for trips in range(1, limit + 1):
        if _COMPARE[operator](at(left), at(right)) == negated:
            return trips
        value += step
    raise SassError(f"{where}: more than {limit} trips")


# --------------------------------------------------------------------------------------------------- classes

CLASSES = ("mma", "ffma", "fmul", "fadd", "mufu", "fp_other", "convert", "int", "uniform", "ldg", "stg", "lds", "sts",
           "ldgsts", "shfl", "bar", "atomic", "fence", "branch", "nop", "other")
_CLASS_OF = {
    **dict.fromkeys(("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "BMMA", "DMMA"), "mma"),
    **dict.fromkeys(("FFMA", "FFMA32I", "HFMA2"), "ffma"),
    **dict.fromkeys(("FMUL", "FMUL32I", "HMUL2"), "fmul"),
    **dict.fromkeys(("FADD", "FADD32I", "HADD2", "FSWZADD"), "fadd"),
    "MUFU": "mufu",
    **dict.fromkeys(("FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "HMNMX2", "HSETP2", "HSET2"), "fp_other"),
    **dict.fromkeys(("F2I", "I2F", "F2F", "I2FP", "F2IP", "FRND", "I2I", "I2IP", "F2FP"), "convert"),
    **dict.fromkeys(("LDG", "LD", "LDL"), "ldg"),
    **dict.fromkeys(("STG", "ST", "STL"), "stg"),
    **dict.fromkeys(("LDS", "LDSM"), "lds"),
    **dict.fromkeys(("STS", "STSM"), "sts"),
    **dict.fromkeys(("LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG"), "ldgsts"),
    "SHFL": "shfl",
    **dict.fromkeys(("BAR", "SYNCS", "WARPGROUP", "ARRIVES"), "bar"),
    **dict.fromkeys(("ATOMG", "ATOM", "ATOMS", "RED", "REDG"), "atomic"),
    **dict.fromkeys(("MEMBAR", "CCTL", "CCTLL", "FENCE", "ERRBAR", "CGAERRBAR"), "fence"),
    **dict.fromkeys(("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "WARPSYNC", "BREAK", "KILL",
                     "YIELD"), "branch"),
    "NOP": "nop",
    **dict.fromkeys(("S2R", "S2UR", "LDC", "DEPBAR", "LDGDEPBAR", "VOTE", "VOTEU", "MATCH", "REDUX", "CS2R", "R2UR",
                     "B2R", "R2B"), "other"),
}
_INT = {"IADD3", "IADD", "IADD32I", "LEA", "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "ISETP", "ICMP", "IMNMX",
        "VIADD", "VIADDMNMX", "VIMNMX", "VIMNMX3", "SEL", "SGXT", "BMSK", "PRMT", "IABS", "PLOP3", "PSETP", "P2R",
        "R2P", "MOV", "MOV32I", "IMAD", "IMUL", "IMUL32I", "IDP", "IDP4A", "ISCADD", "BREV", "FLO", "POPC", "IMNMX3"}
_IMAD = {"IMAD", "IMUL", "IMUL32I", "IDP", "IDP4A"}
_XU_INT = {"BREV", "FLO", "POPC"}  # the guide's 16/clk rows: bit reverse, leading zeros, population count


def classify(inst: Instruction) -> str:
    """The instruction's class (CLASSES)."""
    if inst.never or inst.base == "NOP":
        return "nop"
    if inst.base in _INT:
        return "int"
    if inst.base in _CLASS_OF:
        return _CLASS_OF[inst.base]
    return "uniform" if inst.base.startswith("U") else "other"


def gpu_scope_fence(opcode: str) -> bool:
    """Whether an opcode orders memory for the whole GPU (or system): `MEMBAR.*.GPU`/`.SYS`, `ERRBAR`, `CCTL.IVALL`
    (the sequence around PTX's acquire-release atomics), not the CTA-scope `MEMBAR.*.CTA` and `FENCE.VIEW.ASYNC`
    that order a CTA's shared-memory stores before Hopper's warpgroup dots read them."""
    base, *mods = opcode.split(".")
    return (base == "MEMBAR" and bool({"GPU", "SYS"} & set(mods))) or base in ("ERRBAR", "CGAERRBAR") or (
        base == "CCTL" and "IVALL" in mods)


def _access_bytes(inst: Instruction) -> int:
    """Bytes a warp moves through shared memory with one LDS/STS/LDSM/STSM/LDGSTS (32 lanes × width; ldmatrix:
    128 bytes per 8x8 matrix)."""
    mods = inst.opcode.split(".")
    if inst.base in ("LDSM", "STSM"):
        return 128 * (int(mods[-1]) if mods[-1] in ("2", "4") else 1)
    width = 16 if "128" in mods else 8 if "64" in mods else 2 if {"U16", "S16"} & set(mods) else (
        1 if {"U8", "S8"} & set(mods) else 4)
    return 32 * width


def _mma(inst: Instruction) -> tuple[str, float, float]:
    """(rate key, multiply-accumulates, shared-memory bytes read) per warp of a tensor-core instruction. HMMA.16nK:
    m16 n8 kK from registers. HGMMA.MxNxK runs per warpgroup of 4 warps (a quarter each), B from shared memory
    (gdesc) and A too when its first source is a descriptor."""
    mods = inst.opcode.split(".")
    kind = "tensor_tf32" if "TF32" in mods else "tensor_bf16"
    if inst.base == "HMMA" and re.fullmatch(r"168\d+", mods[1]):
        return kind, 16 * 8 * int(mods[1][3:]), 0
    if inst.base == "HGMMA" and (m := re.fullmatch(r"(\d+)x(\d+)x(\d+)", mods[1])):
        rows, cols, depth = map(int, m.groups())
        size = 4 if "TF32" in mods else 1 if {"E4M3", "E5M2"} & set(mods) else 2
        a_shared = len(inst.args) > 1 and inst.args[1].startswith("gdesc")
        return kind, rows * cols * depth / 4, (cols + rows * a_shared) * depth * size / 4
    raise SassError(f"tensor-core instruction of unknown shape at {inst.address:#x}: {inst.opcode}")


@dataclasses.dataclass
class Tally:
    """What a stretch of SASS issues per warp: counts by class, memory instructions by opcode, pipe work."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    memory: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    work: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # see `clocks`

    def add(self, inst: Instruction, times: int = 1) -> None:
        kind = classify(inst)
        self.counts[kind] += times
        self.work["issue"] += times
        if kind in ("ldg", "stg", "lds", "sts", "ldgsts", "atomic", "fence"):
            self.memory[inst.opcode] += times
        if kind in ("lds", "sts", "ldgsts") and inst.base not in ("UBLKCP", "UTMALDG", "UTMASTG"):
            self.work["shared_wavefronts"] += times * max(1, _access_bytes(inst) // 128)
        if kind == "nop":
            return
        if kind in ("ffma", "fmul", "fadd"):
            self.work["fp32"] += times
        elif inst.base in _IMAD:
            self.work["imad"] += times
        elif inst.base in _XU_INT or kind == "mufu" or kind == "convert" and inst.base != "F2FP":
            self.work["xu"] += times
        elif kind in ("int", "fp_other") or inst.base == "F2FP":
            self.work["alu"] += times
        elif kind == "shfl":
            self.work["shfl"] += times
        elif kind == "mma":
            rate, macs, shared = _mma(inst)
            self.work[rate] += times * macs
            self.work["shared_wavefronts"] += times * shared / 128

    def merge(self, other: Tally, times: int = 1) -> None:
        for mine, theirs in ((self.counts, other.counts), (self.memory, other.memory), (self.work, other.work)):
            for key, n in theirs.items():
                mine[key] += n * times

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    def clocks(self) -> dict[str, float]:
        """SM clocks per warp's worth of this work on each pipe (RATES): the FP32 pipe runs FP32 arithmetic at 128
        lanes/clk and IMAD on its heavy half at 64; MUFU and conversions share the XU."""
        w, lanes = self.work, 32
        rate = {name: RATES[name]["value"] for name in RATES}
        return {
            "issue": w["issue"] / rate["issue"],
            "fma": max((w["fp32"] + w["imad"]) * lanes / rate["fp32"], w["imad"] * lanes / rate["imad"]),
            "alu": w["alu"] * lanes / rate["alu"],
            "xu": w["xu"] * lanes / rate["xu"],
            "shfl": w["shfl"] * lanes / rate["shfl"],
            "shared": w["shared_wavefronts"] * 128 / rate["shared"],
            "tensor": w["tensor_bf16"] / rate["tensor_bf16"] + w["tensor_tf32"] / rate["tensor_tf32"],
        }


def tally_loop(fn: Function, blocks: Sequence[Block], loop: Loop) -> tuple[Tally, list[int]]:
    """One iteration of a loop: its own blocks once, each nested loop times its trip count; and those trip counts
    (nested loops in address order, depth first)."""
    tally, trips = Tally(), []
    inner = set().union(*(c.blocks for c in loop.children)) if loop.children else set()
    for b in sorted(loop.blocks - inner):
        for inst in fn.instructions[blocks[b].start:blocks[b].end]:
            tally.add(inst)
    for child in loop.children:
        n = trip_count(fn, blocks, child)
        child_tally, child_trips = tally_loop(fn, blocks, child)
        tally.merge(child_tally, n)
        trips += [n, *child_trips]
    return tally, trips


# ----------------------------------------------------------------------------------------------- the kernels

# The outermost loops of each kernel, in address order: (name, counted), by (path, op, kernel) or else (op, kernel).
# Counted loops run once per key block each (their costs add up); an uncounted one takes some key blocks instead of a
# counted one (CoPE's clamped tiles, once every row's position has reached P − 1; the native forward's diagonal
# tiles, the one or two per query block that the causal mask cuts, before the unmasked ones below it; FoX's forward's
# masked tiles, after its unmasked ones).
LOOPS = {
    ("triton", "cope", "forward"): (("diagonal", False), ("positions", True), ("clamped", False)),
    ("triton", "cope", "forward_train"): (("diagonal", False), ("positions", True), ("clamped", False)),
    ("cope", "forward"): (("positions", True), ("clamped", False)),
    ("cope", "forward_train"): (("positions", True), ("clamped", False)),
    ("cope", "backward"): (("clamped", False), ("positions", True)),
    ("corope", "forward"): (("keys", True),),
    ("corope", "forward_train"): (("keys", True),),
    ("corope", "backward"): (("keys", True), ("gates", True)),
    ("fox", "forward"): (("full", True), ("diagonal", False)),
    ("fox", "forward_train"): (("full", True), ("diagonal", False)),
    ("fox", "backward"): (("dkdv diagonal", False), ("dkdv", True), ("dq", True), ("dq diagonal", False)),
    ("stickbreaking", "forward"): (("diagonal", False), ("full", True)),
    ("stickbreaking", "forward_train"): (("diagonal", False), ("full", True)),
    ("stickbreaking", "backward"): (("diagonal", False), ("full", True)),
    ("plain", "forward"): (("keys", True),),
    ("plain", "backward"): (("dkdv", True), ("dq", True)),
}
PLAIN_HEAD_DIMS = (64, 128)
PLAIN_HEADS = 8  # jax's mha has no GQA: MHA 8/8, normalised per logit like the rest


@dataclasses.dataclass(frozen=True)
class Job:
    """One kernel to compile and measure: what it is (JSON fields), what its path's Triton compiler takes (the
    Pallas kernel's Triton IR; the native kernel's launch spec), launch settings and tile."""

    meta: dict[str, Any]
    ir: bytes = dataclasses.field(repr=False)
    num_warps: int
    num_stages: int
    tile: tuple[int, int, int]  # (BQ, BK, H): query rows, keys and query heads of one loop iteration
    trips: frozenset[int] = frozenset()  # the trip counts its inner loops may have (checks the SASS reading)
    error: str | None = None
    path: str = "pallas"  # cr.PATHS: which compiler takes `ir`


def _tile(kernel: Any) -> tuple[tuple[int, int, int], frozenset[int]]:
    """(BQ, BK, H) of a compile-report kernel, from its op's default block sizes, checked against its grid
    (Lp / BQ, B, Hq / H); and the trip counts its inner loops may have: none in CoPE's, FoX's and stick-breaking's
    kernels, Co-RoPE's rotary chunks (D/2 over BD) and head-dim column slices (Dp over DC = min(Dp, 64))."""
    c, backward = kernel.case, kernel.role == "backward"
    dtype = jnp.dtype(c.dtype)
    if kernel.path == "triton":
        tile, trips = _triton_tile(c, json.loads(kernel.spec)["constexprs"])
    elif c.op == "cope":
        b = cope_pallas.BlockSizes().fitted(length=c.length, head_dim=c.head_dim, dtype=dtype, gate_k=False)
        tile, trips = (b.block_q_bwd, b.block_k_bwd, 1) if backward else (b.block_q, b.block_k, 1), frozenset()
    elif c.op == "corope":
        b = corope_pallas.BlockSizes().fitted(length=c.length, head_dim=c.head_dim, dtype=dtype,
                                              groups=c.q_heads // c.kv_heads)
        tile = (b.block_q_bwd, b.block_k_bwd, b.block_h_bwd) if backward else (b.block_q, b.block_k, b.block_h)
        padded = 2 * tile_extent(c.head_dim // 2)
        trips = frozenset({-(-(c.head_dim // 2) // b.block_d), padded // min(padded, 64)})
    elif c.op in ("fox", "stickbreaking"):
        blocks = fox_pallas.BlockSizes if c.op == "fox" else stickbreaking_pallas.BlockSizes
        b = blocks().fitted(length=c.length, head_dim=c.head_dim, dtype=dtype)
        tile, trips = (b.block_q_bwd, b.block_k_bwd, 1) if backward else (b.block_q, b.block_k, 1), frozenset()
    else:
        raise ValueError(f"no tile geometry for op {c.op!r}")
    rows, heads = kernel.grid[0] * tile[0], kernel.grid[2] * tile[2]
    if not c.length <= rows < c.length + tile[0] or heads != c.q_heads:
        raise ValueError(f"grid {kernel.grid} does not match tile {tile} for L {c.length}, {c.q_heads} heads")
    return tile, trips


def _triton_tile(c: Any, constexprs: dict[str, Any]) -> tuple[tuple[int, int, int], frozenset[int]]:
    """(BQ, BK, H) of a native Triton launch from its constexprs, and its inner loops' possible trip counts: none
    in CoPE's and stick-breaking's kernels, Co-RoPE's rotary chunks (D/2 over BD)."""
    if c.op in ("cope", "stickbreaking"):
        return (constexprs["BLOCK_Q"], constexprs["BLOCK_K"], 1), frozenset()
    if c.op == "corope":
        chunks = -(-(c.head_dim // 2) // constexprs["BD"])
        return (constexprs["BQ"], constexprs["BK"], constexprs["H"]), frozenset({chunks})
    raise ValueError(f"no tile geometry for op {c.op!r}")


def report_jobs(cases: Iterable[Any], paths: Sequence[str] = ("pallas",)) -> list[Job]:
    """The compile report's kernels of these cases (cr.Case) on each path: the Pallas kernels lowered for the GPU,
    the native Triton kernels' launches recorded."""
    jobs = []
    for case in cases:
        for path in (path for path in paths if path in cr.OP_PATHS[case.op]):
            base = {"path": path, "op": case.op, "dtype": case.dtype, "head_dim": case.head_dim,
                    "q_heads": case.q_heads, "kv_heads": case.kv_heads, "npos": case.npos, "length": case.length}
            try:
                kernels = cr.case_kernels(case, path)
            except Exception as e:  # noqa: BLE001  a kernel that does not lower is a result, not a crash
                jobs.append(Job({**base, "kernel": "lowering"}, b"", 0, 0, (0, 0, 0), error=f"lowering failed: {e}",
                                path=path))
                continue
            for k in kernels:
                meta = {**base, "kernel": k.role, "name": k.name, "grid": list(k.grid)}
                source = cr._compile_input(k)[1]
                try:
                    jobs.append(Job(meta, source, k.num_warps, k.num_stages, *_tile(k), path=path))
                except ValueError as e:
                    jobs.append(Job(meta, source, k.num_warps, k.num_stages, (0, 0, 0), error=str(e), path=path))
    return jobs


@dataclasses.dataclass(frozen=True)
class PlainSpec:
    """jax's Pallas flash attention (MHA, causal) at one setting; None fields: its defaults."""

    dtype: str
    head_dim: int
    role: str  # "forward" or "backward"
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    @property
    def variant(self) -> str:
        return "defaults" if self.block_q is None else "same tiles"

    @property
    def id(self) -> str:
        tiles = ("defaults" if self.block_q is None
                 else f"{self.block_q}x{self.block_k}-w{self.num_warps}s{self.num_stages}")
        return f"plain-{cr._short_dtype(self.dtype)}-D{self.head_dim}-{self.role}-{tiles}"


def plain_spec(meta: dict[str, Any], num_warps: int, num_stages: int, tile: tuple[int, int, int]) -> PlainSpec | None:
    """Plain attention at a kernel's tiles, warps and stages (D 64 and 128 only)."""
    if meta["head_dim"] not in PLAIN_HEAD_DIMS:
        return None
    role = "backward" if meta["kernel"] == "backward" else "forward"
    return PlainSpec(meta["dtype"], meta["head_dim"], role, tile[0], tile[1], num_warps,
                     num_stages if role == "forward" else 2)  # mha's backward always has 2 stages


def plain_job(spec: PlainSpec, length: int = cr.LENGTH) -> Job:
    """jax.experimental.pallas.ops.gpu.attention.mha lowered for the GPU: its forward kernel, or the fused backward
    (dk/dv over query blocks, then dq over key blocks: its dq tile is the same BQ·BK logits, transposed, since mha
    needs block_q_dq == block_kv_dkv)."""
    from jax.experimental.pallas.ops.gpu import attention

    if spec.block_q is None:
        sizes = attention.BlockSizes.get_default()
        bq, bk = (sizes.block_q, sizes.block_k) if spec.role == "forward" else (sizes.block_q_dkv, sizes.block_kv_dkv)
    else:
        bq, bk = spec.block_q, spec.block_k
        sizes = attention.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bq, block_kv_dkv=bk, block_q_dq=bk,
                                     block_kv_dq=bq)
    dtype = jnp.dtype(spec.dtype)
    x = jax.ShapeDtypeStruct((1, length, PLAIN_HEADS, spec.head_dim), dtype)
    fn = lambda q, k, v: attention.mha(q, k, v, None, spec.head_dim ** -0.5, True, sizes, "triton",  # noqa: E731
                                       spec.num_warps, 2 if spec.num_stages is None else spec.num_stages)
    if spec.role == "backward":
        fn = jax.grad(lambda q, k, v, f=fn: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    name = f"mha_{spec.role}"
    calls = [c for c in cr._triton_calls(cr._lowered_for_gpu(fn, (x, x, x))) if c["name"] == name]
    if len(calls) != 1:
        raise ValueError(f"{spec.id}: {len(calls)} Triton calls named {name}")
    call = calls[0]
    meta = {"op": "plain", "variant": spec.variant, "id": spec.id, "dtype": spec.dtype, "head_dim": spec.head_dim,
            "q_heads": PLAIN_HEADS, "kv_heads": PLAIN_HEADS, "npos": None, "length": length, "kernel": spec.role,
            "name": name, "grid": list(call["grid"]), "block_q": bq, "block_k": bk}
    return Job(meta, call["ir"], call["num_warps"], call["num_stages"], (bq, bk, 1))


# ------------------------------------------------------------------------------------------------ compiling


@dataclasses.dataclass(frozen=True)
class Tools:
    """The compile report's toolchain (jax's CUDA plugin, ptxas) and an nvdisasm."""

    toolchain: Any  # cr.Toolchain
    nvdisasm: str
    nvdisasm_version: str


def find_tools(ptxas: str | None = None, nvdisasm: str | None = None) -> Tools:
    """The compile report's toolchain and nvdisasm ($NVDISASM, the nvidia-cuda-nvdisasm wheel, PATH), or
    ToolchainMissing saying how to install them."""
    toolchain = cr.find_toolchain(ptxas)
    path = find_cuda_tool("nvdisasm", nvdisasm, ("cu13/bin", "cuda_nvdisasm/bin"))
    install = (f"install it with:\n    pip install --no-deps 'nvidia-cuda-nvdisasm=={toolchain.ptxas_version}'\n"
               "(the version of ptxas) into the venv of `make test-compile` (.venv-compile)")
    if path is None:
        raise ToolchainMissing(f"nvdisasm not found (looked at $NVDISASM, the nvidia-cuda-nvdisasm wheel and PATH); "
                               f"{install}")
    return Tools(toolchain, path, cuda_tool_version(path))


def compile_sass(job: Job, tools: Tools, *, timeout: float = 1800.0,
                 ptxas_memory_gib: float | None = cr.PTXAS_MEMORY_GIB) -> dict[str, Any]:
    """The path's Triton compiler -> PTX (the compile report's `triton_to_ptx`), `ptxas -v -arch=sm_90a` -> cubin,
    nvdisasm -> SASS text; with ptxas's registers and spills and Triton's shared memory. Raises RuntimeError on any
    failure."""
    compiled = cr.triton_to_ptx(cr.PATH_COMPILERS[job.path], job.ir, job.num_warps, job.num_stages, timeout=timeout,
                                processes=cr._Processes())
    if "error" in compiled:
        raise RuntimeError(compiled["error"])
    with tempfile.TemporaryDirectory(prefix="jaxpe-cost-") as tmp:
        ptx, cubin = pathlib.Path(tmp, "kernel.ptx"), pathlib.Path(tmp, "kernel.cubin")
        ptx.write_bytes(compiled["ptx"])
        command = [tools.toolchain.ptxas, "-v", f"-arch={cr.GPU_NAME}", str(ptx), "-o", str(cubin)]
        if ptxas_memory_gib is not None:
            command = ["sh", "-c", f'ulimit -v {int(ptxas_memory_gib * 2 ** 20)} && exec "$0" "$@"', *command]
        ptxas = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if ptxas.returncode != 0:
            raise RuntimeError(f"ptxas exited {ptxas.returncode}: {cr._tail(ptxas.stderr + ptxas.stdout)}")
        sass = subprocess.run([tools.nvdisasm, "-c", str(cubin)], capture_output=True, text=True, timeout=timeout)
        if sass.returncode != 0:
            raise RuntimeError(f"nvdisasm exited {sass.returncode}: {cr._tail(sass.stderr)}")
        return {"sass": sass.stdout, "smem_bytes": compiled["smem_bytes"],
                "ptx_bytes": ptx.stat().st_size, **cr.parse_ptxas(ptxas.stdout + ptxas.stderr)}


# ---------------------------------------------------------------------------------------------------- costs


def _per_logit(tally: Tally, scale: float) -> dict[str, Any]:
    clocks = {pipe: c * scale for pipe, c in tally.clocks().items()}
    pipe = max(clocks, key=clocks.get)
    return {"instructions": tally.instructions * scale, "clocks": clocks, "bound": clocks[pipe], "bound_pipe": pipe}


def measure(sass: str, name: str, loops: Sequence[tuple[str, bool]], tile: tuple[int, int, int], warps: int
            ) -> dict[str, Any]:
    """The key-block loops of kernel `name` in SASS: per loop, its counts per iteration and warp, its inner trip
    counts, and per logit (× warps / (BQ·BK·H)) its instructions and pipe clocks; and the kernel's per-logit cost,
    the sum of its counted loops."""
    functions = parse_sass(sass)
    fn = functions.get(name) or (next(iter(functions.values())) if len(functions) == 1 else None)
    if fn is None:
        raise SassError(f"no function {name!r} in the SASS (found {sorted(functions)})")
    blocks = basic_blocks(fn)
    found = find_loops(blocks)
    if len(found) != len(loops):
        raise SassError(f"{name}: {len(found)} outermost loops where {len(loops)} were expected "
                        f"({', '.join(n for n, _ in loops)})")
    scale = warps / math.prod(tile)
    total, rows = Tally(), []
    for (loop_name, counted), loop in zip(loops, found):
        tally, trips = tally_loop(fn, blocks, loop)
        if counted:
            total.merge(tally)
        rows.append({"name": loop_name, "counted": counted,
                     "address": f"{fn.instructions[blocks[loop.header].start].address:#06x}",
                     "inner_trips": trips, "instructions": tally.instructions,
                     "counts": {k: tally.counts[k] for k in CLASSES if tally.counts[k]},
                     "memory": dict(sorted(tally.memory.items())), "per_logit": _per_logit(tally, scale)})
    return {"sass_instructions": len(fn.instructions), "loops": rows, "per_logit": _per_logit(total, scale)}


def run_job(job: Job, tools: Tools, *, timeout: float) -> dict[str, Any]:
    """One kernel's JSON entry: what it is, its tile, compile numbers, loops and per-logit cost (or its error)."""
    bq, bk, h = job.tile
    entry = {**job.meta, "num_warps": job.num_warps, "num_stages": job.num_stages, "block_q": bq, "block_k": bk,
             "heads_per_program": h, "error": job.error}
    if job.error is not None:
        return entry
    loops = LOOPS.get((job.path, job.meta["op"], job.meta["kernel"]), LOOPS.get((job.meta["op"], job.meta["kernel"])))
    start = time.perf_counter()
    try:
        compiled = compile_sass(job, tools, timeout=timeout)
        entry.update({k: v for k, v in compiled.items() if k != "sass"})
        if loops is None:
            raise SassError(f"no loop names for a {job.meta['op']} {job.meta['kernel']} kernel (LOOPS)")
        entry.update(measure(compiled["sass"], job.meta["name"], loops, job.tile, job.num_warps))
        found = {n for loop in entry["loops"] for n in loop["inner_trips"]}
        if not found <= job.trips:
            raise SassError(f"inner loops of {sorted(found)} trips where the kernel has {sorted(job.trips)}")
    except (RuntimeError, SassError, subprocess.TimeoutExpired) as e:
        entry["error"] = f"{type(e).__name__}: {e}"
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return entry


def collect(cases: Sequence[Any], tools: Tools, *, paths: Sequence[str] = cr.PATHS, jobs: int = 1,
            timeout: float = 1800.0, plain: bool = True, progress: Callable[[dict[str, Any]], None] | None = None
            ) -> tuple[list[dict], list[dict]]:
    """Entries of every kernel of the cases on each path and of plain attention (at their tiles for D 64/128, and
    at its defaults), `jobs` compiles at a time; each kernel entry gets its ratio to plain attention at its tiles."""
    mine = report_jobs(cases, paths)
    specs = {}
    if plain:
        for job in mine:
            if job.error is None and (spec := plain_spec(job.meta, job.num_warps, job.num_stages, job.tile)):
                specs[spec] = None
                specs[PlainSpec(spec.dtype, spec.head_dim, spec.role)] = None
    plains = [plain_job(spec) for spec in specs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_job, job, tools, timeout=timeout) for job in mine + plains]
        for future in concurrent.futures.as_completed(futures):
            if progress is not None:
                progress(future.result())
        entries = [future.result() for future in futures]
    kernels, plain_entries = entries[:len(mine)], entries[len(mine):]
    by_id = {e["id"]: e for e in plain_entries if not e["error"]}
    for job, entry in zip(mine, kernels):
        spec = plain_spec(job.meta, job.num_warps, job.num_stages, job.tile) if plain and job.error is None else None
        same = by_id.get(spec.id) if spec else None
        defaults = by_id.get(PlainSpec(spec.dtype, spec.head_dim, spec.role).id) if spec else None
        entry["plain"] = None if entry["error"] or same is None else {
            "same_tiles": _ratio(entry, same), "defaults": None if defaults is None else _ratio(entry, defaults)}
    return kernels, plain_entries


def _ratio(entry: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A kernel's cost against plain attention's: bound and instructions per logit, per loop too."""
    b = base["per_logit"]
    return {"id": base["id"], "bound": b["bound"], "bound_pipe": b["bound_pipe"], "instructions": b["instructions"],
            "ratio": entry["per_logit"]["bound"] / b["bound"],
            "instruction_ratio": entry["per_logit"]["instructions"] / b["instructions"],
            "loop_ratios": {loop["name"]: loop["per_logit"]["bound"] / b["bound"] for loop in entry["loops"]},
            "loop_instruction_ratios": {loop["name"]: loop["per_logit"]["instructions"] / b["instructions"]
                                        for loop in entry["loops"]}}


def versions(tools: Tools) -> dict[str, str]:
    """The versions the numbers depend on."""
    t = tools.toolchain
    found = {"python": platform.python_version(), "jax": jax.__version__,
             "jaxlib": importlib.metadata.version("jaxlib"), t.plugin: t.plugin_version, "ptxas": t.ptxas_version,
             "nvdisasm": tools.nvdisasm_version}
    for name in ("triton", "jax-triton"):  # the native Triton path's compiler
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


@dataclasses.dataclass(frozen=True)
class Target:
    """A cost the kernels are held to, on GQA 8/2 (CoPE: npos 64 and 513) in float32 and bfloat16: per kernel entry
    of `op`/`kernel` at `head_dims`, a number (`value`) at most `limit`."""

    id: str
    text: str
    op: str
    kernel: str
    head_dims: tuple[int, ...]
    measure: str  # "instruction_ratio": a loop's instructions per logit over plain attention's at the same tiles;
    #               "bound": the kernel's clk/logit; "fences": GPU-scope fence instructions in its counted loops;
    #               "ratio_to_defaults": the kernel's clk/logit over plain attention's at its own default tiles
    limit: float
    loop: str | None = None

    def value(self, entry: dict[str, Any]) -> float | None:
        """This target's number for one entry (None: not measurable there, e.g. no plain attention beside it)."""
        if self.measure == "bound":
            return entry["per_logit"]["bound"]
        if self.measure == "fences":
            return float(sum(n for loop in entry["loops"] for opcode, n in loop["memory"].items()
                             if gpu_scope_fence(opcode)))
        if self.measure == "ratio_to_defaults":
            defaults = (entry.get("plain") or {}).get("defaults")
            return None if defaults is None else defaults["ratio"]
        same = (entry.get("plain") or {}).get("same_tiles")
        return None if same is None else same["loop_instruction_ratios"][self.loop]


TARGETS = (
    Target("cope-forward-full", "CoPE forward, full tiles: instructions per logit ≤ 2.0× plain attention's at the "
           "same tiles", "cope", "forward", (64, 128), "instruction_ratio", 2.0, "positions"),
    Target("cope-forward-clamped", "CoPE forward, clamped tiles: ≤ 1.1× plain", "cope", "forward", (64, 128),
           "instruction_ratio", 1.1, "clamped"),
    Target("cope-backward-full", "CoPE backward, full tiles: ≤ 2.0× plain", "cope", "backward", (64, 128),
           "instruction_ratio", 2.0, "positions"),
    Target("corope-forward-d64", "Co-RoPE forward at D 64: ≤ 3 clk/logit", "corope", "forward", (64,), "bound", 3.0),
    Target("corope-forward-d128", "Co-RoPE forward at D 128: ≤ 6 clk/logit", "corope", "forward", (128,), "bound",
           6.0),
    Target("corope-backward-d64", "Co-RoPE backward at D 64: ≤ 12 clk/logit", "corope", "backward", (64,), "bound",
           12.0),
    Target("cope-backward-fences", "CoPE backward: no GPU-scope fence in its key-block loops", "cope", "backward",
           (64, 128, 256), "fences", 0.0),
    Target("corope-backward-fences", "Co-RoPE backward: no GPU-scope fence in its key-block loops", "corope",
           "backward", (64, 128, 256), "fences", 0.0),
    # forgetting attention within 1.3× of plain attention, stick-breaking within 2× (their authors' claims; the GPU
    # targets against cuDNN), here against jax's Pallas flash attention at its default tiles, per kernel
    Target("fox-forward", "FoX forward: clk/logit ≤ 1.3× plain attention's at its default tiles", "fox", "forward",
           (64, 128), "ratio_to_defaults", 1.3),
    Target("fox-backward", "FoX backward: ≤ 1.3× plain's at its defaults", "fox", "backward", (64, 128),
           "ratio_to_defaults", 1.3),
    Target("stickbreaking-forward", "Stick-breaking forward: ≤ 2× plain's at its defaults", "stickbreaking",
           "forward", (64, 128), "ratio_to_defaults", 2.0),
    Target("stickbreaking-backward", "Stick-breaking backward: ≤ 2× plain's at its defaults", "stickbreaking",
           "backward", (64, 128), "ratio_to_defaults", 2.0),
    Target("fox-backward-fences", "FoX backward: no GPU-scope fence in its key-block loops", "fox", "backward",
           (64, 128), "fences", 0.0),
    Target("stickbreaking-backward-fences", "Stick-breaking backward: no GPU-scope fence in its key-block loops",
           "stickbreaking", "backward", (64, 128), "fences", 0.0),
)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target per path: the worst value over its entries (GQA 8/2, f32 and bf16) and whether it holds; a
    target is met when some path meets it on every entry (the path `impl="auto"` is to take on a GPU)."""
    out = []
    for t in TARGETS:
        per_path = {}
        for path in (path for path in data.get("paths", ["pallas"]) if path in cr.OP_PATHS[t.op]):
            entries = [e for e in data["kernels"] if e.get("path", "pallas") == path and e["op"] == t.op
                       and e["kernel"] == t.kernel and e["head_dim"] in t.head_dims and e["kv_heads"] == 2
                       and e["q_heads"] == 8]
            values = [None if e["error"] else t.value(e) for e in entries]
            worst = None if not values or None in values else max(values)
            per_path[path] = {"worst": worst, "entries": len(entries), "met": worst is not None and worst <= t.limit}
        met_by = [path for path, r in per_path.items() if r["met"]]
        out.append({"id": t.id, "text": t.text, "limit": t.limit, "paths": per_path, "met": bool(met_by),
                    "met_by": met_by})
    return out


MODEL = ("Per kernel, its outermost SASS loops (one iteration per key block); per iteration and warp, every "
         "instruction of the loop body issues once (lane-divergent guarded code included), inner loops times their "
         "trip counts. Per logit: × warps / (BQ·BK·H). Bound: the largest over the pipes of the work per logit "
         "over the pipe's rate per SM (rates), in SM clocks; a throughput bound that ignores latency, occupancy, "
         "bank conflicts and global memory.")


def report(kernels: list[dict], plains: list[dict], tools: Tools, *, authors: dict[str, Any], command: str,
           seconds: float | None = None, settings: dict[str, Any] | None = None,
           paths: Sequence[str] = cr.PATHS) -> dict[str, Any]:
    """The JSON report: command, date, versions, kernel sources' fingerprint, device and rates, model, entries,
    and the targets checked on them (`targets`)."""
    data = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(tools),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "paths": list(paths),
        "kernel_sources_sha256": cr.kernel_sources_sha256(paths),
        "device": DEVICE,
        "rates": RATES,
        "model": MODEL,
        "settings": settings or {},
        "wall_seconds": None if seconds is None else round(seconds, 1),
        "kernels": kernels,
        "plain": plains,
        "authors": authors,
    }
    data["targets"] = targets(data)
    return data


_COLUMNS = (("MMA", ("mma",)), ("FFMA", ("ffma",)), ("FMUL", ("fmul",)), ("FADD", ("fadd",)), ("MUFU", ("mufu",)),
            ("fp cmp/sel", ("fp_other",)), ("cvt", ("convert",)), ("int", ("int",)), ("LDS/STS", ("lds", "sts")),
            ("LDG/STG/cp", ("ldg", "stg", "ldgsts")), ("SHFL", ("shfl",)), ("BAR", ("bar",)),
            ("atom", ("atomic",)), ("fence", ("fence",)))


def _table_rows(entry: dict[str, Any], described: str) -> list[str]:
    """Markdown rows of one entry: a row per loop, and a Σ row when several loops add up."""
    if entry["error"]:
        dashes = " | ".join("—" for _ in range(len(_COLUMNS) + 7))
        return [f"| {described} | {dashes} | failed: {entry['error']} |"]
    tile = f"{entry['block_q']}×{entry['block_k']}×{entry['heads_per_program']}/{entry['num_warps']}"
    plain = entry.get("plain") or {}
    same, defaults = plain.get("same_tiles"), plain.get("defaults")
    loops = entry["loops"]
    counted = [loop for loop in loops if loop["counted"]]
    items = [(loop["name"] + ("" if loop["counted"] else " (instead)"), loop["counts"], loop["inner_trips"],
              loop["per_logit"]) for loop in loops]
    if len(counted) > 1:
        total = collections.Counter()
        for loop in counted:
            total.update(loop["counts"])
        items.append(("Σ", total, [], entry["per_logit"]))
    rows = []
    for name, counts, trips, per_logit in items:
        cells = " | ".join(str(sum(counts.get(c, 0) for c in classes)) for _, classes in _COLUMNS)
        ratios = " | ".join("—" if base is None else f"{per_logit['bound'] / base['bound']:.1f}"
                            for base in (same, defaults))
        plain_bound = "—" if same is None else f"{same['bound']:.2f}"
        rows.append(f"| {described} | {name} | {tile} | {'×'.join(map(str, trips)) or '—'} | {cells} "
                    f"| {per_logit['instructions']:.1f} | {per_logit['bound']:.2f} {per_logit['bound_pipe']} "
                    f"| {plain_bound} | {ratios} |")
    return rows


def _header(first: str) -> list[str]:
    names = " | ".join(name for name, _ in _COLUMNS)
    return [f"| {first} | loop | BQ×BK×H/warps | inner trips | {names} | inst/logit | clk/logit (pipe) "
            "| plain clk/logit | ratio | ratio to defaults |",
            "|" + "---|" * (first.count("|") + 10 + len(_COLUMNS))]


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown tables: jaxpe's kernels, plain attention, the Co-RoPE authors' forward."""
    v, d = data["versions"], data["device"]
    lines = [
        f"# Kernel cost on an {d['name']} ({d['sm']}), read from SASS",
        "",
        f"`{data['command']}`, {data['date']}: " + ", ".join(f"{k} {val}" for k, val in v.items())
        + f". Kernel sources sha256 {data['kernel_sources_sha256'][:12]}. B 1, L {cr.LENGTH}, default block sizes "
        "and warps. " + data["model"] + " Counts: warp-instructions per loop iteration and warp (MMA: HMMA/HGMMA; "
        "fp cmp/sel: FMNMX, FSEL, FSETP; int: integer and address ALU and moves; LDS/STS include ldmatrix/stmatrix; "
        "cp: LDGSTS). ratio: clk/logit over plain attention's (jax's Pallas mha, MHA) at the same tiles, warps and "
        "stages (D 64 and 128); ratio to defaults: over plain attention at mha's own defaults. Loops marked "
        "(instead) take some key blocks in place of the counted loop.",
        "",
        "## Targets",
        "",
        *_targets_table(data.get("targets", [])),
        "",
        "## The kernels",
        "",
        "path: pallas, the Pallas kernels through XLA's Triton compiler; triton, the native Triton kernels through "
        "Triton's own compiler, as jax-triton compiles them.",
        "",
        *_header("path | op | dtype | D | N/K | P | kernel"),
    ]
    for e in data["kernels"]:
        described = (f"{e.get('path', 'pallas')} | {e['op']} | {cr._short_dtype(e['dtype'])} | {e['head_dim']} "
                     f"| {e['q_heads']}/{e['kv_heads']} | {'—' if e['npos'] is None else e['npos']} | {e['kernel']}")
        lines += _table_rows(e, described)
    lines += ["", "## Plain attention (jax.experimental.pallas.ops.gpu.attention.mha, MHA 8/8, causal)", "",
              *_header("variant | dtype | D | kernel")]
    for e in data["plain"]:
        lines += _table_rows(e, f"{e['variant']} | {cr._short_dtype(e['dtype'])} | {e['head_dim']} | {e['kernel']}")
    a = data["authors"]
    lines += ["", "## The Co-RoPE authors' Triton forward", "", _authors_sentence(a)]
    return "\n".join(lines) + "\n"


def _targets_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: each target, its worst value per path (GQA 8/2, f32 and bf16), and whether it is met."""
    paths = list(dict.fromkeys(path for r in results for path in r["paths"]))
    lines = ["| target | limit | " + " | ".join(f"{path} (worst)" for path in paths) + " | met |",
             "|---|---|" + "---|" * len(paths) + "---|"]
    for r in results:
        cells = []
        for path in paths:
            p = r["paths"].get(path) or {}
            worst = p.get("worst")
            cells.append("—" if worst is None else f"{worst:.2f}" + ("" if p["met"] else " ✗"))
        met = f"yes ({', '.join(r['met_by'])})" if r["met"] else "no"
        lines.append(f"| {r['text']} | {r['limit']:g} | {' | '.join(cells)} | {met} |")
    return lines


def summary(data: dict[str, Any]) -> str:
    """The short table of docs/reports/kernel_cost.md: GQA 8/2 (CoPE: npos 64), the forward and the backward kernel, per
    logit: instructions, the bound and its pipe (CoPE's clamped tiles beside), and the ratios to plain attention."""
    lines = ["| path | op | dtype | D | kernel | BQ×BK×H/warps | inst/logit | clk/logit (pipe) | clamped clk/logit "
             "| plain clk/logit | ratio | plain defaults clk/logit | ratio to defaults |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in data["kernels"]:
        if e["kv_heads"] != 2 or e["npos"] not in (None, 64) or e["kernel"] == "forward_train" or e["error"]:
            continue
        clamped = [f"{loop['per_logit']['bound']:.2f}" for loop in e["loops"] if not loop["counted"]]
        plain = e.get("plain") or {}
        cells = []
        for base in (plain.get("same_tiles"), plain.get("defaults")):
            cells += ["—", "—"] if base is None else [f"{base['bound']:.2f}", f"{base['ratio']:.1f}"]
        lines.append(f"| {e.get('path', 'pallas')} | {e['op']} | {cr._short_dtype(e['dtype'])} | {e['head_dim']} "
                     f"| {e['kernel']} "
                     f"| {e['block_q']}×{e['block_k']}×{e['heads_per_program']}/{e['num_warps']} "
                     f"| {e['per_logit']['instructions']:.1f} | {e['per_logit']['bound']:.2f} "
                     f"{e['per_logit']['bound_pipe']} | {clamped[0] if clamped else '—'} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _authors_sentence(a: dict[str, Any]) -> str:
    if not a.get("measured"):
        return f"Not measured: {a['reason']}"
    parts = [f"{a['source']} (sha256 {a['sha256'][:12]}), `{a['kernel']}` with pip triton {a['triton']} for "
             f"{a['target']}, ptxas {a['ptxas']} capped at {a['ptxas_memory_gib']:g} GiB:"]
    for c in a["configs"]:
        ptx = "—" if c.get("ptx_bytes") is None else f"{c['ptx_bytes'] / 2 ** 20:.1f} MiB of PTX"
        error = "; ".join(part.strip() for part in (c.get("error") or "").split(" | ")
                          if part.strip() and not part.startswith("Repro command"))
        outcome = f"failed at {c['failed_stage']}: {error}" if c.get("error") else "compiled"
        parts.append(f"{c['id']}: {ptx}, {c['seconds']:.0f} s, {outcome}.")
    if "measured_in" in a:
        parts.append(f"(Measured in an earlier run, on {a['measured_in']['date'][:10]}.)")
    return " ".join(parts)


# ------------------------------------------------------------------------------- the Co-RoPE authors' forward

AUTHORS_SOURCE = "corope-exp/flash_attn_co_rope_gqa_triton.py of the GitHub repository Superposition09m/Co-RoPE"
AUTHORS_KERNEL = "_corope_fwd_backbone"
AUTHORS_CONFIGS = ((64, 4),)  # (D, G): bf16, GQA 8/2 as in the grid (D 64 alone: half an hour)
TRITON_STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


def _authors_kernel_module(path: pathlib.Path, into: pathlib.Path) -> tuple[Any, dict[str, int]]:
    """The authors' @triton.jit forward alone (their module imports torch and asks for a GPU at import), written to
    a module of its own under `into` and imported; with the file's DEFAULT_* constants."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    defaults = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("DEFAULT_")
                and isinstance(node.value, ast.Constant)}
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == AUTHORS_KERNEL), None)
    if fn is None:
        raise ValueError(f"{path} has no function {AUTHORS_KERNEL}")
    lines = text.splitlines()[min([d.lineno for d in fn.decorator_list] + [fn.lineno]) - 1:fn.end_lineno]
    module = into / "authors_kernel.py"
    module.write_text("import triton\nimport triton.language as tl\n\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
    spec = importlib.util.spec_from_file_location("authors_kernel", module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, AUTHORS_KERNEL), defaults


def _compile_authors(path: str, head_dim: int, groups: int, out: str) -> None:
    """Subprocess side: pip triton compiles the authors' forward for sm_90 (target cuda 90, warp 32), bf16; the
    parent reads what got how far from Triton's IR dumps."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, defaults = _authors_kernel_module(pathlib.Path(path), pathlib.Path(out).parent)
    constants = {"HEAD_DIM": head_dim, "BLOCK_M": defaults["DEFAULT_BLOCK_M"], "BLOCK_N": defaults["DEFAULT_BLOCK_N"],
                 "GROUP_SIZE": groups}
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "inv_freq_ptr": "*fp32", "sm_scale": "fp32"}
    signature = {a: "constexpr" if a in constants else pointers.get(a, "i32") for a in fn.arg_names}
    result: dict[str, Any] = {"constants": constants}
    try:
        kernel = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "num_stages": 3})
        result["smem_bytes"] = kernel.metadata.shared  # registers are known only once a driver loads it
    except Exception as e:  # noqa: BLE001  the failure is the result
        result["error"] = f"{type(e).__name__}: {cr._tail(str(e), 4)}"
    pathlib.Path(out).write_text(json.dumps(result), encoding="utf-8")


def authors_report(path: pathlib.Path | None, tools: Tools, *, timeout: float = 1800.0,
                   memory_gib: float = cr.PTXAS_MEMORY_GIB) -> dict[str, Any]:
    """Compile the Co-RoPE authors' Triton forward (a file given on the command line: it is not in this repository)
    with pip triton for sm_90, its ptxas (for sm_90 and later Triton runs the one it calls ptxas-blackwell) replaced
    by ours capped at `memory_gib`; what each stage gave, or that it was not measured."""
    if path is None:
        return {"measured": False, "reason": f"the source ({AUTHORS_SOURCE}) was not given (--authors-file); "
                                             "the tool has no network access to fetch it"}
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return {"measured": False, "reason": "pip triton is not installed"}
    configs = []
    for head_dim, groups in AUTHORS_CONFIGS:
        with tempfile.TemporaryDirectory(prefix="jaxpe-authors-") as tmp:
            wrapper, out, dump = pathlib.Path(tmp, "ptxas"), pathlib.Path(tmp, "out.json"), pathlib.Path(tmp, "dump")
            cap = int(memory_gib * 2 ** 20)
            wrapper.write_text(f'#!/bin/sh\nulimit -v {cap}\nexec "{tools.toolchain.ptxas}" "$@"\n', encoding="utf-8")
            wrapper.chmod(0o755)
            env = dict(os.environ, TRITON_PTXAS_PATH=str(wrapper), TRITON_PTXAS_BLACKWELL_PATH=str(wrapper),
                       TRITON_KERNEL_DUMP="1", TRITON_DUMP_DIR=str(dump),
                       TRITON_CACHE_DIR=str(pathlib.Path(tmp, "cache")), TRITON_ALWAYS_COMPILE="1",
                       TRITON_DEFAULT_FP_FUSION="1", JAX_PLATFORMS="cpu")
            start = time.perf_counter()
            try:
                run = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--compile-authors",
                                      str(path), str(out), "--authors-head-dim", str(head_dim), "--authors-groups",
                                      str(groups)], capture_output=True, text=True, timeout=timeout, env=env)
                result = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {
                    "error": f"exited {run.returncode}: {cr._tail(run.stderr + run.stdout, 4)}"}
            except subprocess.TimeoutExpired:
                result = {"error": f"timed out after {timeout:.0f} s"}
            dumped = {p.suffix[1:]: p.stat().st_size for p in dump.rglob(f"{AUTHORS_KERNEL}.*")}
            failed = next((s for s in TRITON_STAGES if s not in dumped), None) if "error" in result else None
            configs.append({"id": f"bf16-D{head_dim}-G{groups}", "head_dim": head_dim, "groups": groups, **result,
                            "ptx_bytes": dumped.get("ptx"), "failed_stage": failed,
                            "seconds": round(time.perf_counter() - start, 1)})
    return {"measured": True, "source": AUTHORS_SOURCE, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "kernel": AUTHORS_KERNEL, "triton": triton_version, "target": "GPUTarget('cuda', 90, 32)",
            "ptxas": tools.toolchain.ptxas_version, "ptxas_memory_gib": memory_gib, "num_warps": 4,
            "num_stages": 3, "configs": configs}


def earlier_authors(path: pathlib.Path) -> dict[str, Any]:
    """The authors' section of an earlier report (JSON), marked with when it was measured."""
    earlier = json.loads(path.read_text(encoding="utf-8"))
    authors = dict(earlier["authors"])
    authors.setdefault("measured_in", {"date": earlier["date"]})
    return authors


# ------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/kernel_cost.py", description=__doc__.split("\n")[0])
    cr.add_grid_arguments(parser)
    parser.add_argument("--no-plain", action="store_true", help="skip plain attention (no ratios)")
    parser.add_argument("--authors-file", type=pathlib.Path, metavar="PY",
                        help=f"also compile the Co-RoPE authors' forward from this file ({AUTHORS_SOURCE})")
    parser.add_argument("--authors-timeout", type=float, default=5400.0, help="seconds for the authors' compile")
    parser.add_argument("--authors-from", type=pathlib.Path, metavar="JSON",
                        help="take the authors' section from an earlier report (its compile takes an hour) instead")
    parser.add_argument("--jobs", type=int, default=cr.default_jobs(), help="compiles at a time")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile step")
    parser.add_argument("--ptxas", help="path to ptxas (default: $PTXAS, the nvidia-cuda-nvcc wheel, PATH)")
    parser.add_argument("--nvdisasm", help="path to nvdisasm (default: $NVDISASM, the nvidia-cuda-nvdisasm wheel, "
                                           "PATH)")
    parser.add_argument("--out", type=pathlib.Path, metavar="DIR",
                        help="folder for NAME.json and NAME.md (required unless --no-write)")
    parser.add_argument("--name", help="file stem (default: kernel_cost for the full grid, kernel_cost-quick, "
                                       "kernel_cost-subset)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--compile-authors", nargs=2, metavar=("PY", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--authors-head-dim", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--authors-groups", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not (args.no_write or args.compile_authors):
        parser.error("--out DIR is required (or --no-write to print the table only)")
    if args.authors_file and args.authors_from:
        parser.error("--authors-file and --authors-from: give one")
    args.name = cr.grid_name(parser, args, "kernel_cost")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.compile_authors:
        _compile_authors(args.compile_authors[0], args.authors_head_dim, args.authors_groups, args.compile_authors[1])
        return 0
    try:
        tools = find_tools(args.ptxas, args.nvdisasm)
    except ToolchainMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    jax.config.update("jax_platforms", "cpu")  # lowering for CUDA needs no GPU; do not start CUDA here
    cases = cr.default_cases(args.ops, args.dtypes, args.head_dims, args.heads, args.npos)
    print(f"measuring {len(cases)} configurations for {cr.GPU_NAME}: ptxas {tools.toolchain.ptxas_version}, nvdisasm "
          f"{tools.nvdisasm_version}, {args.jobs} at a time", file=sys.stderr)
    start = time.perf_counter()

    def progress(entry: dict[str, Any]) -> None:
        what = entry["error"] or f"{entry['per_logit']['bound']:.2f} clk/logit ({entry['per_logit']['bound_pipe']})"
        print(f"[{time.perf_counter() - start:6.0f} s] {entry['op']} {cr._short_dtype(entry['dtype'])} "
              f"D{entry['head_dim']} {entry['q_heads']}/{entry['kv_heads']} {entry.get('npos') or ''} "
              f"{entry['kernel']}: {what}", file=sys.stderr, flush=True)

    if args.paths != ("pallas",) and (reason := cr.triton_unavailable()):
        print(f"error: the triton path cannot be compiled here: {reason} (or --paths pallas)", file=sys.stderr)
        return 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as beside:  # the authors' hour beside the grid
        authors = beside.submit(authors_report, args.authors_file, tools, timeout=args.authors_timeout) if (
            args.authors_from is None) else None
        kernels, plains = collect(cases, tools, paths=args.paths, jobs=args.jobs, timeout=args.timeout,
                                  plain=not args.no_plain, progress=progress)
        authors = earlier_authors(args.authors_from) if authors is None else authors.result()
    data = report(kernels, plains, tools, authors=authors, seconds=time.perf_counter() - start, paths=args.paths,
                  settings={"jobs": args.jobs, "timeout_s": args.timeout, "authors_timeout_s": args.authors_timeout},
                  command=shlex.join(["python", "benchmarks/kernel_cost.py", *argv]))
    cr.show_and_write(data, markdown(data), None if args.no_write else args.out, args.name)
    return 1 if any(e["error"] for e in kernels + plains) else 0


if __name__ == "__main__":
    sys.exit(main())
