"""benchmarks/kernel_cost.py, the kernels' cost model read from SASS.

Everywhere: the SASS reader on hand-written listings, checked against counts made by hand (parser, control-flow
graph, loop nesting, trip counts read from loop counters, instruction classes, pipe clocks, the per-logit scaling);
the committed Markdown and docs/reports/kernel_cost.md's table are renderings of the committed JSON.
Where jax's CUDA plugin, ptxas and nvdisasm are installed (.venv-compile with `pip install --no-deps
nvidia-cuda-nvdisasm`), elsewhere skipped saying why: the committed results/cost/kernel_cost.json belongs to the kernel
sources as they are and three of its kernels compiled again give the same entries.
"""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "cost" / "kernel_cost.json"
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchmarks/kernel_cost.py, a script beside the library
import kernel_cost as kc  # noqa: E402

cr = kc.cr


def _tools():
    try:
        return kc.find_tools()
    except cr.ToolchainMissing as e:
        return str(e)


TOOLS = _tools()
needs_tools = pytest.mark.skipif(isinstance(TOOLS, str), reason=f"no GPU compiler or nvdisasm here: {TOOLS}")

# An outer loop (0x20-0x130) around an inner loop of 8 trips (0x40-0x80), a lane-guarded atomic with its fence, and
# the trap loop nvdisasm shows after EXIT (unreachable). Hand counts per outer iteration: 13 own instructions and
# 5 × 8 inner ones.
TOY = """
\t.section\t.text.toy,"ax",@progbits
toy:
.text.toy:
        /*0000*/                   MOV R1, RZ ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   MOV R9, RZ ;
.L_x_1:
        /*0040*/                   FFMA R5, R4, R4, R5 ;
        /*0050*/                   MUFU.EX2 R6, R5 ;
        /*0060*/                   IADD3 R9, R9, 0x1, RZ ;
        /*0070*/                   ISETP.GT.AND P1, PT, R9, 0x7, PT ;
        /*0080*/              @!P1 BRA `(.L_x_1) ;
        /*0090*/                   LOP3.LUT P2, RZ, R0, 0x3, RZ, 0xc0, !PT ;
        /*00a0*/               @P2 BRA `(.L_x_2) ;
        /*00b0*/              @!PT LDS RZ, [RZ] ;
        /*00c0*/                   MEMBAR.ALL.GPU ;
        /*00d0*/                   ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU PT, RZ, desc[UR8][R2.64], R5 ;
.L_x_2:
        /*00e0*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
        /*00f0*/                   LDSM.16.M88.4 R16, [R3+UR4] ;
        /*0100*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0110*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0120*/                   ISETP.GE.AND P0, PT, R1, R20, PT ;
        /*0130*/              @!P0 BRA `(.L_x_0) ;
        /*0140*/                   EXIT ;
.L_x_3:
        /*0150*/                   BRA `(.L_x_3);
"""


def _listing(body: str, name: str = "f") -> str:
    return f'\t.section\t.text.{name},"ax",@progbits\n{name}:\n' + body


def _only_loop(text: str):
    fn = kc.parse_sass(text)["f"]
    blocks = kc.basic_blocks(fn)
    (loop,) = kc.find_loops(blocks)
    return fn, blocks, loop


def test_parser_reads_addresses_guards_opcodes_and_labels():
    fn = kc.parse_sass(TOY)["toy"]
    assert len(fn.instructions) == 22 and fn.labels[".L_x_1"] == 4 and fn.labels[".L_x_3"] == 21
    branch = fn.instructions[8]
    assert (branch.address, branch.predicate, branch.opcode, branch.target) == (0x80, "@!P1", "BRA", ".L_x_1")
    assert fn.instructions[10].never is False and fn.instructions[11].never is True
    assert fn.instructions[13].args == ["PT", "RZ", "desc[UR8][R2.64]", "R5"]
    wgmma = kc.parse_sass(_listing("        /*0000*/      HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], RZ, !UPT, "
                                   "gsb0 ;\n"))["f"].instructions[0]
    assert wgmma.opcode == "HGMMA.64x128x16.F32.BF16" and wgmma.base == "HGMMA"


