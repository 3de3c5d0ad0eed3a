"""Every fused kernel compiles for an H100 (sm_90a) without a GPU, within its budgets (tools/compile_report.py).

Where jax's CUDA plugin (XLA's Triton compiler) and ptxas are installed (`make test-compile` makes .venv-compile with
both), each kernel of the report's configurations (CoPE, Co-RoPE, forgetting and stick-breaking attention;
f32/bf16; D 64/128/256; GQA 8/2, and MHA 8/8 at D 64; CoPE npos 64 and 513) on each of its paths (the Pallas kernels;
for CoPE, Co-RoPE and stick-breaking the native Triton kernels too, where triton and jax-triton are installed)
compiles to PTX and then to SASS, and is held to two checks: it would launch (compiles; shared memory within sm_90's 232448 bytes), and it spills
no more than its budget (none in forward kernels, at most 512 bytes per thread in the backward kernel). Elsewhere
those tests skip, saying why. Everywhere: the committed report (results/compile/sm90a.json, docs/reports/kernels.md's
table) belongs to the kernel sources as they are and finds every kernel within budget, and the report's own pieces
(lowering, recording the Triton launches, ptxas parsing, verdicts, the errors without a toolchain) work.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORT = ROOT / "results" / "compile" / "sm90a.json"
sys.path.insert(0, str(ROOT / "tools"))  # tools/compile_report.py, a script beside the library (not in the wheel)
import compile_report as cr  # noqa: E402


def _toolchain() -> cr.Toolchain | str:
    try:
        return cr.find_toolchain()
    except cr.ToolchainMissing as e:
        return str(e)


TOOLCHAIN = _toolchain()
TRITON = cr.triton_unavailable()  # why the native Triton kernels cannot be compiled here, or None
needs_toolchain = pytest.mark.skipif(isinstance(TOOLCHAIN, str), reason=f"no GPU compiler here: {TOOLCHAIN}")
needs_triton = pytest.mark.skipif(TRITON is not None, reason=f"no Triton compiler here: {TRITON}")
ROLES = ("forward", "forward_train", "backward")
TRITON_OPS = tuple(op for op in cr.OPS if "triton" in cr.OP_PATHS[op])  # the ops with native Triton kernels


def compiled_here(case: cr.Case) -> bool:
    """The configurations compiled again here, at every dtype and npos on both paths: GQA 8/2 at D 256 (the largest
    tiles, where registers and shared memory run shortest) and MHA 8/8 at D 64 (the smallest tiles, no group of
    heads sharing a key block): a third of the report's grid, so that CI's compile leg stays within its time. GQA
    8/2 at D 64 and 128 is compiled again by tests/test_kernel_cost.py on the path `auto` prefers; the committed
    report, which covers the whole grid, is held to the budgets and to the kernel sources below."""
    gqa = case.kv_heads != case.q_heads
    return (gqa and case.head_dim == 256) or (not gqa and case.head_dim == 64)


def _params() -> list:
    """(path, case, role) for every kernel of the report's configurations `compiled_here`."""
    if isinstance(TOOLCHAIN, str):  # one skipped test rather than a few hundred
        return [pytest.param(None, None, None, id="no-toolchain")]
    params = [pytest.param("pallas", case, role, id=f"pallas-{case.id}-{role}")
              for case in cr.default_cases() if compiled_here(case) for role in ROLES]
    if TRITON is not None:
        return params + [pytest.param("triton", None, None, id="triton-unavailable",
                                      marks=pytest.mark.skip(reason=f"no Triton compiler here: {TRITON}"))]
    return params + [pytest.param("triton", case, role, id=f"triton-{case.id}-{role}")
                     for case in cr.default_cases(TRITON_OPS) if compiled_here(case) for role in ROLES]