def test_control_flow_graph_and_loop_nesting():
    fn = kc.parse_sass(TOY)["toy"]
    blocks = kc.basic_blocks(fn)
    assert [(b.start, b.end, b.successors) for b in blocks] == [
        (0, 2, (1,)), (2, 4, (2,)), (4, 9, (2, 3)), (9, 11, (5, 4)), (11, 14, (5,)), (14, 20, (1, 6)), (20, 21, ()),
        (21, 22, (7,))]
    (outer,) = kc.find_loops(blocks)  # the trap loop after EXIT is unreachable
    assert outer.header == 1 and outer.blocks == {1, 2, 3, 4, 5} and outer.latches == (5,)
    (inner,) = outer.children
    assert inner.header == 2 and inner.blocks == {2} and inner.children == []
    assert kc.trip_count(fn, blocks, inner) == 8


def test_loop_tally_by_hand():
    fn = kc.parse_sass(TOY)["toy"]
    blocks = kc.basic_blocks(fn)
    tally, trips = kc.tally_loop(fn, blocks, kc.find_loops(blocks)[0])
    assert trips == [8] and tally.instructions == 13 + 5 * 8
    assert dict(tally.counts) == {"ldg": 1, "int": 4 + 2 * 8, "ffma": 8, "mufu": 8, "branch": 2 + 8, "nop": 1,
                                  "fence": 1, "atomic": 1, "mma": 1, "lds": 1, "bar": 1}
    assert dict(tally.memory) == {"LDG.E.128": 1, "ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU": 1, "LDSM.16.M88.4": 1,
                                  "MEMBAR.ALL.GPU": 1}
    # per warp, in SM clocks: 53 issues at 4/clk; 8 FFMA × 32 lanes at 128/clk; 20 ALU at 64; 8 MUFU at 16;
    # ldmatrix x4 = 512 bytes at 128 B/clk; one m16n8k16 (2048 MAC) at 2048 MAC/clk
    assert tally.clocks() == {"issue": 13.25, "fma": 2.0, "alu": 10.0, "xu": 16.0, "shfl": 0.0, "shared": 4.0,
                              "tensor": 1.0}


def test_measure_scales_per_logit_and_checks_the_loop_count():
    sass = TOY.replace(".text.toy", ".text.f").replace("toy:", "f:")
    cost = kc.measure(sass, "f", (("keys", True),), tile=(16, 32, 2), warps=4)
    (loop,) = cost["loops"]
    assert (loop["name"], loop["address"], loop["inner_trips"], loop["instructions"]) == ("keys", "0x0020", [8], 53)
    assert cost["per_logit"]["instructions"] == 53 * 4 / (16 * 32 * 2)
    assert (cost["per_logit"]["bound"], cost["per_logit"]["bound_pipe"]) == (16 * 4 / 1024, "xu")
    with pytest.raises(kc.SassError, match="1 outermost loops where 2 were expected"):
        kc.measure(sass, "f", (("keys", True), ("gates", True)), tile=(16, 32, 2), warps=4)