@pytest.fixture(scope="module")
def compiled(request) -> dict[tuple[str, str, str], cr.Row]:
    """Rows of every (path, case) that the selected tests of this module ask for, compiled together (a compile per
    CPU), by (path, case id, role)."""
    cases, paths = [], []
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if item.module is request.module and params and params.get("case") is not None:
            cases += [params["case"]] if params["case"] not in cases else []
            paths += [params["path"]] if params["path"] not in paths else []
    rows = cr.compile_cases(cases, TOOLCHAIN, paths=[p for p in cr.PATHS if p in paths], jobs=cr.default_jobs(),
                            timeout=1200)
    return {(row.path, row.case_id, row.kernel): row for row in rows}


@needs_toolchain
@pytest.mark.parametrize("path, case, role", _params())
def test_kernel_compiles_within_shared_memory(compiled, path, case, role):
    row = compiled.get((path, case.id, role))
    assert row is not None, (f"{path} {case.id} lowered to no {role} kernel: "
                             f"{sorted(k for p, c, k in compiled if (p, c) == (path, case.id))}")
    assert row.error is None, row.error
    assert row.registers is not None and row.ptx_bytes
    assert row.smem_bytes <= cr.SMEM_LIMIT_BYTES, f"{row.smem_bytes=} > {cr.SMEM_LIMIT_BYTES}"


@needs_toolchain
@pytest.mark.parametrize("path, case, role", _params())
def test_kernel_spills_within_budget(compiled, path, case, role):
    row = compiled.get((path, case.id, role))
    assert row is not None and row.error is None, row and row.error
    assert row.spill_problems() == [], f"{path} {case.id} {role}: {row.spill_problems()}"


@needs_toolchain
def test_report_and_markdown(compiled):
    """The JSON report names the target and every version; the Markdown has a row per kernel, each naming its path."""
    rows = list(compiled.values())
    data = cr.report(rows, TOOLCHAIN, command="python tools/compile_report.py --quick --no-write")
    assert data["target"]["gpu_name"] == "sm_90a" and data["versions"]["ptxas"] == TOOLCHAIN.ptxas_version
    assert cr.markdown(data).splitlines()[2].startswith("`python tools/compile_report.py --quick --no-write`, ")
    assert data["versions"][TOOLCHAIN.plugin] == data["versions"]["jaxlib"]
    assert ("triton" in data["versions"]) == any(row.path == "triton" for row in rows)
    assert cr.markdown(data).count("\n| pallas | ") + cr.markdown(data).count("\n| triton | ") == len(rows)


# -------------------------------------------------------------------------------- the pieces, on any machine


def test_committed_report_is_current_and_within_budget():
    """results/compile/sm90a.json was made from these kernel sources, covers the full grid and has no problem."""
    data = json.loads(REPORT.read_text(encoding="utf-8"))
    assert data["kernel_sources_sha256"] == cr.kernel_sources_sha256(cr.PATHS), (
        "the kernels changed since the committed report: rerun `make compile-report`")
    rows = [cr.Row.from_dict(row) for row in data["rows"]]
    expected = {(path, case.id, role) for case in cr.default_cases() for path in cr.OP_PATHS[case.op]
                for role in ROLES}
    assert {(row.path, row.case_id, row.kernel) for row in rows} == expected and data["skipped"] == {}
    assert [(row.path, row.case_id, row.kernel, row.problems()) for row in rows if row.problems()] == []
    assert data["target"]["spill_budget_bytes"] == cr.SPILL_BUDGET_BYTES


def test_committed_markdown_is_the_report():
    """sm90a.md is what `markdown` makes of sm90a.json (docs/reports/kernels.md's table comes from the same rows)."""
    data = json.loads(REPORT.read_text(encoding="utf-8"))
    assert REPORT.with_suffix(".md").read_text(encoding="utf-8") == cr.markdown(data)


@pytest.mark.parametrize("op", cr.OPS)
def test_every_kernel_lowers_with_its_role(op):
    case = cr.Case(op, "bfloat16", 64, 4, 2, 16 if op == "cope" else None, length=128)
    kernels = cr.lower_kernels(case)
    assert tuple(k.role for k in kernels) == ROLES
    assert all(k.ir and k.num_warps in (1, 2, 4, 8, 16) and k.num_stages >= 1 for k in kernels)