def test_trip_counts_from_counters():
    # compare before the step, against a register bound set before the loop; start from CS2R's pair of zeros
    before = _listing("""        /*0000*/                   CS2R R10, SRZ ;
        /*0010*/                   MOV R20, 0x10 ;
.L_x_0:
        /*0020*/                   ISETP.LT.AND P0, PT, R11, R20, PT ;
        /*0030*/                   IADD3 R11, R11, 0x2, RZ ;
        /*0040*/                @P0 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
""")
    assert kc.trip_count(*_only_loop(before)) == 9  # runs with R11 = 0, 2, ..., 16
    # counting down from HFMA2's half-precision idiom for 8 (low half 8 × 2^-24)
    down = _listing("""        /*0000*/                   HFMA2.MMA R5, -RZ, RZ, 0, 4.76837158203125e-07 ;
.L_x_0:
        /*0010*/                   FADD R6, R6, R7 ;
        /*0020*/                   IADD3 R5, R5, -0x1, RZ ;
        /*0030*/                   ISETP.NE.AND P0, PT, R5, RZ, PT ;
        /*0040*/                @P0 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
""")
    assert kc.trip_count(*_only_loop(down)) == 8
    # a uniform counter, its compare copied to the branch's predicate by PLOP3 (P0 = PT & PT & UP0), a predicate
    # output in between (LEA's carry) that must not count
    uniform = _listing("""        /*0000*/                   UMOV UR5, URZ ;
.L_x_0:
        /*0010*/                   UIADD3 UR5, UR5, 0x1, URZ ;
        /*0020*/                   UISETP.GT.AND UP0, UPT, UR5, 0x1, UPT ;
        /*0030*/                   LEA R2, P1, R3, UR16, 0x2 ;
        /*0040*/                   PLOP3.LUT P0, PT, PT, PT, UP0, 0x80, 0x0 ;
        /*0050*/              @!P0 BRA `(.L_x_0) ;
        /*0060*/                   EXIT ;
""")
    assert kc.trip_count(*_only_loop(uniform)) == 2
    clobbered = uniform.replace("LEA R2, P1,", "LEA R2, UP0,")
    with pytest.raises(kc.SassError, match="no readable compare"):
        kc.trip_count(*_only_loop(clobbered))
    # Triton's own compiler: a 64-bit uniform counter from -4 (low word 0xfffffffc, high 0xffffffff) stepped by 4
    # with its carry, a 64-bit unsigned compare (low words, then the high words chained), the branch taken on the
    # negation (PLOP3 LUT 0x40: PT & PT & !UP0): runs with the counter at 0, 4, ..., 28 after its step
    wide = _listing("""        /*0000*/                   UMOV UR15, 0xfffffffc ;
        /*0010*/                   UMOV UR16, 0xffffffff ;
.L_x_0:
        /*0020*/                   UIADD3 UR15, UP0, UR15, 0x4, URZ ;
        /*0030*/                   UIADD3.X UR16, URZ, UR16, URZ, UP0, !UPT ;
        /*0040*/                   UISETP.GE.U32.AND UP0, UPT, UR15, 0x1c, UPT ;
        /*0050*/                   UISETP.GE.U32.AND.EX UP0, UPT, UR16, URZ, UPT, UP0 ;
        /*0060*/                   PLOP3.LUT P3, PT, PT, PT, UP0, 0x40, 0x0 ;
        /*0070*/               @P3 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
""")
    assert kc.trip_count(*_only_loop(wide)) == 8
    assert kc.trip_count(*_only_loop(wide.replace("@P3 BRA", "@!P3 BRA").replace("0x40, 0x0", "0x80, 0x0"))) == 8
    unreadable = down.replace("IADD3 R5, R5, -0x1, RZ", "IMAD R5, R5, R6, RZ")
    with pytest.raises(kc.SassError, match="no readable compare"):
        kc.trip_count(*_only_loop(unreadable))
    unknown_start = down.replace("HFMA2.MMA R5, -RZ, RZ, 0, 4.76837158203125e-07", "LDG.E R5, desc[UR4][R2.64]")
    with pytest.raises(kc.SassError, match="R5 holds no known constant before the loop"):
        kc.trip_count(*_only_loop(unknown_start))


def test_classes_and_shared_bytes():
    def inst(text: str):
        return kc.parse_sass(_listing(f"        /*0000*/                   {text} ;\n"))["f"].instructions[0]

    cases = {"IMAD.MOV.U32 R1, RZ, RZ, R2": "int", "FMNMX R1, R2, R3, !PT": "fp_other",
             "F2FP.BF16.F32.PACK_AB R1, R2, R3": "convert", "SHFL.BFLY PT, R1, R2, 0x1, 0x1f": "shfl",
             "UIADD3 UR4, UR4, 0x1, URZ": "uniform",
             "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]": "ldgsts", "STSM.16.M88.4 [R1], R4": "sts",
             "CCTL.IVALL": "fence", "WARPGROUP.ARRIVE": "bar", "NOP": "nop"}
    assert {text: kc.classify(inst(text)) for text in cases} == cases
    assert [kc._access_bytes(inst(t)) for t in ("LDS.128 R4, [R1]", "LDS.U16 R4, [R1]", "STS.64 [R1], R4",
                                                "LDSM.16.MT88.2 R4, [R1]")] == [512, 64, 256, 256]
    wgmma = inst("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], RZ, !UPT, gsb0")
    assert kc._mma(wgmma) == ("tensor_bf16", 64 * 128 * 16 / 4, (128 + 64) * 16 * 2 / 4)
    from_registers = inst("HGMMA.64x64x8.F32.TF32 R24, R56, gdesc[UR8], R24")
    assert kc._mma(from_registers) == ("tensor_tf32", 64 * 64 * 8 / 4, 64 * 8 * 4 / 4)
    assert kc._mma(inst("HMMA.1684.F32.TF32 R4, R8, R12, R4")) == ("tensor_tf32", 16 * 8 * 4, 0)


def test_missing_nvdisasm_says_how_to_install(monkeypatch, tmp_path):
    toolchain = cr.Toolchain("jax-cuda13-plugin", "0.10.2", "/bin/true", "13.5.37")
    monkeypatch.setattr(cr, "find_toolchain", lambda ptxas=None: toolchain)
    with pytest.raises(cr.ToolchainMissing, match="nvdisasm not found") as error:
        kc.find_tools(nvdisasm=str(tmp_path / "no-nvdisasm"))
    assert "pip install --no-deps 'nvidia-cuda-nvdisasm==13.5.37'" in str(error.value)


def test_cli_names_and_output_folder(capsys):
    assert kc.parse_args(["--out", "x"]).name == "kernel_cost"
    assert kc.parse_args(["--quick", "--no-write"]).name == "kernel_cost-quick"
    assert kc.parse_args(["--ops", "corope", "--no-write"]).name == "kernel_cost-subset"
    with pytest.raises(SystemExit):
        kc.parse_args([])
    assert "--out DIR is required" in capsys.readouterr().err


def test_targets_per_path_by_hand():
    """A target holds on a path when every GQA 8/2 entry of its op, kernel and head dims is within its limit, and is
    met when some path meets it; an entry without plain attention beside it, or that failed, leaves it unmet."""
    def entry(path, head_dim, bound, ratio, fences=0, kv_heads=2, error=None):
        loops = [{"name": "positions", "counted": True, "counts": {"fence": fences + 2},
                  "memory": {"MEMBAR.ALL.GPU": fences, "MEMBAR.ALL.CTA": 1, "FENCE.VIEW.ASYNC.S": 1}}]
        return {"path": path, "op": "corope", "kernel": "forward", "head_dim": head_dim, "q_heads": 8,
                "kv_heads": kv_heads, "error": error, "loops": loops, "per_logit": {"bound": bound},
                "plain": {"same_tiles": {"loop_instruction_ratios": {"positions": ratio}}}}

    data = {"paths": ["pallas", "triton"], "kernels": [
        entry("pallas", 64, 8.9, 3.0), entry("pallas", 64, 2.0, 1.0),  # the worse of the two counts
        entry("triton", 64, 2.9, 1.0), entry("triton", 64, 99.0, 9.0, kv_heads=8),  # MHA is not held
        entry("triton", 128, 6.5, 1.0, fences=3), entry("pallas", 128, 5.0, 1.0, error="boom")]}
    got = {t["id"]: t for t in kc.targets(data)}
    d64 = got["corope-forward-d64"]
    assert d64["paths"]["pallas"] == {"worst": 8.9, "entries": 2, "met": False}
    assert d64["paths"]["triton"] == {"worst": 2.9, "entries": 1, "met": True}
    assert (d64["met"], d64["met_by"]) == (True, ["triton"])
    d128 = got["corope-forward-d128"]
    assert d128["paths"]["pallas"]["worst"] is None and d128["paths"]["triton"]["worst"] == 6.5
    assert not d128["met"] and d128["met_by"] == []
    assert got["cope-forward-full"]["paths"]["triton"]["entries"] == 0 and not got["cope-forward-full"]["met"]