@needs_triton
@pytest.mark.parametrize("op", TRITON_OPS)
def test_every_triton_kernel_is_recorded_with_its_role(op):
    """Tracing the native Triton op and its gradient under the recorder gives a launch per role (the same ones when
    traced again), with every parameter typed, and leaves `launch` as it was."""
    from jaxpe.kernels import _triton_launch

    launch = _triton_launch.launch
    case = cr.Case(op, "bfloat16", 64, 4, 2, 16 if op == "cope" else None, length=128)
    kernels = cr.record_triton_kernels(case)
    assert tuple(k.role for k in kernels) == ROLES
    assert cr.record_triton_kernels(case) == kernels
    assert kernels[0].spec == kernels[1].spec  # the gradient's forward is the inference forward
    assert all(k.num_warps in (1, 2, 4, 8, 16) and k.num_stages >= 1 and k.grid[0] >= 1 for k in kernels)
    for kernel in kernels:
        spec = json.loads(kernel.spec)
        assert spec["kernel"].startswith(f"jaxpe.kernels.{op}_triton:")
        floats = {"fp64", "fp32"}  # a Python float scalar: jax-triton 0.3 gives fp64, 0.4 fp32 where it fits
        assert set(spec["signature"].values()) <= {"*bf16", "*fp32", "*i32", "i32", "constexpr"} | floats
        assert {n for n, t in spec["signature"].items() if t == "constexpr"} == set(spec["constexprs"])
        assert [list(spec["signature"]).index(n) for n, t in spec["signature"].items() if t[0] == "*"] == \
            spec["aligned"]
    assert _triton_launch.launch is launch
    assert sys.modules[f"jaxpe.kernels.{op}_triton"].launch is launch