def test_fence_targets_count_gpu_scope_fences_only():
    """The fences around acquire-release atomics (GPU scope) count; the CTA-scope ones that order shared-memory stores
    before a warpgroup dot reads them do not."""
    assert all(kc.gpu_scope_fence(op) for op in ("MEMBAR.ALL.GPU", "MEMBAR.SC.SYS", "ERRBAR", "CCTL.IVALL"))
    assert not any(kc.gpu_scope_fence(op) for op in ("MEMBAR.ALL.CTA", "FENCE.VIEW.ASYNC.S", "CCTL.E.PF2"))
    fences = next(t for t in kc.TARGETS if t.id == "corope-backward-fences")
    entry = {"loops": [{"memory": {"MEMBAR.ALL.GPU": 2, "MEMBAR.ALL.CTA": 5, "REDG.E.ADD.F32.FTZ.RN.STRONG.GPU": 4}},
                       {"memory": {"CCTL.IVALL": 1, "FENCE.VIEW.ASYNC.S": 1}}]}
    assert fences.value(entry) == 3.0


def test_committed_markdown_and_docs_table_are_the_report():
    """results/cost/kernel_cost.md is `markdown` of the JSON beside it; docs/reports/kernel_cost.md shows its `summary`
    and its targets table; the targets in the JSON are `targets` of its entries."""
    data = json.loads(COMMITTED.read_text(encoding="utf-8"))
    assert data["targets"] == kc.targets(data)
    assert COMMITTED.with_suffix(".md").read_text(encoding="utf-8") == kc.markdown(data)
    doc = (ROOT / "docs" / "reports" / "kernel_cost.md").read_text(encoding="utf-8")
    assert "\n" + kc.summary(data) + "<!-- end of summary -->" in doc
    assert "\n" + "\n".join(kc._targets_table(data["targets"])) + "\n<!-- end of targets -->" in doc
    assert kc._authors_sentence(data["authors"]) in doc.replace("\n> ", " ")


def test_auto_prefers_the_path_the_committed_model_finds_faster():
    """jaxpe.dispatch.GPU_PREFERENCE, what impl="auto" tries first on a GPU, is per encoding the path whose kernels
    are faster on the model: its bound per logit is lower in every configuration of the committed grid where both
    compile, for every kernel (forward, the training forward, backward)."""
    from jaxpe.dispatch import GPU_PREFERENCE

    data = json.loads(COMMITTED.read_text(encoding="utf-8"))
    for op, (first, second) in GPU_PREFERENCE.items():
        by_path = {path: {_key({**e, "path": None}): e["per_logit"]["bound"] for e in data["kernels"]
                          if e["op"] == op and e["path"] == path and not e["error"]} for path in (first, second)}
        shared = by_path[first].keys() & by_path[second].keys()
        assert shared, f"{op}: no configuration compiled on both paths"
        slower = {key: (by_path[first][key], by_path[second][key]) for key in shared
                  if by_path[first][key] > by_path[second][key]}
        assert not slower, f"{op}: {first} is slower than {second} on the model at {slower}"


# ------------------------------------------------------------------------------- the committed report, compiled


def _key(entry: dict) -> tuple:
    return tuple(entry.get(k) for k in ("path", "op", "dtype", "head_dim", "q_heads", "kv_heads", "npos", "kernel",
                                        "id"))


def _comparable_report() -> dict:
    """The committed report, after checking that it belongs to these kernel sources, and skipping (saying why) where
    the compilers here are not the report's: another compiler emits other machine code."""
    data = json.loads(COMMITTED.read_text(encoding="utf-8"))
    assert data["kernel_sources_sha256"] == cr.kernel_sources_sha256(data["paths"]), (
        "the kernels changed since the committed cost report: rerun `python benchmarks/kernel_cost.py --out "
        "results/cost --authors-from results/cost/kernel_cost.json` in .venv-compile")
    here, then = kc.versions(TOOLS), data["versions"]
    compilers = [name for name in then if name not in ("python", "jax", "jaxlib", "jax-triton")]
    moved = {name: (then[name], here.get(name)) for name in compilers if here.get(name) != then[name]}
    if moved:
        pytest.skip(f"compilers differ from the committed report's (report, here): {moved}")
    return data


@needs_tools
def test_committed_report_is_current():
    """Same kernel sources as the committed report; four of its kernels (CoPE's Pallas forward, Co-RoPE's Pallas
    backward with its nested loops, Co-RoPE's native Triton forward with its 64-bit chunk counter, plain attention at
    CoPE's tiles) compiled again give the same counts, trip counts and costs."""
    data = _comparable_report()
    cope = [j for j in kc.report_jobs([cr.Case("cope", "bfloat16", 64, 8, 2, 64)]) if j.meta["kernel"] == "forward"]
    corope = [j for j in kc.report_jobs([cr.Case("corope", "bfloat16", 64, 8, 2)]) if j.meta["kernel"] == "backward"]
    if cr.triton_unavailable() is None:
        corope += [j for j in kc.report_jobs([cr.Case("corope", "float32", 64, 8, 2)], ("triton",))
                   if j.meta["kernel"] == "forward"]
    plain = kc.plain_job(kc.plain_spec(cope[0].meta, cope[0].num_warps, cope[0].num_stages, cope[0].tile))
    committed = {_key(e): e for e in data["kernels"] + data["plain"]}
    fields = ("block_q", "block_k", "heads_per_program", "registers", "smem_bytes", "loops", "per_logit")
    for job in cope + corope + [plain]:
        entry = kc.run_job(job, TOOLS, timeout=300)
        assert entry["error"] is None, entry["error"]
        want = committed[_key(entry)]
        assert {f: entry[f] for f in fields} == {f: want[f] for f in fields}, _key(entry)


@needs_tools
def test_targets_hold_on_the_target_kernels_compiled_again():
    """The kernels the targets are read from (GQA 8/2, float32 and bfloat16, D 64 and 128, CoPE at npos 64: its
    loops do not depend on npos) on the path impl="auto" prefers (the Pallas one for the operations that have no
    other), compiled again here beside plain attention: every target's worst value is the committed report's, so
    every target it meets holds (`kernel_cost.targets` on the fresh entries; the fence targets' D 256 entries stay
    with the full report)."""
    from jaxpe.dispatch import GPU_PREFERENCE

    data = _comparable_report()
    preferred = {op: GPU_PREFERENCE.get(op, cr.OP_PATHS[op])[0] for op in cr.OPS}
    missing = {op: path for op, path in preferred.items() if path not in data["paths"]
               or (path == "triton" and cr.triton_unavailable() is not None)}
    if missing:
        pytest.skip(f"paths not compiled here, by op: {missing} ({cr.triton_unavailable()})")
    kernels = []
    for path in sorted(set(preferred.values())):
        cases = [cr.Case(op, dtype, d, 8, 2, 64 if op == "cope" else None) for op in cr.OPS
                 if preferred[op] == path for dtype in cr.DTYPES for d in (64, 128)]
        kernels += kc.collect(cases, TOOLS, paths=(path,), jobs=cr.default_jobs(), timeout=600)[0]
    assert not [e["error"] for e in kernels if e["error"]]
    fresh = {t["id"]: t for t in kc.targets({"paths": sorted(set(preferred.values())), "kernels": kernels})}
    for target in data["targets"]:
        path = preferred[next(t.op for t in kc.TARGETS if t.id == target["id"])]
        want, got = target["paths"][path], fresh[target["id"]]["paths"][path]
        assert got["worst"] == pytest.approx(want["worst"], rel=1e-9, abs=1e-12), target["id"]
        assert got["met"] == want["met"], target["id"]