@needs_toolchain
@needs_triton
@pytest.mark.parametrize("op", TRITON_OPS)
def test_recorded_launches_compile_to_what_jax_triton_runs(op, tmp_path):
    """The gradient's launches, recorded and compiled by the report, give the very PTX and shared memory that
    jax-triton compiles when the op's gradient is lowered for CUDA (its JAX_TRITON_DUMP_DIR files, in a process that
    imports triton compiled rather than interpreted)."""
    case = cr.Case(op, "bfloat16", 64, 4, 2, 16 if op == "cope" else None, length=128)
    rows = [cr.compile_kernel(kernel, TOOLCHAIN, timeout=600, ptx_dir=tmp_path / "report")
            for kernel in cr.record_triton_kernels(case)[1:]]
    assert [row.error for row in rows] == [None, None]
    script = ("import sys\n"
              "sys.path.insert(0, sys.argv[1])\n"
              "import compile_report as cr\n"
              f"fn, args = cr._attention(cr.{case!r}, 'triton')\n"
              "cr._lowered_for_gpu(cr._gradient(fn, len(args)), args)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="0", JAX_TRITON_DUMP_DIR=str(tmp_path / "dump"))
    out = subprocess.run([sys.executable, "-c", script, str(ROOT / "tools")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    dumped = sorted((tmp_path / "dump").rglob("*.ptx"))
    assert (sorted(p.read_text(encoding="utf-8") for p in dumped)
            == sorted(p.read_text(encoding="utf-8") for p in (tmp_path / "report").glob("*.ptx")))
    smem = [int(p.with_suffix(".compile_info").read_text(encoding="utf-8").rsplit(":", 1)[1]) for p in dumped]
    assert sorted(smem) == sorted(row.smem_bytes for row in rows)


def test_compile_subprocesses_outlive_a_refused_kernel_and_are_replaced_after_a_crash_or_a_timeout(monkeypatch):
    """The compile subprocesses stay up between kernels: a kernel the compiler refuses is an error row and the same
    subprocess takes the next; one killed mid-way, or past its timeout, gives its kernel an error and a fresh one
    takes the next. Errors are not kept: asked again, a kernel compiles again."""
    pytest.importorskip("triton")
    monkeypatch.setattr(cr, "_COMPILERS", cr._Compilers())
    compiled = []
    monkeypatch.setattr(cr, "_compiled_to_ptx", lambda *args, _compile=cr._compiled_to_ptx, **kwargs: (
        compiled.append(args[1]) or _compile(*args, **kwargs)))
    processes = cr._Processes()
    refused = b'{"kernel": "jaxpe.kernels.cope_triton:no_such_kernel"}'

    def compile_(source: bytes, timeout: float = 300.0) -> dict:
        return cr.triton_to_ptx("triton", source, 4, 1, timeout=timeout, processes=processes)

    def server() -> int:
        [idle] = cr._COMPILERS._idle
        return idle.process.pid

    assert "AttributeError" in compile_(refused)["error"] and "no_such_kernel" in compile_(refused)["error"]
    assert len(compiled) == 2  # the error was not kept
    first = server()
    compile_(refused)
    assert server() == first
    cr._COMPILERS._idle[0].process.kill()
    assert "Triton compile exited" in compile_(refused)["error"] and cr._COMPILERS._idle == []
    assert "AttributeError" in compile_(refused)["error"] and server() != first
    second = server()
    assert compile_(refused, timeout=1e-6)["error"] == "Triton compile timed out after 1e-06 s"
    assert cr._COMPILERS._idle == []
    assert "AttributeError" in compile_(refused)["error"] and server() not in (first, second)
    cr._COMPILERS.close()


def test_parse_ptxas():
    text = """ptxas info    : Compiling entry function 'cope_backward_dq' for 'sm_90a'
ptxas info    : Function properties for cope_backward_dq
    608 bytes stack frame, 1016 bytes spill stores, 1076 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 608 bytes cumulative stack size"""
    assert cr.parse_ptxas(text) == {"registers": 255, "stack_frame": 608, "spill_stores": 1016, "spill_loads": 1076}
    assert cr.parse_ptxas("ptxas fatal   : Unresolved extern function") == {}


def test_budget_verdicts():
    kernel = cr.Kernel(cr.Case("cope", "float32", 64, 8, 2, 64), "backward", "cope_backward", 4, 2, (16, 1, 8), b"")
    row = cr._row(kernel, registers=255, spill_stores=1016, spill_loads=1076, smem_bytes=65536, ptx_bytes=1)
    assert row.problems() == ["spills 1016/1076 bytes (store/load) > 512"]
    fits = cr._row(kernel, registers=255, spill_stores=248, spill_loads=264, smem_bytes=cr.SMEM_LIMIT_BYTES)
    assert fits.problems() == []
    forward = cr._row(dataclasses.replace(kernel, role="forward"), spill_stores=4, spill_loads=4, smem_bytes=240000)
    assert forward.problems() == ["shared memory 240000 > 232448 bytes", "spills 4/4 bytes (store/load) > 0"]
    assert cr._row(kernel, error="boom").problems() == ["failed: boom"]
    unknown = cr._row(dataclasses.replace(kernel, role="dkv"), spill_stores=0, spill_loads=0, smem_bytes=1)
    assert unknown.problems() == ["no spill budget for a 'dkv' kernel (roles: forward, forward_train, backward)"]


def test_missing_toolchain_says_how_to_install(monkeypatch):
    version = importlib.metadata.version

    def without_plugins(name: str) -> str:
        if name in cr.PLUGINS:
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_plugins)
    with pytest.raises(cr.ToolchainMissing, match=r"pip install 'jax-cuda13-plugin==\d") as error:
        cr.find_toolchain()
    assert "pip install --no-deps nvidia-cuda-nvcc" in str(error.value) and "JAX_PLATFORMS=cpu" in str(error.value)
    assert cr.main(["--quick", "--no-write"]) == 2


def test_missing_ptxas_says_how_to_install(monkeypatch, tmp_path):
    version = importlib.metadata.version
    jaxlib = version("jaxlib")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: jaxlib if name in cr.PLUGINS else version(name))
    from jax._src.lib import triton

    monkeypatch.setattr(triton, "compile", lambda *args, **kwargs: None, raising=False)  # gone in jax 0.12
    with pytest.raises(cr.ToolchainMissing, match="ptxas not found") as error:
        cr.find_toolchain(ptxas=str(tmp_path / "no-ptxas"))
    assert "pip install --no-deps nvidia-cuda-nvcc" in str(error.value)


def test_without_triton_the_report_skips_its_rows_saying_why(monkeypatch, capsys):
    """No jax-triton: triton_unavailable says what to install, and the report is made of the Pallas rows with a
    sentence saying why the Triton ones are missing."""
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", None)  # import fails
    why = cr.triton_unavailable()
    release = "jax-triton==0.3.1" if sys.version_info < (3, 12) else "jax-triton>=0.4.1,<0.5"  # jax 0.10; >= 0.11
    assert why is not None and f"pip install --no-deps '{release}' absl-py" in why
    asked = []
    toolchain = cr.Toolchain("jax-cuda13-plugin", importlib.metadata.version("jaxlib"), "ptxas", "13.0.0")
    monkeypatch.setattr(cr, "find_toolchain", lambda ptxas=None: toolchain)
    monkeypatch.setattr(cr, "compile_cases", lambda cases, toolchain, *, paths, **kwargs: asked.append(paths) or [])
    assert cr.main(["--quick", "--no-write"]) == 0
    assert asked == [("pallas",)]
    assert f"No triton rows: {why}" in capsys.readouterr().out


def test_cli_subsets():
    args = cr.parse_args(["--ops", "cope", "--dtypes", "bf16", "--head-dims", "64,128", "--heads", "8/2,4",
                          "--no-write"])
    assert (args.ops, args.dtypes, args.head_dims, args.heads, args.name) == (
        ("cope",), ("bfloat16",), (64, 128), ((8, 2), (4, 4)), "sm90a-subset")
    assert cr.parse_args(["--out", "report"]).name == "sm90a"
    assert cr.parse_args(["--out", "report"]).out == pathlib.Path("report")
    assert cr.parse_args(["--quick", "--no-write"]).head_dims == (64,)
    assert cr.parse_args(["--no-write"]).paths == ("pallas", "triton")
    assert cr.parse_args(["--paths", "triton", "--out", "report"]).name == "sm90a-subset"
    with pytest.raises(SystemExit):
        cr.parse_args(["--ops", "rope", "--no-write"])
    with pytest.raises(SystemExit):
        cr.parse_args(["--paths", "cuda", "--no-write"])


def test_output_folder_is_an_argument(capsys):
    """No default output folder: the report is written only where --out says."""
    with pytest.raises(SystemExit):
        cr.parse_args([])
    assert "--out DIR is required" in capsys.readouterr().err


def test_kernel_sources_are_the_kernels_and_their_jaxpe_imports():
    """The report's fingerprint covers the Pallas and the native Triton kernel files, the launcher and the shared
    kernel modules they import; by default (the cost report's), the Pallas ones only."""
    sources = cr.kernel_sources(cr.PATHS)
    assert {"jaxpe.kernels.cope_pallas", "jaxpe.kernels.corope_pallas", "jaxpe.kernels.fox_pallas",
            "jaxpe.kernels.stickbreaking_pallas", "jaxpe.kernels._pallas_rows", "jaxpe.kernels._common",
            "jaxpe.kernels.cope_triton", "jaxpe.kernels.corope_triton", "jaxpe.kernels._triton_launch"} <= set(sources)
    assert all(name.startswith("jaxpe.") and path.is_file() for name, path in sources.items())
    assert sources["jaxpe.kernels.cope_pallas"] == ROOT / "kernels" / "cope_pallas.py"
    assert sources["jaxpe.kernels._triton_launch"] == ROOT / "kernels" / "_triton_launch.py"
    assert not any("triton" in name for name in cr.kernel_sources())
    assert cr.kernel_sources_sha256(cr.PATHS) != cr.kernel_sources_sha256()
